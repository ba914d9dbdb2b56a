"""The same PipelineModule script under DeepSpeed 0.19.8's PipelineEngine and ours gives the same losses
(1F1B, ZeRO 0 and 1, PP=2, fp32; 1e-5 relative). Skipped without deepspeed.

Clipping is off here: DeepSpeed's ``clip_grad_norm_`` (runtime/utils.py) counts a parameter only where
``mpu.get_model_parallel_rank() == 0`` or it is tensor-parallel, and its pipeline grid's model-parallel
rank is the stage, so its norm leaves out every later stage's gradients (with clipping 0.5 its losses leave
ours from the third step by 5e-4; ours match the plain-torch reference with clipping on, test_pipe.py)."""
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


def _run() -> Dict[int, Dict[str, List[float]]]:
    return {stage: _run_stage(stage) for stage in (0, 1)}


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
