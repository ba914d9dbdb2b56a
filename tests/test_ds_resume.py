"""A resumed run equals DeepSpeed's resumed run (issue 36, item 5). DeepSpeed 0.19.8 saves no RNG state and
its ``load_checkpoint`` restores none: a script that seeds, builds, loads and trains draws its dropout masks
from its seed. shardspeed's ``load_checkpoint`` does the same by default (``load_rng_state=False``).

World 2, gloo, ``DS_ACCELERATOR=cpu``, fp32, an MLP with dropout 0.1, ZeRO 0 and 2, two configs:

- DeepSpeed's default optimizer block (``{"type": "AdamW", "params": {"lr": ...}}``: its FusedAdam, which
  builds on the CPU accelerator) and its default clipping (1.0): equal within TOL, see there;
- bit-exact (``torch.equal`` on every loss and on the final weights): ``torch_adam: true`` (torch's AdamW on
  both sides, with torch's own kernel choice) and ``gradient_clipping: 0``. Clipping is off because the
  two engines sum the global norm in another order (DeepSpeed: each parameter's norm, squared, summed;
  shardspeed: one dot product per flat unit): at ZeRO 0 the norms differ by an ulp at step 2, and so do
  the clipped gradients (the clip factor itself is rounded as DeepSpeed's: ``clip_factor``).

Each engine trains K steps, saves and trains M more (one process group); then, in fresh processes that seed
as the first run did, each loads its own checkpoint and trains the same M steps. shardspeed's resumed run
equals DeepSpeed's resumed run, and differs from the uninterrupted one (the dropout masks after a resume are
not the uninterrupted run's: with ``load_rng_state=True`` they would be).
"""
from __future__ import annotations

import logging
import os
from typing import Dict, List

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from distributed import run_distributed
from models import make_batches, micro_batch

pytest.importorskip("deepspeed")
os.environ.setdefault("DS_ACCELERATOR", "cpu")

K, M, SEED, LR = 3, 3, 1234, 1e-2
#: DeepSpeed's CPU FusedAdam (C++) and shardspeed's AdamW round differently: the uninterrupted runs already
#: differ by up to 7e-7 (losses about 1); the resumed ones by as much (8e-7), the old default by 0.03-0.12
TOL = 2e-6
STAGES = (0, 2)
#: (stage, exact): exact is the bit-exact config (torch's AdamW, no clipping)
CASES = [(stage, exact) for stage in STAGES for exact in (False, True)]


class DropoutMLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.drop, self.fc2 = nn.Linear(16, 64), nn.Dropout(0.1), nn.Linear(64, 8)

    def forward(self, x, y):
        return F.mse_loss(self.fc2(self.drop(torch.tanh(self.fc1(x)))), y)


def _config(stage: int, exact: bool) -> dict:
    cfg = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1, "zero_optimization": {"stage": stage},
           "optimizer": {"type": "AdamW", "params": {"lr": LR}}}  # DeepSpeed's defaults for the rest
    if exact:
        cfg["optimizer"]["params"]["torch_adam"] = True
        cfg["gradient_clipping"] = 0.0
    return cfg


def _key(system: str, stage: int, exact: bool) -> str:
    return f"{system}{stage}{'x' if exact else ''}"


def _engine(system: str, stage: int, exact: bool):
    """A script's start: seed, build, initialize."""
    import torch.distributed as dist

    torch.manual_seed(SEED + dist.get_rank())
    model = DropoutMLP()
    if system == "deepspeed":
        import deepspeed

        if not deepspeed.comm.is_initialized():
            deepspeed.init_distributed(dist_backend="gloo")
        deepspeed.utils.logger.setLevel(logging.WARNING)
        engine, *_ = deepspeed.initialize(model=model, config=_config(stage, exact), model_parameters=model.parameters())
        return engine
    import shardspeed

    engine, *_ = shardspeed.initialize(model=model, config=_config(stage, exact))
    return engine


