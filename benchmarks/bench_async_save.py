"""Asynchronous save: the training stall it causes against a synchronous save's time, and its memory.

    python benchmarks/bench_async_save.py                    # gpt-113m, world 4, ZeRO 2, fp32, gloo/CPU
    python benchmarks/bench_async_save.py --model gpt-quick  # a quick check

The driver launches ``torchrun --nproc-per-node WORLD`` once (``MALLOC_MMAP_THRESHOLD_=65536``, so freed
tensors leave the process). Each rank builds the model, trains ``--warmup`` steps, saves synchronously
(timed, barrier to barrier), then runs ``--rounds`` rounds of: ``--steps`` plain steps (the baseline); an
asynchronous save, i.e. the call itself followed by the same number of steps while the writer runs, then
the wait for it. Two stalls are reported against the synchronous save's time (target: at most 10%):

- *measured*: the call plus the steps' excess over the baseline. Honest but noisy here: the steps vary by
  more than the stall from one round to the next on this shared box.
- *accounted*: the call, plus the time the next optimizer step waited for the writer (it writes the
  engine's host tensors in place, so the step must not change them first), plus the writer thread's own CPU
  time (``time.thread_time``), which a box without idle cores takes from training, times ranks per core.

Memory: the peak RSS above the level before each save (sampled every 5 ms, worst rank), beside the same
for the plain steps alone; their difference is the save's own memory, against the bytes it copied
(``AsyncSaves.snapshot_bytes``: device tensors into pinned buffers, an offloaded optimizer's ranges) and
those it wrote in place (``in_place_bytes``). On this CPU box the writer competes with training for the
same cores (on a GPU the training runs on the device).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from benchmarks.bench_checkpoint import PeakRSS  # noqa: E402
from benchmarks.models import MODELS, build_model, make_batch  # noqa: E402

MODELS.setdefault("gpt-113m", {"kind": "gpt", "vocab_size": 16384, "block_size": 1024, "n_layer": 14, "n_head": 12,
                               "n_embd": 768, "batch": 2})  # as bench_stage3_memory.py
SEQ = 64  # tokens per sample fed (the position table keeps block_size entries)


def _steps(engine, model: str, n: int, world: int, rank: int, first: int) -> float:
    """Seconds for ``n`` steps, barrier to barrier."""
    import torch.distributed as dist

    dist.barrier()
    t0 = time.perf_counter()
    for i in range(n):
        x, y = make_batch(model, first + i, world, rank)
        loss = engine(x[:, :SEQ].contiguous(), y[:, :SEQ].contiguous())
        engine.backward(loss)
        engine.step()
    dist.barrier()
    return time.perf_counter() - t0


def worker(args) -> None:
    import torch.distributed as dist

    import shardspeed

    shardspeed.init_distributed(backend="gloo", timeout=1800)
    rank, world = dist.get_rank(), dist.get_world_size()
    cfg = {"train_batch_size": MODELS[args.model]["batch"] * world,
           "train_micro_batch_size_per_gpu": MODELS[args.model]["batch"],
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}}, "zero_optimization": {"stage": args.stage}}
    engine, *_ = shardspeed.initialize(model=build_model(args.model), config=cfg)
    _steps(engine, args.model, args.warmup, world, rank, 0)
    with PeakRSS() as m_sync:
        t0 = time.perf_counter()
        engine.save_checkpoint(args.dir, tag="sync")
        dist.barrier()
        t_sync = time.perf_counter() - t0
    engine.save_checkpoint(args.dir, tag="warm", async_save=True)  # the first one creates the writer's group
    engine.destroy()
    rounds = []
    for r in range(args.rounds):  # interleaved with plain steps: the box's drift hits both alike
        with PeakRSS() as m_base:  # the steps' own transient memory, to tell the save's from it
            base = _steps(engine, args.model, args.steps, world, rank, 300 + 10 * r)
        with PeakRSS() as m_async:
            dist.barrier()
            t0 = time.perf_counter()
            engine.save_checkpoint(args.dir, tag=f"async{r}", async_save=True)
            dist.barrier()
            t_call = time.perf_counter() - t0
            during = _steps(engine, args.model, args.steps, world, rank, 200 + 10 * r)
            t0 = time.perf_counter()
            engine.destroy()  # waits for the writer
            dist.barrier()
            t_wait = time.perf_counter() - t0
        saves = engine.checkpoint_parts().async_saves
        rounds.append({"base_s": base, "call_s": t_call, "during_s": during, "wait_s": t_wait,
                       "async_rss": m_async.extra, "steps_rss": m_base.extra, "writer_cpu_s": saves.writer_cpu_s,
                       "writer_wall_s": saves.writer_wall_s, "update_wait_s": saves.update_wait_s})
    row = {"rank": rank, "sync_s": t_sync, "sync_rss": m_sync.extra, "rounds": rounds,
           "snapshot": engine.checkpoint_parts().async_saves.snapshot_bytes,
           "in_place": engine.checkpoint_parts().async_saves.in_place_bytes,
           "params": sum(p.numel() for p in engine.module.parameters())}
    rows = [None] * world
    dist.all_gather_object(rows, row)
    if rank == 0:
        with open(args.out, "w") as f:
            json.dump(rows, f)
    shardspeed.shutdown_distributed()


def _worst(rows, r: int, key: str) -> float:
    return max(row["rounds"][r][key] for row in rows)


def _table(rows, args) -> str:
    """Per round, worst rank: the measured stall (the call plus the steps' excess over the same steps alone),
    and the accounted one (the call, the optimizer step's wait for the writer, and the writer thread's own
    CPU time, which a box without idle cores takes from training: x ranks per core)."""
    mb = 2**20
    sync = max(r["sync_s"] for r in rows)
    share = max(1.0, args.world / (os.cpu_count() or 1))
    lines = [f"{args.model} ({rows[0]['params'] / 1e6:.1f}M params), fp32 AdamW, ZeRO {args.stage}, world "
             f"{args.world} on {os.cpu_count()} cores, gloo/CPU; {args.steps} steps while writing; worst rank",
             f"synchronous save: {sync:.2f} s, +RSS {max(r['sync_rss'] for r in rows) / mb:.0f} MiB; per rank "
             f"{max(r['snapshot'] for r in rows) / mb:.0f} MiB copied (snapshot), "
             f"{max(r.get('in_place', 0) for r in rows) / mb:.0f} MiB written in place", "",
             "| round | call s | steps alone s | steps while writing s | measured stall s (/ sync) | step waited s "
             "| writer CPU s | writer wall s | accounted stall s (/ sync) | +RSS: save + steps, steps alone, "
             "the save's own MiB |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in range(args.rounds):
        rr = [row["rounds"][r] for row in rows]
        stall = max(x["call_s"] + x["during_s"] - x["base_s"] for x in rr)
        accounted = max(x["call_s"] + x.get("update_wait_s", 0) + share * x.get("writer_cpu_s", 0) for x in rr)
        own = max(x["async_rss"] - x.get("steps_rss", 0) for x in rr)
        lines.append(f"| {r} | {_worst(rows, r, 'call_s'):.2f} | {_worst(rows, r, 'base_s'):.2f} | "
                     f"{_worst(rows, r, 'during_s'):.2f} | {stall:.2f} ({100 * stall / sync:.0f}%) | "
                     f"{_worst(rows, r, 'update_wait_s'):.2f} | {_worst(rows, r, 'writer_cpu_s'):.2f} | "
                     f"{_worst(rows, r, 'writer_wall_s'):.2f} | {accounted:.2f} ({100 * accounted / sync:.0f}%) | "
                     f"{_worst(rows, r, 'async_rss') / mb:.0f}, {_worst(rows, r, 'steps_rss') / mb:.0f}, "
                     f"{own / mb:.0f} |")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="gpt-113m")
    p.add_argument("--world", type=int, default=4)
    p.add_argument("--stage", type=int, default=2)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--results", default="benchmarks/results/bench_async_save.json")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--dir", help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        return worker(args)
    d = tempfile.mkdtemp(prefix="bench-async-save-")
    out = os.path.join(d, "result.json")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={args.world}",
           os.path.abspath(__file__), "--worker", "--dir", os.path.join(d, "ckpt"), "--out", out,
           "--model", args.model, "--stage", str(args.stage), "--warmup", str(args.warmup), "--steps", str(args.steps),
           "--rounds", str(args.rounds)]
    env = dict(os.environ, OMP_NUM_THREADS="1", MALLOC_MMAP_THRESHOLD_="65536",
               PYTHONPATH=os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")])))
    try:
        subprocess.run(cmd, check=True, env=env)
        with open(out) as f:
            rows = json.load(f)
    finally:
        shutil.rmtree(d, ignore_errors=True)
    print(_table(rows, args))
    os.makedirs(os.path.dirname(args.results) or ".", exist_ok=True)
    with open(args.results, "w") as f:
        json.dump({"model": args.model, "world": args.world, "stage": args.stage, "steps": args.steps,
                   "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
