"""``optimizer.type: "Muon"`` (issue 40): DeepSpeed 0.19.8's Muon with its auxiliary AdamW at ZeRO 0-3.

World 2, gloo, fp32, the tied LM of ``models``, 10 steps, no clipping. DeepSpeed routes by name and shape: its
``wte`` / ``wpe`` tables are not named ``embed``, so they go to Muon with the block's two matrices (4 matrices);
LayerNorm and biases go to AdamW.

- against a one-process torch reference (torch.optim.Muon over the hidden matrices, torch.optim.AdamW over the
  rest, same seed, data and global batch) at stages 0-3. torch runs Newton-Schulz in bf16 only; the reference
  used at the tight tolerance has torch's iteration run in fp32 (``_fp32_newton_schulz``), against the default
  ``ns_method: "gram"``, which runs in fp32 on CPU as DeepSpeed's does. One run with ``ns_method: "standard"``
  (bf16, as torch) is held against unmodified torch at a bf16 tolerance;
- against DeepSpeed 0.19.8 (``DS_ACCELERATOR=cpu``) at stages 1-3 (its stage 3 needs ``reduce_scatter: false``
  with Muon; ``torch.compile`` of its Muon step is switched off, which leaves its math as it is), and with its
  default clipping (1.0) at stages 1 and 3, where it takes the norm over the orthogonalised updates;
- each matrix orthogonalised once in the job (the Newton-Schulz count summed over ranks equals the matrices),
  and the bytes the exchange moves equal the count from the layout;
- gradient accumulation (stage 3, 2 micro-steps) equals the reference; the estimator prices Muon's state as
  the engine holds it;
- a checkpoint save and load continues identically;
- ``offload_optimizer: cpu`` at stages 1-3 (masters and state on the host, the exchange through the device)
  equals the reference and DeepSpeed's ZeRO-Offload, and resumes from its checkpoint; ``nvme`` (no DeepSpeed
  NVMe on this host: no libaio) equals the reference and the device run, its checkpoints load either way;
- ``engine.get_global_grad_norm()`` at stages 1-3 is DeepSpeed's: the norm over the orthogonalised updates and
  the AdamW gradients (against DeepSpeed and against the same norm taken from the reference's torch step);
- tensor parallelism (TP 2, the GPT of ``shardspeed.models`` at stages 0, 1 and 3): each full matrix (a slice per
  rank; ``wpe`` left whole by the plan) orthogonalised once, the losses and norms the reference's, and the
  bytes of the model-group exchange at torch.distributed equal to the count from the slices.
"""
from __future__ import annotations

import os
from typing import Dict, List, Optional

import pytest
import torch
from distributed import run_distributed
from models import make_batches, make_model
from muon_reference import deepspeed_engine, gpt_batches, muon_config, reference as reference_run, train

os.environ.setdefault("DS_ACCELERATOR", "cpu")

STEPS = 10
#: fp32 against fp32, absolute, on losses of 9-11: the sides reduce and sum in other orders (measured: the torch
#: reference 1.9e-6, DeepSpeed 9.5e-7)
TOL = 1e-5
#: ns_method "standard" (bf16) against torch's bf16 iteration (one addmm where DeepSpeed writes two ops): 1.5e-3 measured
BF16_TOL = 1e-2
#: stages run with DeepSpeed's default clipping (1.0) too: its ZeRO 1-2 and 3 paths clip the orthogonalised updates
CLIPPED = (1, 3)
#: TP 2 at world 2 (one data rank: stage 2's exchange is stage 1's)
TP_STAGES = (0, 1, 3)
#: stages run with ``offload_optimizer: cpu`` too (DeepSpeed's ZeRO-Offload runs Muon on the host)
OFFLOADED = (1, 2, 3)
#: (stage, gradient_clipping) run with ``offload_optimizer: nvme`` (this host: no libaio, so no DeepSpeed NVMe)
NVME = ((1, 0.0), (3, 0.0), (3, 1.0))


def _config(stage: int, ns_method: str = "gram", **extra) -> dict:
    return muon_config(stage, 2, ns_method, **extra)


