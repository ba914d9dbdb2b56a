"""Autotuning: the space, the cost model and pruning (pure), a trial's metrics window, killing a hung trial,
and `shardspeed autotune` end to end on a tiny GPT (world 1), whose optimum must load in shardspeed and in
DeepSpeed."""
from __future__ import annotations

import importlib.util
import json
import os
import pathlib
import sys
import time
from dataclasses import replace

import pytest
import torch

from shardspeed.autotune.memory import EstimatorMemoryModel, checkpointed_share, spec_from_facts
from shardspeed.autotune.model import (
    CostModel,
    LinkProfile,
    Measurement,
    ModelInfo,
    Prediction,
    StateMemoryModel,
    fits,
    spearman,
)
from shardspeed.autotune.probe import ModelFacts, ProfileWindow
from shardspeed.autotune.report import CandidateRecord, summary_table
from shardspeed.autotune.search import Tuner, find_config_arg
from shardspeed.autotune.space import (
    Candidate,
    TuningSpace,
    apply_candidate,
    default_space,
    enumerate_candidates,
    micro_batch_sizes,
    user_global_batch,
    user_plan,
)
from shardspeed.autotune.trials import run_command
from shardspeed.cli import main
from shardspeed.config import AutotuningConfig, load_config
from shardspeed.errors import ConfigError
from shardspeed.memory_estimate import estimate_model_state_memory

ROOT = pathlib.Path(__file__).resolve().parents[1]
SCRIPT = str(ROOT / "benchmarks" / "autotune_gpt.py")
USER = {"train_batch_size": 16, "bf16": {"enabled": True}, "gradient_clipping": 0.5,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
        "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 3}},
        "zero_optimization": {"stage": 1, "overlap_comm": False, "offload_optimizer": {"device": "cpu",
                                                                                      "pin_memory": True}},
        "steps_per_print": 7}
LINK = LinkProfile(latency_s=1e-4, bus_bandwidth=1e9, adam_s_per_elem=2e-9, host_adam_s_per_elem=4e-9,
                   copy_bandwidth=5e9)
INFO = ModelInfo(num_params=10_000_000, largest_unit=1_000_000, num_units=10, dtype="bf16", world_size=2,
                 device_is_host=False)


# ---- space ------------------------------------------------------------------------------------------

def test_candidates_keep_the_global_batch_and_valid_offload():
    cands = enumerate_candidates(default_space(16, 2), 16, 2)
    assert {c.micro_batch for c in cands} == {1, 2, 4, 8}
    # stage 0: 4; stages 1-2: 4 x (offload or not); stage 3: 4 x 2 x 2; each with checkpointing on and off
    assert len(cands) == 2 * (4 + 8 + 8 + 16)
    assert sum(c.activation_checkpointing for c in cands) == len(cands) // 2
    for c in cands:
        assert c.micro_batch * c.grad_accum * 2 == 16
        assert not (c.offload_optimizer and c.stage == 0) and not (c.offload_param and c.stage != 3)
    assert len({c.name for c in cands}) == len(cands)
    assert micro_batch_sizes(12, 2, 6) == (2, 3, 4, 6)
    assert len(enumerate_candidates(default_space(16, 2, fast=False), 16, 2)) == 3 * len(cands)
    with pytest.raises(ConfigError, match="divides the per-rank batch"):
        default_space(16, 2, mbs_range=(16, 32))


def test_apply_candidate_keeps_every_other_section_and_loads():
    for cand in (Candidate(3, 2, 4, True, True, 1 << 20), Candidate(0, 8, 1),
                 Candidate(2, 4, 2, True, activation_checkpointing=True)):
        cfg = apply_candidate(USER, cand, 2)
        for key in ("bf16", "gradient_clipping", "optimizer", "scheduler", "steps_per_print"):
            assert cfg[key] == USER[key]
        z = cfg["zero_optimization"]
        assert z["stage"] == cand.stage and z["overlap_comm"] is False
        assert ("offload_optimizer" in z) == cand.offload_optimizer and ("offload_param" in z) == cand.offload_param
        if cand.offload_optimizer:
            assert z["offload_optimizer"]["pin_memory"] is True  # the user's block, kept
        loaded = load_config(cfg, world_size=2)
        assert (loaded.train_batch_size, loaded.train_micro_batch_size_per_gpu,
                loaded.gradient_accumulation_steps) == (16, cand.micro_batch, cand.grad_accum)
        assert loaded.activation_checkpointing.enabled == cand.activation_checkpointing
    assert USER["zero_optimization"]["stage"] == 1  # the user's dict untouched


