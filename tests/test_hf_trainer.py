"""Hugging Face transformers: ShardspeedTrainer against the plain Trainer, resume, save_model, fill_auto.

One 2-rank gloo group (``run_distributed``, 240 s limit) runs every distributed case: ShardspeedTrainer at
stages 0-3 and stage 3 with DeepSpeed's scheduler (6 steps, global batch 8 = 2 ranks × micro 2 × accumulation 2, a checkpoint every 3 steps),
resumes from ``checkpoint-3`` at stages 2 and 3, and saves the stage-3 model with ``save_model``. The
reference is a plain one-process ``Trainer`` (micro 4 × accumulation 2) on the same tiny GPT-2, seed and
data, run in the test process. fp32, no dropout: losses, grad norms and LRs agree to 1e-5; a resumed run
repeats steps 4-6 bit for bit.
"""
from __future__ import annotations

import math
import os

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

from distributed import run_distributed  # noqa: E402

STEPS, SAVE_EVERY, MICRO, GAS, WORLD = 6, 3, 2, 2, 2
LR, WARMUP = 1e-3, 2

_OPT = {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto", "weight_decay": "auto"}}
_SCHED = {"type": "WarmupDecayLR", "params": {"warmup_min_lr": "auto", "warmup_max_lr": "auto", "warmup_num_steps": "auto",
                                              "total_num_steps": "auto", "warmup_type": "linear"}}
# run name → (stage, blocks from the config). Without a "scheduler" block the Trainer's own schedule (linear
# warm-up and decay) runs on the engine's optimizer; without an "optimizer" block its AdamW is moved into the
# engine. "3sched" uses DeepSpeed's WarmupDecayLR, whose warm-up starts a step later than the Trainer's
# linear schedule (DeepSpeed's, not ours: its first two steps both run at warmup_min_lr), so its losses are
# not the plain Trainer's; its LRs are checked against DeepSpeed's schedule instead.
RUNS = {"0": (0, {}), "1": (1, {"optimizer": _OPT}), "2": (2, {"optimizer": _OPT}), "3": (3, {"optimizer": _OPT}),
        "3sched": (3, {"optimizer": _OPT, "scheduler": _SCHED})}
# DeepSpeed's WarmupDecayLR (linear, warmup_num_steps=2, total 6, max 1e-3): the LR of steps 1..6
DS_WARMUP_DECAY_LRS = [0.0, 0.0, 5e-4, 1e-3, 7.5e-4, 5e-4]


def _ds_config(run: str) -> dict:
    stage, blocks = RUNS[run]
    cfg = {"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
           "train_batch_size": "auto", "gradient_clipping": "auto", "steps_per_print": 1000,
           "zero_optimization": {"stage": stage, "reduce_bucket_size": "auto"}}
    if stage == 3:
        cfg["zero_optimization"].update(stage3_prefetch_bucket_size="auto", stage3_param_persistence_threshold="auto")
    cfg.update(blocks)
    return cfg


class _Windows(torch.utils.data.Dataset):
    """Byte-level windows of the standard library's sources (shardspeed.data), as input_ids and labels."""

    def __init__(self, n: int = 96, block: int = 16):
        from shardspeed.data import encode, stdlib_corpus

        tokens = encode(stdlib_corpus(max_bytes=n * block)).long()
        self.x = tokens[: n * block].view(n, block)

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return {"input_ids": self.x[i], "labels": self.x[i]}


def _model():
    from transformers import GPT2Config, GPT2LMHeadModel, set_seed

    set_seed(0)
    return GPT2LMHeadModel(GPT2Config(vocab_size=256, n_positions=32, n_embd=32, n_layer=2, n_head=2,
                                      resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                                      bos_token_id=0, eos_token_id=0))


def _args(out: str, micro: int, **kw):
    from transformers import TrainingArguments

    return TrainingArguments(output_dir=out, per_device_train_batch_size=micro, gradient_accumulation_steps=GAS,
                             max_steps=STEPS, learning_rate=LR, warmup_steps=WARMUP, logging_steps=1,
                             save_steps=SAVE_EVERY, report_to=[], seed=0, use_cpu=True, disable_tqdm=True, **kw)


def _history(trainer):
    """Per optimizer step: (step, loss, grad_norm, learning_rate) from the Trainer's own log."""
    return [(h["step"], h["loss"], h["grad_norm"], h["learning_rate"]) for h in trainer.state.log_history
            if "loss" in h]


def _dist_cases(tmp: str):
    import torch.distributed as dist
    from transformers import GPT2LMHeadModel

    from shardspeed.integrations.transformers import ShardspeedTrainer, save_pretrained

    rank = dist.get_rank()
    out: dict = {"world": dist.get_world_size()}
    for run in RUNS:
        trainer = ShardspeedTrainer(model=_model(), args=_args(f"{tmp}/run{run}", MICRO),
                                    train_dataset=_Windows(), shardspeed_config=_ds_config(run))
        trainer.train()
        out[f"run{run}"] = _history(trainer)
        out[f"config{run}"] = trainer.filled_config
        out[f"files{run}"] = sorted(os.listdir(f"{tmp}/run{run}/checkpoint-3"))
        if run == "3":  # save_model → from_pretrained, every rank loads what rank 0 wrote
            trainer.save_model(f"{tmp}/final")
            gathered = trainer.engine._zero3_consolidated_16bit_state_dict()
            loaded = GPT2LMHeadModel.from_pretrained(f"{tmp}/final").state_dict()
            if rank == 0:
                out["save_mismatch"] = sorted(k for k, v in gathered.items() if not torch.equal(loaded[k], v))
                out["save_missing"] = sorted(set(gathered) ^ set(loaded))
            out["other_rank_sd"] = gathered is None if rank else None
            save_pretrained(trainer.engine, f"{tmp}/sp")  # the standalone function, for users' own loops
            again = GPT2LMHeadModel.from_pretrained(f"{tmp}/sp").state_dict()
            out["sp_equal"] = all(torch.equal(again[k], v) for k, v in loaded.items()) and again.keys() == loaded.keys()
            # placeholders at stage 3: the module itself is not whole (save_model gathered it)
            out["placeholders"] = trainer.engine._sharded_placeholders()
        del trainer
    out["engine_methods"] = _engine_methods()
    for run in ("2", "3sched"):  # the Trainer's schedule in the engine's checkpoint, and DeepSpeed's
        trainer = ShardspeedTrainer(model=_model(), args=_args(f"{tmp}/run{run}", MICRO),
                                    train_dataset=_Windows(), shardspeed_config=_ds_config(run))
        trainer.train(resume_from_checkpoint=f"{tmp}/run{run}/checkpoint-3")
        out[f"resumed{run}"] = [h for h in _history(trainer) if h[0] > SAVE_EVERY]
    return out


def _engine_methods():
    """DeepSpeed's spellings the Trainer and accelerate call: backward(scale_wrt_gas=...) and the gathered state dict."""
    import torch.distributed as dist

    import shardspeed

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
    full = {k: v.clone() for k, v in model.state_dict().items()}
    engine, *_ = shardspeed.initialize(model=model, config={
        "train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 2,
        "optimizer": {"type": "SGD", "params": {"lr": 0.1}}, "zero_optimization": {"stage": 1}})
    x = torch.ones(1, 4)
    returned = []  # the gradients themselves: the Trainer runs (accumulation 2, scale_wrt_gas=False) match
    for scale_wrt_gas in (True, False):
        loss = engine(x).sum()
        returned.append(float(engine.backward(loss, scale_wrt_gas=scale_wrt_gas)) / float(loss.detach()))
        engine.zero_grad()
    sd = engine._zero3_consolidated_16bit_state_dict()
    return {"returned": tuple(returned),
            "state_dict_ok": (sd is None) if dist.get_rank() else
            (sd.keys() == full.keys() and all(torch.equal(sd[k], full[k]) for k in full))}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = str(tmp_path_factory.mktemp("hf"))
    results = run_distributed(_dist_cases, WORLD, tmp, timeout=240, collective_timeout=120)
    from transformers import Trainer

    ref = Trainer(model=_model(), args=_args(f"{tmp}/plain", MICRO * WORLD), train_dataset=_Windows())
    ref.train()
    return results, _history(ref), tmp


def _close(a, b, tol=1e-5):
    return all(math.isclose(x, y, rel_tol=tol, abs_tol=tol) for x, y in zip(a, b))


@pytest.mark.parametrize("run", ["0", "1", "2", "3"])
def test_losses_match_plain_trainer(runs, run):
    results, ref, _ = runs
    assert results[0]["world"] == WORLD
    assert len(ref) == STEPS
    for r in results:
        got = r[f"run{run}"]
        assert [h[0] for h in got] == list(range(1, STEPS + 1))
        for g, e in zip(got, ref):
            assert _close(g[1:], e[1:]), (run, g, e)  # loss, grad norm, learning rate


def test_deepspeed_scheduler_block(runs):
    results, _, _ = runs
    got = results[0]["run3sched"]
    assert _close([h[3] for h in got], DS_WARMUP_DECAY_LRS, tol=1e-9), got
    assert got[0][1] == results[0]["run3"][0][1]  # the same first step (its LR is 0 in both)


def test_filled_config(runs):
    results, _, _ = runs
    cfg = results[0]["config3sched"]
    assert cfg["train_batch_size"] == MICRO * GAS * WORLD and cfg["train_micro_batch_size_per_gpu"] == MICRO
    assert cfg["scheduler"]["params"]["total_num_steps"] == STEPS
    assert cfg["scheduler"]["params"]["warmup_num_steps"] == WARMUP
    assert cfg["zero_optimization"]["reduce_bucket_size"] == 32 * 32


def test_checkpoint_layout(runs):
    results, _, tmp = runs
    files = results[0]["files3"]
    for name in ("global_step3", "latest", "model.safetensors", "config.json", "trainer_state.json"):
        assert name in files, files
    assert any(f.startswith("rng_state") for f in files)


@pytest.mark.parametrize("run", ["2", "3sched"])
def test_resume_reproduces_steps(runs, run):
    results, _, _ = runs
    for r in results:
        resumed = r[f"resumed{run}"]
        straight = [h for h in r[f"run{run}"] if h[0] > SAVE_EVERY]
        assert [h[0] for h in resumed] == [4, 5, 6]
        assert resumed == straight  # bit for bit


def test_save_model_round_trips_stage3(runs):
    results, _, tmp = runs
    assert results[0]["save_mismatch"] == [] and results[0]["save_missing"] == []
    assert results[1]["other_rank_sd"] is True
    assert all(r["sp_equal"] for r in results)  # save_pretrained(engine, dir) writes the same model
    assert results[0]["placeholders"] is True
    assert os.path.isfile(os.path.join(tmp, "final", "model.safetensors"))
    assert os.path.isfile(os.path.join(tmp, "final", "config.json"))


def test_engine_deepspeed_spellings(runs):
    results, _, _ = runs
    for r in results:
        m = r["engine_methods"]
        assert m["returned"] == (0.5, 1.0)  # divided by gradient_accumulation_steps=2 only when scale_wrt_gas
        assert m["state_dict_ok"]


# ---- fill_auto against transformers' own HfTrainerDeepSpeedConfig (one process) -------------------------------
def _full_auto(stage: int) -> dict:
    return {
        "train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto", "train_batch_size": "auto",
        "gradient_clipping": "auto",
        "fp16": {"enabled": "auto"}, "bf16": {"enabled": "auto"},
        "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto",
                                                  "weight_decay": "auto"}},
        "scheduler": {"type": "WarmupDecayLR", "params": {"warmup_min_lr": "auto", "warmup_max_lr": "auto",
                                                          "warmup_num_steps": "auto", "total_num_steps": "auto"}},
        "zero_optimization": {"stage": stage, "reduce_bucket_size": "auto", "stage3_prefetch_bucket_size": "auto",
                              "stage3_param_persistence_threshold": "auto"},
    }