def _nvme(stage: int, path: str) -> dict:
    """Muon with ``offload_optimizer: nvme``, tiles of 100 elements (pieces split over several tiles)."""
    cfg = _config(stage)
    cfg["zero_optimization"] = dict(cfg["zero_optimization"], sub_group_size=100,
                                    offload_optimizer={"device": "nvme", "nvme_path": path})
    return cfg


def _offloaded(stage: int) -> dict:
    """Muon with ``offload_optimizer: cpu`` (DeepSpeed runs it: its MuonWithAuxAdam on the host masters)."""
    cfg = _config(stage)
    cfg["zero_optimization"] = dict(cfg["zero_optimization"], offload_optimizer={"device": "cpu"})
    return cfg


def _train(engine, batches, gas: int = 1) -> List[float]:
    return train(engine, batches, gas)["losses"]


def _tp_config(stage: int) -> dict:
    return dict(muon_config(stage, 8), tensor_parallel={"autotp_size": 2})


def _tp_job(stage: int) -> dict:
    """The GPT at TP 2 (world 2: one data rank): losses, norms, the Newton-Schulz count summed over the ranks,
    the elements this rank sends over the model group per step and the all_to_all bytes it logged."""
    import torch.distributed as dist
    from tp_models import make_tp_model

    import shardspeed

    model = make_tp_model("gpt")
    engine, *_ = shardspeed.initialize(model=model, config=_tp_config(stage), model_parameters=model.parameters())
    out = train(engine, gpt_batches(STEPS, 8), data=(0, 1))
    ex = engine.optimizer.router
    ns = torch.tensor([float(ex.orthogonalised_here())])
    dist.all_reduce(ns)
    sent = ex.tp_sent_elements() + ex.sent_elements(ex.rank)
    total = torch.tensor([float(sent)])
    dist.all_reduce(total)
    out.update(owned=int(ns), matrices=len(ex.matrices), sent=sent, sent_total=int(total),
               logged=engine.comms_logger.summary().get("all_to_all", {}).get("msg_bytes", 0))
    return out


def _ours_job(tmp: str) -> dict:
    import torch.distributed as dist

    import shardspeed

    batches = make_batches("tied", STEPS, 4)
    out: dict = {}
    for stage in (0, 1, 2, 3):
        model = make_model("tied")
        engine, *_ = shardspeed.initialize(model=model, config=_config(stage), model_parameters=model.parameters())
        run = train(engine, batches)
        out[stage], out[f"norms{stage}"] = run["losses"], run["norms"]
        ex = engine.optimizer.router
        ns = torch.tensor([float(sum(1 for m in ex.matrices if m.owner == ex.rank))])
        dist.all_reduce(ns)
        out[f"owned{stage}"], out[f"matrices{stage}"] = int(ns), len(ex.matrices)
        out[f"sent{stage}"] = ex.sent_elements(ex.rank)
        out[f"theory{stage}"] = sum(b - a for m in ex.matrices for r, a, b in m.spans
                                    if r != m.owner and ex.rank in (r, m.owner))
        out[f"all_to_all{stage}"] = engine.comms_logger.summary().get("all_to_all", {})
        held = torch.tensor([float(sum(v.numel() * v.element_size() for st in engine.optimizer.state.values()
                                       for v in st.values() if torch.is_tensor(v) and v.dim() > 0))])
        dist.all_reduce(held)
        out[f"state_bytes{stage}"] = int(held)
    for stage in CLIPPED:
        model = make_model("tied")
        engine, *_ = shardspeed.initialize(model=model, config=dict(_config(stage), gradient_clipping=1.0),
                                           model_parameters=model.parameters())
        out[f"clip{stage}"] = _train(engine, batches)
    model = make_model("tied")
    cfg = dict(_config(3), train_micro_batch_size_per_gpu=1, gradient_accumulation_steps=2)
    engine, *_ = shardspeed.initialize(model=model, config=cfg, model_parameters=model.parameters())
    out["gas"] = _train(engine, batches, gas=2)
    model = make_model("tied")
    engine, *_ = shardspeed.initialize(model=model, config=_config(0, "standard"), model_parameters=model.parameters())
    out["standard"] = _train(engine, batches)
    out["resume"] = _resume_job(tmp, batches)
    for stage in TP_STAGES:
        out[f"tp{stage}"] = _tp_job(stage)
    out["client"] = _client_job(batches)
    for stage in OFFLOADED:
        model = make_model("tied")
        engine, *_ = shardspeed.initialize(model=model, config=_offloaded(stage), model_parameters=model.parameters())
        run = train(engine, batches)
        out[f"offload{stage}"], out[f"offload_norms{stage}"] = run["losses"], run["norms"]
        held = engine.memory_breakdown()
        on_host = torch.tensor([float(held["offloaded_optimizer_states"]), float(held["optimizer_states"])])
        dist.all_reduce(on_host)
        out[f"offload_held{stage}"] = on_host.tolist()
    out["offload_resume"] = _resume_job(tmp + "/offloaded", batches, _offloaded(3))
    for stage, clip in NVME:
        model = make_model("tied")
        cfg = dict(_nvme(stage, tmp), gradient_clipping=clip)
        engine, *_ = shardspeed.initialize(model=model, config=cfg, model_parameters=model.parameters())
        run = train(engine, batches)
        out[f"nvme{stage}-{clip}"], out[f"nvme_norms{stage}-{clip}"] = run["losses"], run["norms"]
    out["nvme_resume"] = _nvme_resume_job(tmp, batches)
    return out