def _train(engine, batches) -> List[float]:
    import torch.distributed as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    out = []
    for b in batches:
        x, y = micro_batch(b, rank, world, 0, 1)
        loss = engine(x, y)
        engine.backward(loss)
        engine.step()
        out.append(float(loss.detach()))
    return out


def _straight(base: str) -> Dict[str, List[float]]:
    """Each engine: K steps, save, M more."""
    batches = make_batches("mlp", K + M, 4)
    out = {}
    for system in ("deepspeed", "shardspeed"):
        for stage, exact in CASES:
            key = _key(system, stage, exact)
            engine = _engine(system, stage, exact)
            first = _train(engine, batches[:K])
            engine.save_checkpoint(f"{base}/{key}")
            out[key] = first + _train(engine, batches[K:])
    return out


def _resumed(base: str) -> Dict[str, List[float]]:
    """Each engine in processes that did not train: seed, build, load its checkpoint, M steps; and
    shardspeed once more with ``load_rng_state=True`` (default config). Also each run's final weights."""
    batches = make_batches("mlp", K + M, 4)
    out: Dict[str, object] = {}
    for system, rng in (("deepspeed", False), ("shardspeed", False), ("shardspeed", True)):
        for stage, exact in CASES:
            if rng and exact:
                continue
            key = _key(system, stage, exact)
            engine = _engine(system, stage, exact)
            kw = {"load_rng_state": True} if rng else {}
            engine.load_checkpoint(f"{base}/{key}", **kw)
            assert engine.global_steps == K
            out[key + ("_rng" if rng else "")] = _train(engine, batches[K:])
            out[key + ("_rng" if rng else "") + "_weights"] = {n: p.detach().clone()
                                                                for n, p in engine.module.named_parameters()}
    return out


def _diff(a: List[float], b: List[float]) -> float:
    return max(abs(x - y) for x, y in zip(a, b))


def test_resumed_run_equals_deepspeeds_resumed_run(tmp_path, deepspeed_fused_adam):
    base = str(tmp_path)
    straight = run_distributed(_straight, 2, base, timeout=600)
    resumed = run_distributed(_resumed, 2, base, timeout=600)
    for rank in range(2):
        for stage in STAGES:
            ss, dss = straight[rank][f"shardspeed{stage}"], straight[rank][f"deepspeed{stage}"]
            assert _diff(ss, dss) < TOL, (rank, stage, ss, dss)  # uninterrupted: the same run
            got, want = resumed[rank][f"shardspeed{stage}"], resumed[rank][f"deepspeed{stage}"]
            assert _diff(got, want) < TOL, (rank, stage, got, want)  # resumed: DeepSpeed's resumed run
            assert _diff(got, ss[K:]) > 1e-3, (rank, stage)  # not the uninterrupted run: other dropout masks
            restored = resumed[rank][f"shardspeed{stage}_rng"]
            assert restored == ss[K:], (rank, stage)  # load_rng_state=True: the uninterrupted run, bit for bit
            assert _diff(restored, want) > 1e-3, (rank, stage)  # (what the default was: not DeepSpeed's)
    for rank in range(2):  # the bit-exact config: torch's AdamW on both sides, no clipping
        for stage in STAGES:
            ss, dss = straight[rank][f"shardspeed{stage}x"], straight[rank][f"deepspeed{stage}x"]
            assert ss == dss, (rank, stage, ss, dss)  # uninterrupted: every loss, bit for bit
            got, want = resumed[rank][f"shardspeed{stage}x"], resumed[rank][f"deepspeed{stage}x"]
            assert got == want, (rank, stage, got, want)  # resumed: DeepSpeed's resumed run, bit for bit
            assert _diff(got, ss[K:]) > 1e-3, (rank, stage)  # (and a resume, not the uninterrupted run)
            w_got, w_want = resumed[rank][f"shardspeed{stage}x_weights"], resumed[rank][f"deepspeed{stage}x_weights"]
            assert list(w_got) == list(w_want)
            for name in w_want:
                assert torch.equal(w_got[name], w_want[name]), (rank, stage, name,
                                                                 float((w_got[name] - w_want[name]).abs().max()))