def _hf_filled(config, args, model, steps):
    pytest.importorskip("deepspeed")
    from transformers.integrations.deepspeed import HfTrainerDeepSpeedConfig, unset_hf_deepspeed_config

    try:
        hf = HfTrainerDeepSpeedConfig(config)
        hf.trainer_config_process(args)
        hf.trainer_config_finalize(args, model, steps)
        return hf.config
    finally:
        unset_hf_deepspeed_config()  # it registers itself globally (is_deepspeed_zero3_enabled)


@pytest.mark.parametrize("case", ["stage2", "stage3_bf16", "stage3_fp16_ratio_warmup", "partial", "given_equal"])
def test_fill_auto_equals_transformers(tmp_path, case):
    from transformers import TrainingArguments

    from shardspeed.integrations.transformers import fill_auto

    stage = 2 if case == "stage2" else 3
    config = _full_auto(stage)
    kw: dict = dict(per_device_train_batch_size=3, gradient_accumulation_steps=5, learning_rate=3e-4,
                    adam_beta1=0.8, adam_beta2=0.95, adam_epsilon=1e-7, weight_decay=0.1, max_grad_norm=0.7,
                    warmup_steps=7)
    if case == "stage3_bf16":
        kw["bf16"] = True
    if case == "stage3_fp16_ratio_warmup":
        kw.update(warmup_steps=0.25)
    if case == "partial":  # keys absent stay absent, "auto" only where written
        del config["scheduler"], config["fp16"], config["zero_optimization"]["stage3_prefetch_bucket_size"]
    if case == "given_equal":
        config["gradient_accumulation_steps"] = 5
        config["optimizer"]["params"]["lr"] = 3e-4
    args = TrainingArguments(output_dir=str(tmp_path), report_to=[], use_cpu=True, **kw)
    if case == "stage3_fp16_ratio_warmup":
        args.fp16 = True  # set after construction: fp16 on a CPU is refused at __init__, the filling only reads it
    model = _model()
    ours = fill_auto(config, training_args=args, model=model, num_training_steps=40)
    assert ours == _hf_filled(config, args, model, 40)
    assert config["train_batch_size"] == "auto"  # the input is not modified
    if stage == 3:
        assert "auto" not in repr(ours)


