"""The same PipelineModule script under DeepSpeed 0.19.8's PipelineEngine and ours gives the same losses
(1F1B, ZeRO 0 and 1, PP=2, fp32; 1e-5 relative). Skipped without deepspeed.

Clipping is off there: DeepSpeed's ``clip_grad_norm_`` (runtime/utils.py, its ZeRO-0 fp32 path) counts a
parameter only where ``mpu.get_model_parallel_rank() == 0`` or it is tensor-parallel, and its pipeline
grid's model-parallel rank is the stage, so its norm leaves out every later stage's gradients (with
clipping 0.5 its losses leave ours from the third step by 5e-4; ours match the plain-torch reference with
clipping on, test_pipe.py). ``test_deepspeed_pipeline_norm_counts_only_the_first_stage`` shows it
numerically: at the first step DeepSpeed's ZeRO-0 norm equals the norm of the first stage's gradients
alone; its ZeRO-1 norm (the ZeRO optimizer's own, which counts by tensor-parallel rank) and ours equal the
true norm of a one-process run."""
from __future__ import annotations

import importlib.util
import os
import zlib
from typing import Dict, List

import pytest
import torch
from distributed import run_distributed
from pipe_models import batches, config, micro_batches

pytestmark = pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None, reason="deepspeed is not installed")

STEPS, GAS = 4, 4


def _script(pipe):
    """What a user writes: layer specs and a PipelineModule (``pipe`` is deepspeed.pipe or shardspeed.pipe)."""
    import torch.nn as nn
    import torch.nn.functional as F

    layers = [pipe.LayerSpec(nn.Linear, 16, 32), nn.Tanh(), pipe.LayerSpec(nn.Linear, 32, 32), nn.Tanh(),
              pipe.LayerSpec(nn.Linear, 32, 8)]
    model = pipe.PipelineModule(layers=layers, num_stages=2, loss_fn=F.mse_loss, partition_method="parameters")
    with torch.no_grad():  # the same weights under both (DeepSpeed 0.19.8's seed_layers=True raises a TypeError)
        for name, prm in model.named_parameters():
            g = torch.Generator().manual_seed(zlib.crc32(name.encode()))
            prm.copy_(torch.randn(prm.shape, generator=g) * 0.2)
    return model


def _run() -> Dict[object, object]:
    out: Dict[object, object] = {stage: _run_stage(stage) for stage in (0, 1)}
    out["norms"] = _first_step_norms()
    return out


def _first_step_norms() -> Dict[str, object]:
    """The gradient norm each engine computes at the first step (clipping 0.5, ZeRO 0), and the names of the
    parameters this rank holds under DeepSpeed."""
    import deepspeed
    import deepspeed.pipe
    import deepspeed.runtime.engine as ds_engine

    import shardspeed
    import shardspeed.pipe

    seen: List[float] = []
    original = ds_engine.clip_grad_norm_

    def recording(*args, **kwargs):
        norm = original(*args, **kwargs)
        seen.append(float(norm))
        return norm

    first = micro_batches(batches("mlp", 1, 2 * GAS)[0], 0, 1, GAS)
    out: Dict[str, object] = {}
    for stage in (0, 1):
        ds_engine.clip_grad_norm_ = recording
        try:
            model = _script(deepspeed.pipe)
            cfg = config(GAS, stage=stage, schedule="1f1b", clip=0.5)
            cfg.pop("pipeline")
            cfg["optimizer"]["params"]["torch_adam"] = True
            engine, *_ = deepspeed.initialize(model=model, config=cfg, model_parameters=list(model.parameters()))
            engine.train_batch(iter(first))
        finally:
            ds_engine.clip_grad_norm_ = original
        # ZeRO 0 (fp32): the engine's clip_grad_norm_; ZeRO 1: its optimizer's own norm
        out[f"deepspeed{stage}"] = seen[-1] if stage == 0 else float(engine.get_global_grad_norm())
        ours, *_ = shardspeed.initialize(model=_script(shardspeed.pipe), config=config(GAS, stage=stage, clip=0.5))
        ours.train_batch(iter(first))
        out[f"shardspeed{stage}"] = float(ours.get_global_grad_norm())
    out["names"] = [n for n, _ in model.named_parameters()]
    return out


