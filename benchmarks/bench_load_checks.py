"""What the untrusted-input checks cost a load: ``load_checkpoint`` time of one checkpoint, code A against code B.

    python benchmarks/bench_load_checks.py --roots /path/to/old/checkout,.   # gpt-113m, world 4, ZeRO 2
    python benchmarks/bench_load_checks.py --model gpt-quick --roots A,B      # a quick check

One checkpoint is saved once (with the first root's code: the format is the same for both), at DeepSpeed's
default optimizer settings (AdamW, fp32). Then ``--pairs`` launches alternate A, B, A, B, ... (so the box's
drift hits both alike); each launch is ``torchrun --nproc-per-node WORLD`` with ``PYTHONPATH`` set to that
root, builds the engine, and times ``--loads`` calls of ``load_checkpoint`` barrier to barrier (the first
is a warm-up, not counted: it brings the files into the page cache). Reported: per root the median of the
counted loads' worst rank, and the B/A ratio pair by pair.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from benchmarks.models import MODELS, build_model, make_batch  # noqa: E402

MODELS.setdefault("gpt-113m", {"kind": "gpt", "vocab_size": 16384, "block_size": 1024, "n_layer": 14, "n_head": 12,
                               "n_embd": 768, "batch": 2})  # as bench_stage3_memory.py
SEQ = 64


def _engine(args):
    import torch.distributed as dist

    import shardspeed

    shardspeed.init_distributed(backend="gloo", timeout=1800)
    world = dist.get_world_size()
    cfg = {"train_batch_size": MODELS[args.model]["batch"] * world,
           "train_micro_batch_size_per_gpu": MODELS[args.model]["batch"],
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}}, "zero_optimization": {"stage": args.stage}}
    engine, *_ = shardspeed.initialize(model=build_model(args.model), config=cfg)
    return engine, dist.get_rank(), world


def worker(args) -> None:
    import torch.distributed as dist

    import shardspeed

    engine, rank, world = _engine(args)
    if args.save:
        x, y = make_batch(args.model, 0, world, rank)
        engine.backward(engine(x[:, :SEQ].contiguous(), y[:, :SEQ].contiguous()))
        engine.step()
        engine.save_checkpoint(args.dir, tag="t")
    times = []
    for _ in range(args.loads):
        dist.barrier()
        t0 = time.perf_counter()
        engine.load_checkpoint(args.dir, tag="t")
        dist.barrier()
        times.append(time.perf_counter() - t0)
    rows = [None] * world
    dist.all_gather_object(rows, times)
    if rank == 0:
        with open(args.out, "w") as f:
            json.dump(rows, f)
    shardspeed.shutdown_distributed()


def _launch(root: str, args, d: str, save: bool) -> list:
    out = os.path.join(d, "result.json")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={args.world}",
           os.path.abspath(__file__), "--worker", "--dir", os.path.join(d, "ckpt"), "--out", out,
           "--model", args.model, "--stage", str(args.stage), "--loads", str(args.loads)] + (["--save"] if save else [])
    env = dict(os.environ, OMP_NUM_THREADS="1", MALLOC_MMAP_THRESHOLD_="65536",
               PYTHONPATH=os.pathsep.join([os.path.abspath(root), ROOT]))
    subprocess.run(cmd, check=True, env=env)
    with open(out) as f:
        rows = json.load(f)
    return [max(r[i] for r in rows) for i in range(1, args.loads)]  # worst rank per load, warm-up dropped


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--roots", default="", help="A,B: two checkouts (A the baseline)")
    p.add_argument("--model", default="gpt-113m")
    p.add_argument("--world", type=int, default=4)
    p.add_argument("--stage", type=int, default=2)
    p.add_argument("--loads", type=int, default=3)
    p.add_argument("--pairs", type=int, default=3)
    p.add_argument("--results", default="benchmarks/results/bench_load_checks.json")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--save", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--dir", help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        return worker(args)
    if args.roots.count(",") != 1:
        p.error("--roots A,B: two checkouts")
    a, b = args.roots.split(",")
    d = tempfile.mkdtemp(prefix="bench-load-checks-")
    try:
        _launch(a, args, d, save=True)
        runs: dict = {"A": [], "B": []}
        for _ in range(args.pairs):
            runs["A"].append(statistics.median(_launch(a, args, d, save=False)))
            runs["B"].append(statistics.median(_launch(b, args, d, save=False)))
    finally:
        shutil.rmtree(d, ignore_errors=True)
    ratios = [y / x for x, y in zip(runs["A"], runs["B"])]
    print(f"{args.model}, ZeRO {args.stage}, world {args.world}, AdamW fp32; load_checkpoint s (worst rank, median of "
          f"{args.loads - 1} loads per launch)")
    print("| pair | A s | B s | B/A |\n|---|---|---|---|")
    for i, (x, y, r) in enumerate(zip(runs["A"], runs["B"], ratios)):
        print(f"| {i} | {x:.3f} | {y:.3f} | {r:.3f} |")
    print(f"median: A {statistics.median(runs['A']):.3f} s, B {statistics.median(runs['B']):.3f} s, "
          f"B/A {statistics.median(ratios):.3f}")
    os.makedirs(os.path.dirname(args.results) or ".", exist_ok=True)
    with open(args.results, "w") as f:
        json.dump({"model": args.model, "world": args.world, "stage": args.stage, "roots": [a, b], "runs": runs,
                   "ratios": ratios}, f, indent=1)


if __name__ == "__main__":
    main()