def test_fill_auto_mismatch_and_path(tmp_path):
    import json

    from transformers import TrainingArguments

    from shardspeed.integrations.transformers import fill_auto

    args = TrainingArguments(output_dir=str(tmp_path), report_to=[], use_cpu=True, per_device_train_batch_size=4)
    with pytest.raises(ValueError, match="train_micro_batch_size_per_gpu=8 vs hf per_device_train_batch_size=4"):
        fill_auto({"train_micro_batch_size_per_gpu": 8}, training_args=args)
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"train_micro_batch_size_per_gpu": "auto", "zero_optimization": {"stage": 3,
                                "reduce_bucket_size": "auto"}}))
    filled = fill_auto(str(path), training_args=args)  # no model: hidden-size keys stay "auto"
    assert filled["train_micro_batch_size_per_gpu"] == 4
    assert filled["zero_optimization"]["reduce_bucket_size"] == "auto"


def test_example_finetune_hf(tmp_path):
    """examples/finetune_hf.py, shortened, under `shardspeed run --nproc 2` (ZeRO-3, save_model, from_pretrained)."""
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    cmd = [sys.executable, "-m", "shardspeed.cli", "run", "--nproc", "2", "examples/finetune_hf.py", "--steps", "4",
           "--n-layer", "1", "--n-embd", "32", "--n-head", "2", "--block-size", "31", "--max-bytes", "50000",
           "--save-steps", "2", "--eval-samples", "8", "--output-dir", str(tmp_path / "out")]
    env = dict(os.environ, PYTHONPATH=root, DS_ACCELERATOR="cpu")
    try:
        proc = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True, timeout=150)
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"examples/finetune_hf.py did not finish within 150 s:\n{exc.stderr}")
    report = f"exit {proc.returncode}\n--- stdout\n{proc.stdout[-3000:]}\n--- stderr\n{proc.stderr[-5000:]}"
    assert proc.returncode == 0, report
    assert "ZeRO-3 on 2 process(es): 4 steps" in proc.stdout, report
    assert "reloaded with from_pretrained" in proc.stdout, report
    assert sorted(os.listdir(tmp_path / "out")) == ["checkpoint-2", "checkpoint-4", "final"], report
