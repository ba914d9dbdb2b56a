"""Every stage trains the same as a one-process plain-torch reference (same global batch, seed, AdamW).

Tolerances: fp32 1e-5 relative on losses and parameters; bf16 and fp16 (model computes in 16 bits, fp32
masters on both sides, gradients reduced in 16 bits across ranks, fp16 with dynamic loss scaling that the
reference does not need) 2e-2 on losses and 2e-2 absolute on parameters.
"""
from __future__ import annotations

import itertools

import pytest
import torch
from distributed import run_distributed
from models import gathered_params, make_batches, make_model, reference_train, train_global_losses

STEPS = 4
LR = 1e-2
CLIP = 0.5


def _config(stage: int, gas: int, world: int, dtype: str, bucket: int = 300) -> dict:
    cfg = {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": gas,
        "gradient_clipping": CLIP,
        "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.01}},
        "zero_optimization": {"stage": stage, "reduce_bucket_size": bucket, "overlap_comm": True,
                              "stage3_param_persistence_threshold": 0},
    }
    if dtype == "bf16":
        cfg["bf16"] = {"enabled": True}
    if dtype == "fp16":
        cfg["fp16"] = {"enabled": True, "initial_scale_power": 8}
    return cfg


def _train_case(kind: str, stage: int, gas: int, dtype: str) -> dict:
    import torch.distributed as dist

    import shardspeed

    engine, *_ = shardspeed.initialize(model=make_model(kind), config=_config(stage, gas, dist.get_world_size(), dtype))
    losses = train_global_losses(engine, kind, STEPS, gas)
    return {"losses": losses, "params": gathered_params(engine), "steps": engine.global_steps,
            "micro": engine.micro_steps}


def _cases(world: int):
    stages = [0, 1, 2, 3]
    return [(k, s, g, d) for (s, g, d) in itertools.product(stages, [1, 3], ["fp32", "bf16"]) for k in ["mlp"]] + [
        (k, s, 2, "fp32") for k in ["tied", "mlp_frozen", "mlp_unused"] for s in stages
    ] + [("mlp", s, 2, "fp16") for s in stages]


def _run_all(world: int) -> list:
    return [(case, _train_case(*case)) for case in _cases(world)]


def _check(case, got, world):
    kind, stage, gas, dtype = case
    ref = reference_train(kind, make_batches(kind, STEPS, 2 * gas * world), LR, CLIP,
                          {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[dtype])
    tol = 1e-5 if dtype == "fp32" else 2e-2
    assert got["steps"] == STEPS and got["micro"] == STEPS * gas
    torch.testing.assert_close(torch.tensor(got["losses"]), torch.tensor(ref["losses"]), rtol=tol, atol=tol,
                               msg=lambda m: f"{case} losses: {m}")
    for name, p in ref["params"].items():
        torch.testing.assert_close(got["params"][name], p, rtol=tol, atol=tol if dtype == "fp32" else 2e-2,
                                   msg=lambda m, name=name: f"{case} param {name}: {m}")


@pytest.mark.parametrize("world", [1, 2, 4])
def test_every_stage_matches_reference(world):
    results = run_distributed(_run_all, world, world)
    for r in range(1, world):  # every rank ends with the same full parameters
        for (case, a), (_, b) in zip(results[0], results[r]):
            for n in a["params"]:
                assert torch.equal(a["params"][n], b["params"][n]), f"{case}: rank {r} differs on {n}"
    for case, got in results[0]:
        _check(case, got, world)
