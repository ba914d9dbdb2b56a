"""The benchmark suite in one command: shardspeed against DDP, FSDP2 and DeepSpeed, interleaved.

    python benchmarks/run.py            # full suite, < 15 min on a 2-core CPU box
    python benchmarks/run.py --quick    # smaller models and fewer steps, ~3 min
    python benchmarks/run.py --systems ddp,ss0 --models mlp --world 4

Every system runs in its own group of ``--world`` gloo worker processes (see benchmarks/harness.py for
why); the coordinator runs short blocks of steps on one system at a time, rotating the order, and reports
the median step time after warm-up, tokens/s, ratios against DDP, FSDP2 and DeepSpeed at the same stage,
peak RSS per rank, bytes communicated per step and the loss after the last step (losses must agree: the
same computation). Results go to benchmarks/results/<tag>.{json,csv,png}.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.harness import BASE_SRC_ENV, BASE_SUFFIX, run_waves  # noqa: E402
from benchmarks.models import MODELS  # noqa: E402
from benchmarks.report import add_ratios, machine, markdown_table, write  # noqa: E402

ALL_SYSTEMS = ["ddp", "fsdp2", "ds0", "ds1", "ds2", "ds3", "ds2-off", "ds3-off",
               "ss0", "ss1", "ss2", "ss3", "ss2-off", "ss3-off"]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="small models, few steps (~3 min)")
    ap.add_argument("--systems", default=",".join(ALL_SYSTEMS))
    ap.add_argument("--models", default=None, help=f"comma-separated, from {sorted(MODELS)}")
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--dtype", default="fp32", choices=["fp32", "bf16"])
    ap.add_argument("--warmup", type=int, default=None)
    ap.add_argument("--blocks", type=int, default=None)
    ap.add_argument("--steps", type=int, default=None, help="timed steps per block")
    ap.add_argument("--max-alive", type=int, default=8,
                    help="systems alive at once (memory); more are run in waves that each repeat DDP and FSDP2")
    ap.add_argument("--tag", default=None, help="results file name (default: suite or quick)")
    ap.add_argument("--base", default=None, metavar="SRC",
                    help="a paired run: every shardspeed system also runs as <system>@base from the source tree SRC "
                         "(e.g. a `git archive` of another commit), interleaved with this one; vs_base = this / base")
    args = ap.parse_args(argv)
    models = args.models.split(",") if args.models else (["mlp-quick", "gpt-quick"] if args.quick else ["mlp", "gpt"])
    def timing(model):
        dw, db, ds = MODELS[model].get("timing", (1, 3, 2) if args.quick else (2, 4, 2))
        return (args.warmup if args.warmup is not None else dw, args.blocks if args.blocks is not None else db,
                args.steps if args.steps is not None else ds)
    systems = [s for s in args.systems.split(",") if s]
    if args.base:
        os.environ[BASE_SRC_ENV] = os.path.abspath(args.base)
        systems += [s + BASE_SUFFIX for s in systems if s.startswith("ss")]
    tag = args.tag or (("quick" if args.quick else "suite") + (f"-w{args.world}" if args.world != 2 else "")
                       + (f"-{args.dtype}" if args.dtype != "fp32" else ""))
    t0 = time.time()
    meta = dict(machine(), command="python benchmarks/run.py " + " ".join(argv if argv is not None else sys.argv[1:]),
                world=args.world, dtype=args.dtype, timing={m: timing(m) for m in models},
                models={m: MODELS[m] for m in models})
    print(f"machine: {meta['cpu']} ({meta['cores']} cores), torch {meta['torch']}, DeepSpeed {meta['deepspeed']}")
    all_rows = {}
    for model in models:
        warmup, blocks, steps = timing(model)
        print(f"== {model}: {len(systems)} systems, world {args.world}, {args.dtype}, "
              f"warm-up {warmup}, {blocks} blocks x {steps} timed steps, interleaved")
        rows = run_waves(systems, model, max_alive=args.max_alive, add_ratios=add_ratios, dtype=args.dtype,
                         world=args.world, warmup=warmup, blocks=blocks, steps_per_block=steps)
        all_rows[model] = rows
        print(markdown_table(rows))
        print(markdown_table(rows, spread=True))
        if args.base:
            for s, r in rows.items():
                if r.get("vs_base") is not None:
                    rounds = ", ".join(f"{x:.3f}" for x in r["vs_base_rounds"])
                    print(f"{s} / {s}{BASE_SUFFIX}: {r['vs_base']:.3f}  (rounds: {rounds})")
        write(tag, all_rows, dict(meta, partial=True))  # keep what is done if a later model fails
    meta["wall_s"] = time.time() - t0
    for p in write(tag, all_rows, meta):
        print("wrote", os.path.relpath(p))
    print(f"total {meta['wall_s']:.0f}s")
    return 0


if __name__ == "__main__":
    import signal

    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # so the worker groups are torn down
    sys.exit(main())