def _client_job(batches) -> List[float]:
    """The user's own MuonWithAuxAdam (optimizer=), over groups split as the config's are."""
    import shardspeed
    from shardspeed.optim.muon import MuonWithAuxAdam, split_muon_groups

    model = make_model("tied")
    cfg = _config(2)
    names = {id(p): n for n, p in model.named_parameters()}
    opt = MuonWithAuxAdam(split_muon_groups([{"params": list(model.parameters())}], names, cfg.pop("optimizer")["params"]))
    engine, *_ = shardspeed.initialize(model=model, config=cfg, optimizer=opt)
    return _train(engine, batches)


def _resume_job(tmp: str, batches, config: Optional[dict] = None) -> dict:
    import shardspeed

    config = config or _config(2)
    model = make_model("tied")
    engine, *_ = shardspeed.initialize(model=model, config=config, model_parameters=model.parameters())
    _train(engine, batches[:4])
    engine.save_checkpoint(tmp, tag="t")
    straight = _train(engine, batches[4:8])
    model = make_model("tied", seed=5)
    engine, *_ = shardspeed.initialize(model=model, config=config, model_parameters=model.parameters())
    engine.load_checkpoint(tmp, tag="t")
    return {"straight": straight, "resumed": _train(engine, batches[4:8])}


def _nvme_resume_job(tmp: str, batches) -> dict:
    """NVMe Muon saves at step 4 and runs on; its checkpoint resumed by an NVMe engine and by one without
    offload (the same optimizer state, named as ``optimizer.state`` names it), and the reverse."""
    import shardspeed

    def engine(cfg: dict, seed: int = 0):
        model = make_model("tied", seed=seed)
        return shardspeed.initialize(model=model, config=cfg, model_parameters=model.parameters())[0]

    on_disk, on_device = _nvme(3, tmp), _config(3)
    out = {}
    for name, cfg in (("nvme", on_disk), ("device", on_device)):
        e = engine(cfg)
        _train(e, batches[:4])
        e.save_checkpoint(f"{tmp}/ckpt_{name}", tag="t")
        out[f"{name}_straight"] = _train(e, batches[4:8])
    for saved, cfg in (("nvme", on_disk), ("nvme", on_device), ("device", on_disk)):
        e = engine(cfg, seed=5)
        e.load_checkpoint(f"{tmp}/ckpt_{saved}", tag="t")
        out[f"{saved}_into_{'nvme' if cfg is on_disk else 'device'}"] = _train(e, batches[4:8])
    return out


def _deepspeed_job() -> dict:
    batches = make_batches("tied", STEPS, 4)
    out = {}
    for stage in (1, 2, 3):
        run = train(deepspeed_engine(_config(stage)), batches)
        out[stage], out[f"norms{stage}"] = run["losses"], run["norms"]
    for stage in CLIPPED:
        out[f"clip{stage}"] = _train(deepspeed_engine(dict(_config(stage), gradient_clipping=1.0)), batches)
    for stage in OFFLOADED:
        run = train(deepspeed_engine(_offloaded(stage)), batches)
        out[f"offload{stage}"], out[f"offload_norms{stage}"] = run["losses"], run["norms"]
    return out


