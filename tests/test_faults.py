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
