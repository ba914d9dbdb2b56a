"""How fast a checkpoint load re-slices a tensor-parallel weight (shardspeed.checkpoint.slices.copy_runs):
the index arithmetic plus the copies, for a 4096×4096 fp32 weight, from memory (no file I/O), one process.

    python -m benchmarks.bench_tp_checkpoint [--size 4096] [--repeat 3]

Prints MB/s of the assembled output per case (best of ``--repeat``) and the peak resident memory.
"""
from __future__ import annotations

import argparse
import resource
import time

import torch

from shardspeed.checkpoint.slices import copy_runs


def cases(n: int):
    numel = n * n
    return [
        ("TP1 whole from TP2 column slices (dim 0)", None, [((0, 1, r, 2), 0, numel // 2) for r in range(2)]),
        ("TP1 whole from TP2 row slices (dim 1)", None, [((1, 1, r, 2), 0, numel // 2) for r in range(2)]),
        ("TP2 dim-1 slice from TP1 in 4 ZeRO pieces", (1, 1, 1, 2),
         [(None, i * numel // 4, (i + 1) * numel // 4) for i in range(4)]),
        ("TP4 dim-1 slice from TP2 slices in 2 ZeRO pieces each", (1, 1, 1, 4),
         [((1, 1, r, 2), i * numel // 4, (i + 1) * numel // 4) for r in range(2) for i in range(2)]),
    ]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--size", type=int, default=4096)
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    shape = (args.size, args.size)
    for name, want, entries in cases(args.size):
        out = torch.empty(args.size * args.size // (1 if want is None else want[3]))
        saved = [torch.randn(hi - lo) for _, lo, hi in entries]
        best = float("inf")
        for _ in range(args.repeat):
            t0 = time.perf_counter()
            for k, dst, src, ln in copy_runs(shape, want, 0, out.numel(), entries):
                out[dst : dst + ln].copy_(saved[k][src : src + ln])
            best = min(best, time.perf_counter() - t0)
        print(f"{name}: {out.numel() / 1e6:.1f}M fp32 in {best:.3f}s ({out.numel() * 4 / best / 1e6:.0f} MB/s)")
    print(f"peak RSS {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024:.0f} MB")


if __name__ == "__main__":
    main()