@pytest.fixture(scope="module")
def reference_runs() -> Dict[str, Dict[str, List[float]]]:
    from tp_models import make_tp_model

    batches = make_batches("tied", STEPS, 4)
    return {"bf16": reference_run(make_model("tied"), batches, fp32=False),
            "fp32": reference_run(make_model("tied"), batches, fp32=True),
            "gpt": reference_run(make_tp_model("gpt"), gpt_batches(STEPS, 8), fp32=True)}


@pytest.fixture(scope="module")
def reference(reference_runs) -> Dict[str, List[float]]:
    return {k: v["losses"] for k, v in reference_runs.items()}


@pytest.fixture(scope="module")
def ours(tmp_path_factory):
    return run_distributed(_ours_job, 2, str(tmp_path_factory.mktemp("muon_ckpt")), timeout=240)[0]


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_muon_equals_torch_muon_and_adamw_at_each_stage(ours, reference, stage):
    ref = reference["fp32"]
    assert ref[-1] < ref[0] - 0.5  # it trains
    torch.testing.assert_close(torch.tensor(ours[stage]), torch.tensor(ref), rtol=0, atol=TOL)


def test_gradient_accumulation_equals_the_reference(ours, reference):
    torch.testing.assert_close(torch.tensor(ours["gas"]), torch.tensor(reference["fp32"]), rtol=0, atol=TOL)


def test_standard_ns_method_equals_torch_muon_in_bf16(ours, reference):
    ref = reference["bf16"]
    torch.testing.assert_close(torch.tensor(ours["standard"]), torch.tensor(ref), rtol=0, atol=BF16_TOL)
    assert ours["standard"] != ours[0]  # bf16, not the fp32 gram iteration


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_each_matrix_orthogonalised_once_and_bytes_as_counted(ours, stage):
    assert ours[f"owned{stage}"] == ours[f"matrices{stage}"] == 4
    assert ours[f"sent{stage}"] == ours[f"theory{stage}"]


def test_routing_is_deepspeeds():
    from shardspeed.optim.muon import use_muon

    m, v = torch.zeros(4, 4), torch.zeros(4)
    assert use_muon("model.layers.0.mlp.up_proj.weight", m) and use_muon("conv.weight", torch.zeros(2, 2, 3, 3))
    assert not use_muon("model.embed_tokens.weight", m) and not use_muon("lm_head.weight", m)
    assert not use_muon("model.layers.0.mlp.up_proj.bias", v) and not use_muon("norm.weight", v)


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_estimator_prices_muon_state_as_the_engine_holds_it(ours, stage):
    from shardspeed.estimate import ActivationProfile, estimate_peak
    from shardspeed.estimate.model import describe_module

    cfg = _config(stage)
    no_activations = ActivationProfile(0.0, 0.0, 2, 8, False, "fitted")  # the autotuner's structural prior
    spec = describe_module(make_model("tied"), cfg).with_activations(no_activations)
    muon = sum(p.numel() for n, p in make_model("tied").named_parameters() if n in ("wte.weight", "wpe.weight")
               or n.startswith("block.") and p.dim() == 2)
    assert spec.muon_numel == muon and ours[f"state_bytes{stage}"] == 4 * muon + 8 * (spec.num_params - muon)
    est = estimate_peak(spec, cfg, world_size=2).model_states["optimizer"]
    adamw = estimate_peak(spec, dict(cfg, optimizer={"type": "AdamW"}), world_size=2).model_states["optimizer"]
    assert 2 * est == ours[f"state_bytes{stage}"] and adamw - est == 4 * muon / 2


