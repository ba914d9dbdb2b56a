"""Issue 2's check: shardspeed stage 0 against torch DistributedDataParallel, 2 ranks, one process tree.

    python benchmarks/bench_ddp.py [--model gpt|mlp|...] [--blocks 6] [--steps 3]

Both systems are built from the same model, data and AdamW (same fused kernel), each in its own pair of
gloo worker processes, and timed in alternating blocks (see benchmarks/harness.py). Prints the median
step times and the ratio. Target: shardspeed stage 0 at most 1.05x DDP.
"""
from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.harness import run_interleaved  # noqa: E402
from benchmarks.report import add_ratios, machine, write  # noqa: E402

TARGET = 1.05


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="mlp,gpt")
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--blocks", type=int, default=6)
    ap.add_argument("--steps", type=int, default=3)
    args = ap.parse_args(argv)
    all_rows, ok = {}, True
    for model in args.models.split(","):
        rows = run_interleaved(["ddp", "ss0"], model, world=args.world, warmup=args.warmup, blocks=args.blocks,
                               steps_per_block=args.steps)
        d, s = rows["ddp"], rows["ss0"]
        if d.get("status") != "ok" or s.get("status") != "ok":
            print(f"{model}: could not run: {d.get('message') or s.get('message')}")
            return 2
        add_ratios(rows)  # paired: median over rounds of (ss0 block median / DDP block median, same round)
        ratio, rounds = s["vs_ddp"], s["vs_ddp_rounds"]
        ok &= ratio <= TARGET
        print(f"{model}: DDP {d['median_step_s'] * 1e3:.1f} ms/step, shardspeed stage 0 {s['median_step_s'] * 1e3:.1f} "
              f"ms/step -> paired ratio {ratio:.3f}x (per-round {min(rounds):.2f}-{max(rounds):.2f}, "
              f"{len(rounds)} rounds; ratio of medians {s['median_step_s'] / d['median_step_s']:.3f}x; "
              f"target <= {TARGET}x: {'met' if ratio <= TARGET else 'MISSED'}); "
              f"final loss {d['final_loss']:.6f} vs {s['final_loss']:.6f}")
        all_rows[model] = rows
    write("bench_ddp", all_rows, dict(machine(), command="python benchmarks/bench_ddp.py " + " ".join(argv or sys.argv[1:])))
    return 0 if ok else 1


if __name__ == "__main__":
    import signal

    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # so the worker groups are torn down
    sys.exit(main())