def _run_stage(stage: int) -> Dict[str, List[float]]:
    os.environ["DS_ACCELERATOR"] = "cpu"
    import deepspeed
    import deepspeed.pipe
    import torch.distributed as dist

    import shardspeed
    import shardspeed.pipe

    if not deepspeed.comm.is_initialized():
        deepspeed.init_distributed(dist_backend="gloo")  # over the group the test harness created
    out: Dict[str, List[float]] = {}
    for name, pipe, init in (("deepspeed", deepspeed.pipe, deepspeed.initialize),
                             ("shardspeed", shardspeed.pipe, shardspeed.initialize)):
        model = _script(pipe)
        cfg = config(GAS, stage=stage, schedule="1f1b", clip=0.0)
        if name == "deepspeed":
            cfg.pop("pipeline")  # its only schedule is 1F1B
            cfg["optimizer"]["params"]["torch_adam"] = True
        engine, *_ = init(model=model, config=cfg, model_parameters=[p for p in model.parameters()])
        losses = []
        for b in batches("mlp", STEPS, 2 * GAS):
            losses.append(float(engine.train_batch(iter(micro_batches(b, 0, 1, GAS)))))
        out[name] = losses
        dist.barrier()
    return out


@pytest.fixture(scope="module")
def results():
    return run_distributed(_run, 2, timeout=300)


@pytest.mark.parametrize("stage", [0, 1])
def test_same_losses_as_deepspeed_pipeline_engine(results, stage):
    for per_rank in results:
        r = per_rank[stage]
        assert r["shardspeed"] == pytest.approx(r["deepspeed"], rel=1e-5)
        assert len(set(r["deepspeed"])) == STEPS  # the weights changed every step


def test_deepspeed_pipeline_norm_counts_only_the_first_stage(results):
    """The same five layers in one process (plain torch): the true first-step norm, and the first stage's
    part of it. DeepSpeed 0.19.8's pipeline engine reports the latter on every rank at ZeRO 0 (fp32: the
    engine's clip_grad_norm_) and the former at ZeRO 1 (its ZeRO optimizer's norm); ours the former."""
    import torch.nn as nn

    seq = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 8))
    with torch.no_grad():  # the names and values _script gives (layers registered by index)
        for name, prm in seq.named_parameters():
            g = torch.Generator().manual_seed(zlib.crc32(name.encode()))
            prm.copy_(torch.randn(prm.shape, generator=g) * 0.2)
    for x, y in micro_batches(batches("mlp", 1, 2 * GAS)[0], 0, 1, GAS):
        (torch.nn.functional.mse_loss(seq(x), y) / GAS).backward()
    sq = {n: float(p.grad.pow(2).sum()) for n, p in seq.named_parameters()}
    first_stage = results[0]["norms"]["names"]
    assert first_stage and set(first_stage) < set(sq)
    true, stage0 = sum(sq.values()) ** 0.5, sum(sq[n] for n in first_stage) ** 0.5
    assert stage0 < true * 0.99  # the later stage's gradients are not negligible here
    for per_rank in results:
        norms = per_rank["norms"]
        assert norms["deepspeed0"] == pytest.approx(stage0, rel=1e-5)  # ZeRO 0: the first stage only
        assert norms["deepspeed1"] == pytest.approx(true, rel=1e-5)  # ZeRO 1's optimizer: every stage
        assert norms["shardspeed0"] == pytest.approx(true, rel=1e-5)
        assert norms["shardspeed1"] == pytest.approx(true, rel=1e-5)