def test_estimator_prices_the_offloaded_muon_step_as_it_runs():
    """With offload_optimizer cpu, Muon takes the offloaded optimizer's generic host step: masters and state on
    the host, every gradient shard copied there at once for the step (no tile copier); with nvme, the files and
    the blends kept between the two passes."""
    from shardspeed.estimate import ActivationProfile, estimate_peak
    from shardspeed.estimate.model import describe_module

    cfg = _offloaded(1)  # stage 1: the step is the peak phase (stage 2's backward bucket ties it on this model)
    spec = describe_module(make_model("tied"), cfg).with_activations(ActivationProfile(0.0, 0.0, 2, 8, False, "fitted"))
    step = estimate_peak(spec, cfg, world_size=2).terms
    shard = spec.num_params / 2
    assert step["grads_copy_host"] == 4 * shard and step["master_host"] == 4 * shard
    assert "offload_buffers_host" not in step and "optimizer" not in step
    muon = sum(p.numel() for n, p in make_model("tied").named_parameters() if n in ("wte.weight", "wpe.weight")
               or n.startswith("block.") and p.dim() == 2)
    largest = max(p.numel() for p in make_model("tied").parameters())
    # the blends on the host; the owners' whole matrices and the results, Newton-Schulz's temporaries
    assert step["muon_blends_host"] == 4 * muon / 2 and step["muon_updates"] == 2 * 4 * muon / 2 + 12 * largest
    adam = estimate_peak(spec, dict(cfg, optimizer={"type": "AdamW"}), world_size=2).terms
    assert "grads_copy_host" not in adam and adam["offload_buffers_host"] > 0
    # from NVMe files: 12 bytes per element in the files (Adam's slots), the Muon elements' blends in memory
    nvme = estimate_peak(spec, _nvme(1, "/tmp"), world_size=2)
    assert nvme.nvme == 12 * shard and nvme.terms["muon_blends_host"] == 4 * muon / 2