def test_find_config_arg_forms():
    assert find_config_arg(["--x", "1", "--deepspeed_config", "a.json"]) == (3, "a.json")
    assert find_config_arg(["--deepspeed=b.json"]) == (0, "b.json")
    with pytest.raises(ConfigError, match="--deepspeed_config"):
        find_config_arg(["--lr", "1"])


# ---- cost model -------------------------------------------------------------------------------------

def test_model_states_are_the_estimators_and_offload_counts_on_a_cpu_device():
    mem = StateMemoryModel(INFO)
    for c in (Candidate(0, 1, 8), Candidate(2, 1, 8, True), Candidate(3, 1, 8, True, True)):
        ref = estimate_model_state_memory(INFO.num_params, 2, c.stage, "bf16", c.offload_optimizer, c.offload_param)
        assert mem.states(c) == (ref.device, ref.host)
    cpu = StateMemoryModel(ModelInfo(**{**INFO.__dict__, "device_is_host": True}))
    c = Candidate(2, 1, 8, True)
    ref = estimate_model_state_memory(INFO.num_params, 2, 2, "bf16", True, False)
    assert cpu.states(c) == (ref.device + ref.host, ref.host)  # one memory: offloading frees nothing


def test_every_candidate_is_priced_as_its_plan():
    """The cost model prices the plan decide() makes of the candidate's config: model states are
    shardspeed.estimate.model_states of it, and the step-time terms follow its sharding and placement."""
    from shardspeed.autotune.model import StepTimeModel, candidate_plan
    from shardspeed.estimate import model_states
    from shardspeed.plan import decide

    for c in enumerate_candidates(default_space(16, 2), 16, 2):
        plan = candidate_plan(INFO, c)
        assert plan == decide(apply_candidate({"bf16": {"enabled": True},
                                               "zero_optimization": {"reduce_bucket_size": INFO.default_bucket}},
                                              c, 2), 2)
        m = model_states(plan, INFO.num_params)
        assert StateMemoryModel(INFO).states(c) == (m.device, m.host)
        o = StepTimeModel(INFO, LINK).overheads(c)
        assert ("offload_copies" in o) == (plan.placement.optimizer != "device")
        assert ("param_fetch" in o) == (plan.placement.params != "device")
    # nothing in the cost model decides from the candidate's stage or offload flags but its variant key
    import ast
    import inspect

    import shardspeed.autotune.model as cost

    reads = [n.lineno for n in ast.walk(ast.parse(inspect.getsource(cost))) if isinstance(n, ast.Attribute)
             and n.attr in ("offload_optimizer", "offload_param", "tp", "grad_accum", "activation_checkpointing")]
    assert len(reads) == 3  # _variant's key: (stage, offload_optimizer, offload_param, tp)


def test_memory_fit_recovers_base_and_activations():
    truth = StateMemoryModel(INFO, base=3e8, act_per_sample=4e7)
    runs = [Measurement(c, truth.predict(c)[0], 1.0) for c in (Candidate(3, 1, 8), Candidate(3, 8, 1))]
    fitted = StateMemoryModel(INFO).fit(runs)
    assert fitted.base == pytest.approx(3e8, rel=1e-9) and fitted.act_per_sample == pytest.approx(4e7, rel=1e-9)
    for c in enumerate_candidates(default_space(16, 2), 16, 2):
        assert fitted.predict(c)[0] == pytest.approx(truth.predict(c)[0], rel=1e-9)


PLAIN = {k: v for k, v in USER.items() if k != "zero_optimization"}  # the user's config, no ZeRO block


