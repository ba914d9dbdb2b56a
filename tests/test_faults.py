"""A dead or diverged rank makes the others fail with a clear error within a bounded time, never hang."""
from __future__ import annotations

import os
import time

from distributed import run_distributed
from models import make_batches, make_model, micro_batch

CFG = {
    "train_micro_batch_size_per_gpu": 2,
    "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
    "zero_optimization": {"stage": 2, "reduce_bucket_size": 300},
}


def _train_until_failure(stop_rank: int, stop_after: int, how: str):
    import torch.distributed as dist

    import shardspeed
    from shardspeed.errors import DistributedError

    rank, world = dist.get_rank(), dist.get_world_size()
    engine, *_ = shardspeed.initialize(model=make_model("mlp"), config=CFG)
    t0 = None
    for step, batch in enumerate(make_batches("mlp", 50, 2 * world)):
        if rank == stop_rank and step == stop_after:
            if how == "die":
                os._exit(3)
            time.sleep(8)  # alive but no longer taking part: a diverged step count
            return {"rank": rank, "stopped": True}
        x, y = micro_batch(batch, rank, world, 0, 1)
        t0 = time.monotonic()
        try:
            engine.backward(engine(x, y))
            engine.step()
        except DistributedError as e:
            return {"rank": rank, "error": str(e), "seconds": time.monotonic() - t0, "step": step}
    return {"rank": rank, "error": None}


def test_dead_rank_fails_the_others_with_a_message():
    res = run_distributed(_train_until_failure, 2, 1, 2, "die", may_die=[1], final_barrier=False, timeout=90,
                          collective_timeout=20)
    r0 = res[0]
    assert r0["error"] is not None, r0
    assert "Another rank probably died" in r0["error"]
    assert r0["seconds"] < 25  # bounded by the collective timeout at worst
    assert res[1] is None  # rank 1 never reported: it died


def test_diverged_rank_times_out_with_a_message():
    res = run_distributed(_train_until_failure, 2, 1, 2, "hang", final_barrier=False, timeout=90,
                          collective_timeout=4)
    r0 = res[0]
    assert r0["error"] is not None and r0["step"] == 2, r0
    assert "different numbers of steps" in r0["error"]
    assert r0["seconds"] < 8


# ---- non-finite gradients (issue 16): skipped on every rank in every dtype ---------------------------------
NAN_STEP, NAN_STEPS = 2, 4


def _nan_cfg(stage: int, dtype: str, check: bool = True) -> dict:
    cfg = {"train_micro_batch_size_per_gpu": 2, "gradient_clipping": 1.0,
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
           "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0.0, "warmup_max_lr": 1e-2,
                                                        "warmup_num_steps": 10}},
           "zero_optimization": {"stage": stage, "reduce_bucket_size": 300,
                                 "stage3_param_persistence_threshold": 0}}
    if dtype == "bf16":
        cfg["bf16"] = {"enabled": True, "check_grad_overflow": check}
    elif dtype == "fp16":
        cfg["fp16"] = {"enabled": True, "initial_scale_power": 8}
    elif not check:
        cfg["bf16"] = {"enabled": False, "check_grad_overflow": False}
    return cfg


def _nan_runs():
    """Per (stage, dtype): a run whose rank 1 alone has a NaN loss at step NAN_STEP, and a run without that
    batch at all. Also fp32 with check_grad_overflow false (the NaN is applied)."""
    import torch
    import torch.distributed as dist
    from models import gathered_params

    import shardspeed

    rank, world = dist.get_rank(), dist.get_world_size()
    batches = make_batches("mlp", NAN_STEPS, 2 * world)
    out = {}
    cases = [(s, d, True) for s in (0, 1, 2, 3) for d in ("fp32", "bf16", "fp16")] + [(2, "fp32", False)]
    for stage, dtype, check in cases:
        runs = {}
        for name in ("nan", "without"):
            engine, _, _, sched = shardspeed.initialize(model=make_model("mlp"), config=_nan_cfg(stage, dtype, check))
            for step, batch in enumerate(batches):
                if name == "without" and step == NAN_STEP:
                    continue
                loss = engine(*micro_batch(batch, rank, world, 0, 1))
                if name == "nan" and step == NAN_STEP and rank == 1:
                    loss = loss * float("nan")
                engine.backward(loss)
                engine.step()
            params = gathered_params(engine)
            runs[name] = dict(params=params, skipped=engine.skipped_steps, lr=engine.get_lr()[0],
                              finite=all(bool(torch.isfinite(p).all()) for p in params.values()))
        out[(stage, dtype, check)] = runs
    return out


def test_nonfinite_gradients_skip_the_step_on_every_rank():
    import torch

    results = run_distributed(_nan_runs, 2, timeout=400)
    for case, runs in results[0].items():
        stage, dtype, check = case
        nan, without = runs["nan"], runs["without"]
        if not check:  # turned off: the NaN reaches the weights, as the user asked
            assert not nan["finite"] and nan["skipped"] == 0, case
            continue
        assert nan["finite"] and nan["skipped"] == 1, (case, nan["skipped"])
        assert nan["lr"] == without["lr"], (case, "the LR schedule holds on a skipped step")
        if dtype != "fp16":  # fp16 also halves its loss scale on the skip: the runs then round differently
            for n, p in without["params"].items():
                torch.testing.assert_close(nan["params"][n], p, rtol=1e-6, atol=1e-7, msg=lambda m, n=n, c=case: f"{c} {n}: {m}")
        for n, p in nan["params"].items():  # every rank holds the same weights
            assert torch.equal(results[1][case]["nan"]["params"][n], p), (case, n)


# ---- stage 3 with rank-dependent control flow (issue 16): a named error on every rank, no abort -------------
def _divergent_stage3():
    import torch
    import torch.distributed as dist
    import torch.nn as nn
    import torch.nn.functional as F

    import shardspeed
    from shardspeed.errors import DistributedError

    class SkipsABlockOnRank1(nn.Module):
        def __init__(self):
            super().__init__()
            self.blocks = nn.ModuleList(nn.Linear(16, 16) for _ in range(4))
            self.head = nn.Linear(16, 8)

        def forward(self, x, y):
            for i, block in enumerate(self.blocks):
                if i == 2 and dist.get_rank() == 1:
                    continue
                x = torch.tanh(block(x))
            return F.mse_loss(self.head(x), y)

    torch.manual_seed(0)
    cfg = dict(CFG, zero_optimization={"stage": 3, "stage3_param_persistence_threshold": 0})
    engine, *_ = shardspeed.initialize(model=SkipsABlockOnRank1(), config=cfg)
    x, y = torch.randn(2, 16), torch.randn(2, 8)
    try:
        engine.backward(engine(x, y))
        engine.step()
    except DistributedError as e:
        return str(e)
    return None


def test_stage3_divergent_control_flow_names_the_module_on_every_rank():
    errors = run_distributed(_divergent_stage3, 2, timeout=120, collective_timeout=20)
    for rank, msg in enumerate(errors):
        assert msg is not None and "diverged" in msg, (rank, msg)
        assert "blocks.2" in msg or "blocks.3" in msg, (rank, msg)
    assert "blocks.2" in errors[0] and "blocks.3" in errors[1], errors