def test_estimate_cli_prices_muon_by_the_formula(tmp_path, capsys):
    """``shardspeed estimate`` with a Muon config: optimizer state 4 bytes per Muon element (its momentum) and 8
    per AdamW element (two moments), divided over the data ranks at stages 1-3; with offload_optimizer cpu the
    same bytes on the host (and rows with nvme)."""
    import json

    from shardspeed.cli import main
    from shardspeed.models.gpt import GPT, GPTConfig
    from shardspeed.optim.muon import use_muon

    cfg = tmp_path / "muon.json"
    cfg.write_text(json.dumps({"train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "Muon"}}))
    assert main(["estimate", "--preset", "tiny", "--config", str(cfg), "--world", "2", "--no-trace", "--json"]) == 0
    got = json.loads(capsys.readouterr().out)
    with torch.device("meta"):
        named = dict(GPT(GPTConfig.preset("tiny")).named_parameters())
    n = sum(p.numel() for p in named.values())
    muon = sum(p.numel() for name, p in named.items() if use_muon(name, p))
    assert got["num_params"] == n and 0 < muon < n
    rows = {(r["stage"], r["offload_optimizer"], r["offload_param"]): r["model_states"] for r in got["rows"]}
    assert {(0, "none", "none"), (3, "cpu", "cpu")} | {(s, o, "none") for s in (1, 2, 3) for o in ("none", "cpu", "nvme")
                                                       } <= set(rows)
    for (stage, offload, _), r in rows.items():
        if offload != "nvme":  # in files: not a model-states term
            assert r["optimizer_host" if offload == "cpu" else "optimizer"] == (4 * muon + 8 * (n - muon)) / (
                2 if stage else 1)


def test_keys_defaults_and_a_groups_own_settings():
    from types import SimpleNamespace

    from shardspeed.errors import ConfigError
    from shardspeed.optim import build_optimizer

    w, b = torch.nn.Parameter(torch.zeros(4, 3)), torch.nn.Parameter(torch.zeros(4))
    opt = build_optimizer(SimpleNamespace(type="muon", params={}), [w, b])
    got = {g["name"]: (g["lr"], g["weight_decay"]) for g in opt.param_groups}
    assert got == {"muon-params": (0.02, 0.0), "adam-params": (3e-4, 0.0)}
    assert opt.param_groups[1]["betas"] == (0.9, 0.95) and opt.param_groups[1]["eps"] == 1e-10
    cfg = SimpleNamespace(type="Muon", params={"lr": 0.1, "adam_lr": 0.2, "weight_decay": 0.01})
    opt = build_optimizer(cfg, [{"params": [w, b], "lr": 0.5}, {"params": [torch.nn.Parameter(torch.zeros(2))],
                                                                "weight_decay": 0.0}])
    got = {g["name"]: (g["lr"], g["weight_decay"]) for g in opt.param_groups}
    assert got == {"group0-muon-params": (0.5, 0.01), "group0-adam-params": (0.5, 0.01),
                   "group1-adam-params": (0.2, 0.0)}
    for params, fragment in (({"nesterov": False}, "optimizer.params.nesterov is not a parameter of 'Muon'"),
                             ({"per_head_muon": True}, "per_head_muon is not implemented"),
                             ({"ns_method": "svd"}, "ns_method of 'Muon' must be one of gram, standard"),
                             ({"betas": [0.9]}, "betas of 'Muon' must be 2 numbers")):
        with pytest.raises(ConfigError, match=fragment):
            build_optimizer(SimpleNamespace(type="Muon", params=params), [w, b])


def test_matrices_dealt_to_the_rank_holding_most_ties_to_the_least_loaded():
    from shardspeed.zero.muon_exchange import deal_matrices

    s = torch.Size([4, 4])
    dealt = deal_matrices([(0, s, ((0, 0, 12), (1, 12, 16))), (0, s, ((0, 0, 8), (1, 8, 16))),
                           (0, s, ((1, 0, 16),)), (0, s, ((0, 0, 8), (1, 8, 16)))], world=2)
    assert [m.owner for m in dealt] == [0, 1, 1, 0]  # m1 ties 8/8: rank 1 has less; m3 ties: rank 0 has less


def test_full_matrices_dealt_over_the_model_group_by_size_per_data_owner():
    from shardspeed.zero.muon_tp import deal_over_model

    # data owners 0, 0, 0, 1 with full sizes 8, 6, 4, 5 at TP 2: at data rank 0, 8 -> model rank 0, 6 -> 1,
    # 4 -> 1 (6 < 8); at data rank 1 the loads start afresh: 5 -> 0
    assert deal_over_model([0, 0, 0, 1], [8, 6, 4, 5], 2) == [0, 1, 1, 0]


def test_stage0_exchanges_nothing(ours):
    assert ours["sent0"] == 0 and not ours["all_to_all0"]


def test_checkpoint_resume_continues_identically(ours):
    assert ours["resume"]["resumed"] == ours["resume"]["straight"]


def test_a_users_own_muon_optimizer_trains_as_the_configs(ours):
    assert ours["client"] == ours[2]


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_global_grad_norm_is_deepspeeds_norm_over_the_updates(ours, reference_runs, stage):
    ref = reference_runs["fp32"]["norms"]
    torch.testing.assert_close(torch.tensor(ours[f"norms{stage}"]), torch.tensor(ref), rtol=1e-5, atol=0)
    # stage 0 reports the raw gradients' norm (DeepSpeed clips those there): another number
    assert min(abs(a - b) for a, b in zip(ours["norms0"], ref)) > 0.1


@pytest.mark.parametrize("stage", TP_STAGES)
def test_tensor_parallel_equals_the_reference(ours, reference_runs, stage):
    run, ref = ours[f"tp{stage}"], reference_runs["gpt"]
    assert ref["losses"][-1] < ref["losses"][0] - 0.5  # it trains
    torch.testing.assert_close(torch.tensor(run["losses"]), torch.tensor(ref["losses"]), rtol=0, atol=TOL)
    if stage:
        torch.testing.assert_close(torch.tensor(run["norms"]), torch.tensor(ref["norms"]), rtol=1e-5, atol=0)


@pytest.mark.parametrize("stage", TP_STAGES)
def test_tensor_parallel_matrices_orthogonalised_once_and_bytes_as_counted(ours, stage):
    from tp_models import make_tp_model

    run = ours[f"tp{stage}"]
    params = dict(make_tp_model("gpt").named_parameters())
    sliced = sum(p.numel() for n, p in params.items() if p.dim() == 2 and n != "wpe.weight")
    assert run["owned"] == run["matrices"] == 10  # wte, wpe, 2 x (c_attn, attn c_proj, c_fc, mlp c_proj)
    # each full matrix of n elements: half of it to the owner and half back (n); wpe whole from its owner (512)
    assert run["sent_total"] == sliced + params["wpe.weight"].numel()
    assert run["logged"] == 4 * STEPS * run["sent"]


@pytest.mark.parametrize("stage", OFFLOADED)
def test_offloaded_optimizer_equals_the_reference_and_holds_its_state_on_the_host(ours, reference_runs, stage):
    """``offload_optimizer: cpu``: host masters and Muon/AdamW state, the same matrices exchanged (through the
    device the exchange runs on), the losses and norms of the reference; the state bytes all on the host."""
    ref = reference_runs["fp32"]
    torch.testing.assert_close(torch.tensor(ours[f"offload{stage}"]), torch.tensor(ref["losses"]), rtol=0, atol=TOL)
    torch.testing.assert_close(torch.tensor(ours[f"offload_norms{stage}"]), torch.tensor(ref["norms"]), rtol=1e-5,
                               atol=0)
    assert ours[f"offload_held{stage}"] == [float(ours[f"state_bytes{stage}"]), 0.0]


def test_offloaded_checkpoint_resume_continues_identically(ours):
    run = ours["offload_resume"]
    assert run["resumed"] == run["straight"] and len(run["straight"]) == 4


@pytest.mark.parametrize("stage,clip", NVME)
def test_nvme_offload_equals_the_reference_and_the_device_run(ours, reference_runs, stage, clip):
    """``offload_optimizer: nvme``: masters, Muon's momentum and AdamW's moments in the files, two passes over
    the tiles (:mod:`shardspeed.offload.muon_step`); without clipping the reference's losses and norms, with
    DeepSpeed's default clipping the device run's (held against DeepSpeed below)."""
    got, norms = ours[f"nvme{stage}-{clip}"], ours[f"nvme_norms{stage}-{clip}"]
    want = ours[f"clip{stage}"] if clip else reference_runs["fp32"]["losses"]
    torch.testing.assert_close(torch.tensor(got), torch.tensor(want), rtol=0, atol=TOL)
    if not clip:
        torch.testing.assert_close(torch.tensor(norms), torch.tensor(reference_runs["fp32"]["norms"]), rtol=1e-5,
                                   atol=0)


def test_nvme_checkpoints_resume_in_either_placement(ours):
    run = ours["nvme_resume"]
    assert run["nvme_into_nvme"] == run["nvme_straight"]  # the same engine kind: bit for bit
    torch.testing.assert_close(torch.tensor(run["nvme_into_device"]), torch.tensor(run["nvme_straight"]), rtol=0,
                               atol=TOL)
    torch.testing.assert_close(torch.tensor(run["device_into_nvme"]), torch.tensor(run["device_straight"]), rtol=0,
                               atol=TOL)
    assert max(abs(a - b) for a, b in zip(run["nvme_straight"], run["device_straight"])) < TOL


def test_muon_equals_deepspeed_at_stages_1_to_3(ours):
    pytest.importorskip("deepspeed")
    ds = run_distributed(_deepspeed_job, 2, timeout=300)[0]
    for stage in (1, 2, 3):
        torch.testing.assert_close(torch.tensor(ours[stage]), torch.tensor(ds[stage]), rtol=0, atol=TOL)
        # get_global_grad_norm: DeepSpeed's norm over the orthogonalised updates and the AdamW gradients
        torch.testing.assert_close(torch.tensor(ours[f"norms{stage}"]), torch.tensor(ds[f"norms{stage}"]), rtol=1e-5,
                                   atol=0)
    for stage in CLIPPED:  # the norm over the orthogonalised updates clips every step here
        torch.testing.assert_close(torch.tensor(ours[f"clip{stage}"]), torch.tensor(ds[f"clip{stage}"]), rtol=0,
                                   atol=TOL)
        assert max(abs(a - b) for a, b in zip(ours[f"clip{stage}"], ours[stage])) > 0.1
    for stage in OFFLOADED:  # ZeRO-Offload: DeepSpeed steps its MuonWithAuxAdam on the host masters
        torch.testing.assert_close(torch.tensor(ours[f"offload{stage}"]), torch.tensor(ds[f"offload{stage}"]),
                                   rtol=0, atol=TOL)
        torch.testing.assert_close(torch.tensor(ours[f"offload_norms{stage}"]),
                                   torch.tensor(ds[f"offload_norms{stage}"]), rtol=1e-5, atol=0)