def test_estimator_prior_is_estimate_peak_without_activations():
    from shardspeed.estimate import ActivationProfile, estimate_peak

    spec = spec_from_facts(10_000_000, 1_000_000, 10)
    assert spec.num_params == 10_000_000 and spec.stage3_units[-1] == 1_000_000 and len(spec.stage3_units) == 10
    mem = EstimatorMemoryModel.create(INFO, {**PLAIN, "autotuning": {"enabled": True}})
    assert "autotuning" not in mem.config
    for cand in (Candidate(0, 4, 2), Candidate(2, 8, 1, True), Candidate(3, 1, 8, True, True)):
        est = estimate_peak(spec.with_activations(ActivationProfile(0, 0, cand.micro_batch, 1, False)),
                            apply_candidate(PLAIN, cand, 2), world_size=2)
        assert mem.structural(cand) == (est.device, est.host)
    z0, z3 = mem.structural(Candidate(0, 4, 2))[0], mem.structural(Candidate(3, 4, 2))[0]
    assert z0 >= 10_000_000 * (2 + 2 + 4 + 8) > z3  # bf16 params + grads, fp32 master + Adam, all on one rank
    assert mem.structural(Candidate(2, 4, 2, True))[1] >= 10_000_000 / 2 * 12  # master + Adam on the host
    on_cpu = EstimatorMemoryModel.create(ModelInfo(**{**INFO.__dict__, "device_is_host": True}), PLAIN)
    dev, host = on_cpu.structural(Candidate(2, 4, 2, True))
    assert host < dev <= mem.structural(Candidate(2, 4, 2, True))[0] + host  # one memory: the worst phase's sum


def test_estimator_prior_fits_bases_activations_and_the_checkpointed_share():
    prior = EstimatorMemoryModel.create(INFO, PLAIN)
    truth = replace(prior, base=3e8, act_per_sample=4e7, ckpt_share=0.25,
                    variant_base=(((3, False, False, 1), 3e8), ((1, False, False, 1), 3.4e8)))
    cands = [Candidate(3, 1, 8), Candidate(3, 8, 1), Candidate(1, 2, 4), Candidate(3, 4, 2, activation_checkpointing=True)]
    fitted = prior.fit([Measurement(c, truth.predict(c)[0], 1.0) for c in cands])
    assert fitted.act_per_sample == pytest.approx(4e7, rel=1e-6) and fitted.ckpt_share == pytest.approx(0.25, rel=1e-6)
    assert dict(fitted.variant_base)[(1, False, False, 1)] == pytest.approx(3.4e8, rel=1e-6)
    assert fitted.measured(Candidate(1, 8, 1)) and not fitted.measured(Candidate(2, 8, 1))
    assert fitted.measured(Candidate(1, 8, 1, activation_checkpointing=True))
    plain_only = prior.fit([Measurement(c, truth.predict(c)[0], 1.0) for c in cands[:3]])
    assert not plain_only.measured(Candidate(1, 8, 1, activation_checkpointing=True))
    for c in (Candidate(1, 8, 1), Candidate(3, 2, 4, activation_checkpointing=True)):  # measured variants
        assert fitted.predict(c)[0] == pytest.approx(truth.predict(c)[0], rel=1e-6)
    unmeasured = Candidate(2, 8, 1, True, activation_checkpointing=True)  # the estimator + the mean base on top
    assert fitted.predict(unmeasured)[0] == pytest.approx(
        fitted.structural(unmeasured)[0] + 3.2e8 + 4e7 * 8 * 0.25, rel=1e-6)
    # the prior's share comes from the activation formulas when the model's shape is known
    from shardspeed.estimate import describe_gpt
    from shardspeed.models import GPTConfig

    spec = describe_gpt(GPTConfig(vocab_size=256, block_size=64, n_layer=4, n_head=4, n_embd=128), PLAIN, trace=False)
    share = checkpointed_share(spec, 2, 64)
    assert share is not None and 0.1 < share < 0.5 and checkpointed_share(spec_from_facts(10, 5, 2), 2) is None
    assert EstimatorMemoryModel.create(INFO, PLAIN, spec, micro_batch=2, seq_len=64).ckpt_share == share


def test_checkpointing_trades_memory_for_recompute_time():
    model = CostModel.create(INFO, LINK, EstimatorMemoryModel.create(INFO, PLAIN)).fit(
        [Measurement(Candidate(3, m, 8 // m), 1e9 + 5e7 * m, 0.1 + 0.05 * m) for m in (1, 8)])
    plain, ckpt = model.predict(Candidate(3, 8, 1)), model.predict(Candidate(3, 8, 1, activation_checkpointing=True))
    assert ckpt.device_bytes < plain.device_bytes and ckpt.step_time_s > plain.step_time_s
    assert plain.device_bytes - ckpt.device_bytes == pytest.approx(
        model.memory.act_per_sample * 8 * (1 - model.memory.ckpt_share), rel=1e-6)
    assert ckpt.breakdown["compute"] == pytest.approx(plain.breakdown["compute"] + model.time.per_sample * 8 / 3)


def test_time_fit_recovers_compute_terms_and_ranks_the_space():
    truth = CostModel.create(INFO, LINK)
    truth = CostModel(truth.memory, truth.time.__class__(INFO, LINK, per_micro_step=0.02, per_sample=0.01))
    cands = enumerate_candidates(default_space(16, 2), 16, 2)
    runs = [Measurement(c, 1e9, truth.predict(c).step_time_s) for c in (Candidate(3, 1, 8), Candidate(3, 8, 1))]
    fitted = CostModel.create(INFO, LINK).fit(runs)
    assert fitted.time.per_micro_step == pytest.approx(0.02) and fitted.time.per_sample == pytest.approx(0.01)
    pred = [fitted.predict(c).step_time_s for c in cands]
    assert spearman(pred, [truth.predict(c).step_time_s for c in cands]) == pytest.approx(1.0)
    # the model's structure: more accumulation steps cost more; stage 3 pays its gathers; offload its copies
    t = {c: fitted.predict(c).step_time_s for c in cands}
    assert t[Candidate(0, 8, 1)] < t[Candidate(0, 1, 8)]
    assert t[Candidate(3, 4, 2)] > t[Candidate(2, 4, 2)]
    assert t[Candidate(2, 4, 2, True)] > t[Candidate(2, 4, 2)]


def test_pruning_by_budget():
    p = Prediction(device_bytes=1.04e9, host_bytes=5e8, step_time_s=1.0)
    assert fits(p, 1e9, None, margin=0.05) and not fits(p, 1e9, None)
    assert not fits(p, 2e9, 4e8) and fits(p, None, None)


def test_spearman():
    assert spearman([1, 2, 3, 4], [10, 20, 30, 40]) == pytest.approx(1.0)
    assert spearman([1, 2, 3, 4], [4, 3, 2, 1]) == pytest.approx(-1.0)
    assert spearman([1, 2, 3, 4, 5], [2, 1, 4, 3, 5]) == pytest.approx(0.8)


def test_summary_lists_every_candidate_with_status():
    recs = [CandidateRecord(Candidate(0, 1, 2), Prediction(2e9, 0, 0.5), [0.4], 1.9e9, "best"),
            CandidateRecord(Candidate(3, 2, 1), Prediction(9e9, 0, 0.3), [], None, "pruned: memory 9 GB > 4 GB")]
    text = summary_table(recs, "hdr")
    assert text.splitlines()[0] == "hdr" and "z0_mbs1_gas2" in text and "pruned: memory" in text
    assert "0.400" in text and "9.000" in text


# ---- config and a trial's metrics ---------------------------------------------------------------------

def test_autotuning_block_loads_deepspeed_keys_and_refuses_bad_ranges():
    block = {"enabled": True, "fast": False, "metric": "latency", "start_profile_step": 2, "end_profile_step": 4,
             "max_train_batch_size": 64, "min_train_micro_batch_size_per_gpu": 1,
             "max_train_micro_batch_size_per_gpu": 8, "num_tuning_micro_batch_sizes": 3, "tuner_type": "gridsearch",
             "tuner_early_stopping": 5, "tuner_num_trials": 50, "arg_mappings": {}, "results_dir": "r",
             "exps_dir": "e", "overwrite": False, "device_memory_budget": 1e9, "wall_time_budget": 60}
    cfg = load_config({"train_batch_size": 4, "autotuning": block})
    assert cfg.autotuning.metric == "latency" and cfg.autotuning.device_memory_budget == 1e9
    with pytest.raises(ConfigError, match="end_profile_step"):
        load_config({"train_batch_size": 4, "autotuning": {"start_profile_step": 5, "end_profile_step": 2}})
    with pytest.raises(ConfigError, match="tuner_type"):
        load_config({"train_batch_size": 4, "autotuning": {"tuner_type": "bayes"}})


def test_profile_window_times_the_window_and_writes_metrics(tmp_path):
    path = str(tmp_path / "m.json")
    w = ProfileWindow(start_step=2, end_step=4, metric_path=path, train_batch_size=8, micro_batch_size=2,
                      gradient_accumulation_steps=2, facts=ModelFacts(100, 60, 2), device=torch.device("cpu"),
                      exit=False)
    for step in range(1, 5):
        time.sleep(0.02)
        w.after_step(step)
    m = json.loads(pathlib.Path(path).read_text())
    assert len(m["step_times_s"]) == 3 and all(t >= 0.015 for t in m["step_times_s"])
    assert m["throughput"] == pytest.approx(8 / m["step_time_s"]) and m["latency"] == pytest.approx(m["step_time_s"] * 1e3)
    assert m["peak_memory"] > 10 << 20 and (m["num_params"], m["largest_unit"], m["num_units"]) == (100, 60, 2)


# ---- trials -------------------------------------------------------------------------------------------

_HANGER = ("import subprocess, sys, time\n"
           "p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)'], start_new_session=True)\n"
           "print(p.pid, flush=True)\n"
           "time.sleep(600)\n")


def test_hung_trial_and_its_other_session_children_are_killed(tmp_path):
    t0 = time.perf_counter()
    res = run_command([sys.executable, "-c", _HANGER], str(tmp_path), timeout_s=3.0)
    assert res.status == "timeout" and time.perf_counter() - t0 < 3.0 + 6.0
    grandchild = int((tmp_path / "stdout.log").read_text().split()[0])
    assert not os.path.exists(f"/proc/{grandchild}") or "Z" in pathlib.Path(f"/proc/{grandchild}/stat").read_text().split(")")[-1].split()[0]


def test_failed_trial_is_data(tmp_path):
    res = run_command([sys.executable, "-c", "raise MemoryError('out of memory')"], str(tmp_path), timeout_s=30)
    assert res.status == "oom" or (res.status == "failed" and "out of memory" in res.error)
    assert "MemoryError" in res.error


# ---- end to end ---------------------------------------------------------------------------------------

def _user_config(tmp_path, **autotuning) -> str:
    cfg = {"train_batch_size": 4, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
           "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 2}}, "gradient_clipping": 1.0,
           "zero_optimization": {"stage": 0},
           "autotuning": {"start_profile_step": 2, "end_profile_step": 3, "trial_timeout": 120,
                          "results_dir": str(tmp_path / "autotuning_results"),
                          "exps_dir": str(tmp_path / "autotuning_exps"), **autotuning}}
    path = tmp_path / "cfg.json"
    path.write_text(json.dumps(cfg))
    return str(path)


def _live_trials(marker: str) -> list:
    """Live processes (not zombies) whose command line holds ``marker``."""
    out = []
    for entry in os.listdir("/proc"):
        try:
            cmd = pathlib.Path(f"/proc/{entry}/cmdline").read_bytes().decode(errors="replace")
            state = pathlib.Path(f"/proc/{entry}/stat").read_text().split(")")[-1].split()[0]
        except (OSError, ValueError):
            continue
        if marker in cmd and state != "Z":
            out.append(int(entry))
    return out


def test_autotune_cli_end_to_end_writes_layout_and_optimum_loads_in_both(tmp_path, capsys):
    cfg = _user_config(tmp_path, max_train_micro_batch_size_per_gpu=1, tuner_num_trials=2,
                       device_memory_budget=4e9)
    rc = main(["autotune", "--nproc", "1", SCRIPT, "--deepspeed_config", cfg, "--n-embd", "32", "--n-layer", "2",
               "--block-size", "16"])
    assert rc == 0, capsys.readouterr().err
    res = tmp_path / "autotuning_results"
    summary = (res / "summary.txt").read_text()
    names = [c.name for c in enumerate_candidates(default_space(4, 1, mbs_range=(1, 1)), 4, 1)]
    assert all(n in summary for n in names) and "best" in summary and "2 trials" in summary
    ran = [d for d in res.iterdir() if d.is_dir() and d.name.startswith("z")]
    assert len(ran) == 2
    for d in ran:
        assert {"ds_config.json", "cmd.txt", "metrics.json", "stdout.log", "stderr.log"} <= {f.name for f in d.iterdir()}
        m = json.loads((d / "metrics.json").read_text())
        assert m["step_time_s"] > 0 and m["peak_memory"] > 0 and m["num_params"] > 0
    assert (tmp_path / "autotuning_exps" / f"{ran[0].name}.json").exists()
    optimal = json.loads((res / "ds_config_optimal.json").read_text())
    assert "autotuning" not in optimal and optimal["scheduler"] == {"type": "WarmupLR", "params": {"warmup_num_steps": 2}}
    assert optimal["train_batch_size"] == 4
    cmd = (res / "cmd_optimal.txt").read_text()
    assert str(res / "ds_config_optimal.json") in cmd and "--n-embd 32" in cmd
    load_config(optimal, world_size=1)
    if importlib.util.find_spec("deepspeed") is None:
        pytest.skip("deepspeed is not installed")
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    from deepspeed.runtime.config import DeepSpeedConfig

    class _MPU:
        def get_data_parallel_world_size(self):
            return 1

    ds = DeepSpeedConfig(optimal, mpu=_MPU())
    assert (ds.train_batch_size, ds.zero_optimization_stage) == (4, optimal["zero_optimization"]["stage"])


FAKE = str(ROOT / "tests" / "fake_trial.py")


def _fake_launch(nproc, script, args):
    return [sys.executable, FAKE, script, *args]


def test_search_prunes_runs_the_best_predictions_and_survives_a_hung_trial(tmp_path):
    """The search on stand-in trials whose truth is known (tests/fake_trial.py): stage-2 trials hang."""
    sys.path.insert(0, str(ROOT / "tests"))
    from fake_trial import truth

    budget = 1.85e9
    cfg = _user_config(tmp_path, trial_timeout=3, device_memory_budget=budget)
    at = AutotuningConfig(**json.loads(pathlib.Path(cfg).read_text())["autotuning"])
    pathlib.Path(cfg).write_text(json.dumps({**json.loads(pathlib.Path(cfg).read_text()), "train_batch_size": 16}))
    tuner = Tuner("train.py", ["--deepspeed_config", cfg, "--hang-stage", "2"], nproc=2, config=at, progress=False,
                  launch=_fake_launch)
    result = tuner.run()
    grid = len(tuner.candidates)
    status = {r.candidate: r.status for r in result.records}
    true_cfg = {r.candidate: apply_candidate({"train_batch_size": 16}, r.candidate, 2) for r in result.records}
    fitting = [c for c in status if truth(true_cfg[c])[1] <= budget]
    assert result.best is not None and result.best.candidate == min(fitting, key=lambda c: truth(true_cfg[c])[0])
    pruned = [c for c, s in status.items() if s.startswith("pruned: memory")]
    assert pruned and all(truth(true_cfg[c])[1] > budget for c in pruned)
    hung = [c for c, s in status.items() if s.startswith("timeout")]
    assert hung and all(c.stage == 2 for c in hung)
    assert result.trials <= grid // 4  # calibration included (the hung stage stays unmeasured: tried more)
    assert any(c.activation_checkpointing for c in fitting) and any(not c.activation_checkpointing for c in fitting)
    assert isinstance(result.model.memory, EstimatorMemoryModel)
    assert _live_trials(str(tmp_path / "autotuning_results")) == []  # the hung trials' other-session children too
    summary = (tmp_path / "autotuning_results" / "summary.txt").read_text()
    assert all(c.name in summary for c in status) and "timeout" in summary


def test_search_checkpoints_when_memory_asks_and_skips_it_for_a_model_without_blocks(tmp_path):
    """Stage 3 at micro-batch 1 or 8, checkpointing on or off, on fake trials (tests/fake_trial.py): at a budget
    below micro-batch 8's plain peak the fastest config that fits is micro-batch 8 checkpointed."""
    sys.path.insert(0, str(ROOT / "tests"))
    from fake_trial import truth

    space = TuningSpace(stages=(3,), micro_batches=(1, 8), offload_optimizer=(False,), offload_param=(False,),
                        activation_checkpointing=(False, True))
    z3_8, z3_8_ck = Candidate(3, 8, 1), Candidate(3, 8, 1, activation_checkpointing=True)
    budget = (truth(apply_candidate({"train_batch_size": 16}, z3_8, 2))[1]
              + truth(apply_candidate({"train_batch_size": 16}, z3_8_ck, 2))[1]) / 2
    for extra, best in (([], z3_8_ck), (["--no-blocks"], Candidate(3, 1, 8))):
        out = tmp_path / ("no_blocks" if extra else "blocks")
        out.mkdir()
        cfg = _user_config(out, device_memory_budget=budget)
        pathlib.Path(cfg).write_text(json.dumps({**json.loads(pathlib.Path(cfg).read_text()), "train_batch_size": 16}))
        tuner = Tuner("train.py", ["--deepspeed_config", cfg, *extra], nproc=2, space=space, progress=False,
                      launch=_fake_launch)
        result = tuner.run()
        status = {r.candidate: r.status for r in result.records}
        assert result.best is not None and result.best.candidate == best, status
        assert status[z3_8] == "over budget (measured)"
        if extra:
            assert status[z3_8_ck].startswith("failed") and "block_types" in status[z3_8_ck]
            assert status[Candidate(3, 1, 8, activation_checkpointing=True)].startswith("skipped: activation")
            assert result.trials == 3


# ---- tensor parallelism, communication per stage, the search's order -------------------------------------

def test_tp_candidates_split_the_world_and_keep_the_global_batch():
    cands = enumerate_candidates(TuningSpace(tp_sizes=(1, 2)), 16, 2)
    tp2 = [c for c in cands if c.tp == 2]
    # one data-parallel rank at TP 2: stage 0 and the offloads (stage 1 optimizer, stage 3 both) mean something
    assert {(c.stage, c.offload_optimizer, c.offload_param) for c in tp2} == {(0, False, False), (1, True, False),
                                                                              (3, True, True)}
    assert len(tp2) == 3 * 4 and len(cands) == 36 + 12
    for c in tp2:
        assert c.micro_batch * c.grad_accum == 16 and c.name.endswith("_tp2") and c.dp_size(2) == 1
        cfg = apply_candidate(PLAIN, c, 2)
        assert cfg["tensor_parallel"]["autotp_size"] == 2
        loaded = load_config(cfg, world_size=1)  # the data-parallel size
        assert (loaded.train_batch_size, loaded.gradient_accumulation_steps) == (16, c.grad_accum)
    assert "tensor_parallel" not in apply_candidate(PLAIN, Candidate(0, 8, 1), 2)
    assert default_space(16, 4, tp_sizes=(1, 2, 3, 4)).tp_sizes == (1, 2, 4)
    assert default_space(16, 4, tp_sizes=(1, 2, 4)).micro_batches == (1, 2, 4, 8, 16)  # per-rank batch 4..16
    # the user's TP degree alone: the global batch need only divide by its data-parallel size
    assert default_space(3, 2, tp_sizes=(2,)).micro_batches == (1, 3)
    with pytest.raises(ConfigError, match="not a multiple of the data-parallel size 2"):
        default_space(3, 2)


def test_the_tuner_starts_from_the_plan_of_the_users_config():
    """The global batch it keeps, the TP degree it searches without a model shape and the bucket of its cost
    model are decide's (the autotuning block aside); a config that cannot train at the world is its ConfigError."""
    user = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 3, "tensor_parallel": {"autotp_size": 2},
            "zero_optimization": {"stage": 1, "reduce_bucket_size": 1000}, "autotuning": {"enabled": True}}
    plan = user_plan(user, 8)
    assert (plan.batch.global_batch, plan.mesh.model, plan.sharding.reduce_bucket) == (2 * 3 * 4, 2, 1000)
    assert user_global_batch(user, 8) == 24 and user_global_batch({"train_batch_size": 16}, 2) == 16
    assert user_plan({"train_batch_size": 16}, 2).sharding.reduce_bucket == 500_000_000
    with pytest.raises(ConfigError, match="not divisible"):
        user_plan({**user, "tensor_parallel": {"autotp_size": 3}}, 8)


TP_INFO = replace(INFO, tp_layers=4, tp_elems_per_sample=64 * 512)


def test_time_model_charges_each_stage_its_collectives_and_tp_its_all_reduces():
    from shardspeed.autotune.model import StepTimeModel

    link = replace(LINK, latency_s=0.0, all_gather_latency_s=0.0, all_gather_bus_bandwidth=1e8,
                   reduce_scatter_latency_s=0.0, reduce_scatter_bus_bandwidth=2e8)
    assert link.cost("all_gather") == (0.0, 1e8) and LINK.cost("all_gather") == (LINK.latency_s, LINK.bus_bandwidth)
    tm = StepTimeModel(TP_INFO, link)
    half = INFO.num_params * 2 / 2  # bf16 gradients, (N-1)/N of them per rank at N = 2

    def comm(c):
        return tm.overheads(c)["comm"]

    assert comm(Candidate(0, 1, 8)) == pytest.approx(2 * half / 1e9)  # one all-reduce per step
    assert comm(Candidate(1, 1, 8)) == pytest.approx(half / 2e8 + half / 1e8)  # one scatter, one gather
    assert comm(Candidate(2, 1, 8)) == pytest.approx(8 * half / 2e8 + half / 1e8)  # a scatter every micro-step
    assert comm(Candidate(3, 1, 8)) == pytest.approx(8 * (2 * half / 1e8 + half / 2e8))  # two gathers + a scatter
    # TP 2 at world 2: no data-parallel traffic; each layer all-reduces its activations 4 times per micro-step
    c = Candidate(0, 4, 4, tp=2)
    o = tm.overheads(c)
    assert o["comm"] == 0.0
    assert o["tp_comm"] == pytest.approx(4 * (2 * 0.5 * 4 * 4 * 4 * 64 * 512 * 2.0 / 1e9))  # bf16 activations
    assert o["optimizer"] == pytest.approx(INFO.num_params / 2 * LINK.adam_s_per_elem)
    assert tm.features(c) == (4.0, 8.0)  # the samples' compute is split over the pair


def test_memory_model_splits_states_by_tp_and_activations_by_the_formulas():
    from shardspeed.estimate import describe_gpt, formula_activations
    from shardspeed.models import GPTConfig

    ref = estimate_model_state_memory(INFO.num_params / 2, 1, 0, "bf16", False, False)
    assert StateMemoryModel(INFO).states(Candidate(0, 4, 4, tp=2)) == (ref.device, ref.host)
    assert StateMemoryModel(INFO).tp_share(2) == 1.0  # no shape: activations counted whole
    spec = describe_gpt(GPTConfig(vocab_size=256, block_size=64, n_layer=4, n_head=4, n_embd=128), PLAIN, trace=False)
    mem = EstimatorMemoryModel.create(INFO, PLAIN, spec, seq_len=64)
    assert 0.5 < mem.tp_share(2) < 1.0 and mem.tp_share(1) == 1.0  # layer inputs stay whole, the rest splits
    assert mem.structural(Candidate(0, 4, 4, tp=2))[0] < mem.structural(Candidate(0, 8, 1))[0]
    # the activation prior: the formulas' bytes per sample, one more observation in the fit. Two calibration
    # peaks where micro-batch 8 came out below micro-batch 1 (allocator noise) fit no activations on their own
    assert mem.act_prior == pytest.approx(formula_activations(spec.shape, 8, 64, 2).peak_bytes / 8)
    runs = [Measurement(Candidate(3, 1, 8), 1.0e9, 1.0), Measurement(Candidate(3, 8, 1), 0.995e9, 1.0)]
    assert replace(mem, act_prior=None).fit(runs).act_per_sample == 0.0
    assert 0.0 < mem.fit(runs).act_per_sample < mem.act_prior


def test_search_order_is_by_prediction_uncertain_band_included_ties_to_fewer_micro_steps(tmp_path):
    from types import SimpleNamespace

    tuner = Tuner("train.py", ["--deepspeed_config", _user_config(tmp_path, device_memory_budget=1e9)], nproc=2,
                  progress=False)
    preds = {Candidate(0, 1, 2): 0.2, Candidate(0, 2, 1): 0.2, Candidate(1, 2, 1): 0.1, Candidate(2, 2, 1): 0.3}
    # stage 1 is predicted fastest but over the budget by less than the margin: one run settles it
    model = SimpleNamespace(predict=lambda c: Prediction(1.05e9 if c.stage == 1 else 5e8, 0.0, preds[c]))
    assert tuner._order(model, list(preds)) == [Candidate(1, 2, 1), Candidate(0, 2, 1), Candidate(0, 1, 2),
                                                Candidate(2, 2, 1)]


def test_search_skips_tensor_parallelism_when_the_model_refuses_it(tmp_path):
    cfg = _user_config(tmp_path, device_memory_budget=1e12)
    pathlib.Path(cfg).write_text(json.dumps({**json.loads(pathlib.Path(cfg).read_text()), "train_batch_size": 16}))
    space = TuningSpace(stages=(0, 1), micro_batches=(4, 8), offload_optimizer=(False,), offload_param=(False,),
                        tp_sizes=(1, 2))
    tuner = Tuner("train.py", ["--deepspeed_config", cfg, "--no-tp"], nproc=2, space=space, progress=False,
                  launch=_fake_launch)
    result = tuner.run()
    status = {r.candidate: r.status for r in result.records}
    failed = [c for c, s in status.items() if s.startswith("failed")]
    assert len(failed) == 1 and failed[0].tp == 2 and "tensor-parallel plan" in status[failed[0]]
    assert all(s.startswith("skipped: tensor parallelism 2 failed") for c, s in status.items()
               if c.tp == 2 and c not in failed)
    assert result.best is not None and result.best.candidate.tp == 1
