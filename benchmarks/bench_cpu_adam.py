"""Host Adam throughput: parameters updated per second on one flat fp32 tensor, side by side.

    DS_ACCELERATOR=cpu python benchmarks/bench_cpu_adam.py [--sizes 10e6 50e6 100e6] [--rounds 5]

Methods (all AdamW, weight decay 0.01, fp32 params/grads/states on the CPU):
  torch-fused     torch.optim.AdamW(fused=True)
  torch-foreach   torch.optim.AdamW(foreach=True)
  deepspeed       deepspeed.ops.adam.DeepSpeedCPUAdam (its C++ AVX op, JIT-built on first use)
  shardspeed      shardspeed.offload.CPUAdam (torch's fused kernel on the flat tensor)
  shardspeed-2t   the same, the tensor cut into 2 chunks stepped from 2 threads

The box is shared and small, so methods are interleaved: each round builds every method in a shuffled
order, warms it up with one step and times ``--steps`` steps (median); the table reports, per method, the
median over rounds and the ratio to DeepSpeed's median.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time

os.environ.setdefault("DS_ACCELERATOR", "cpu")

import torch  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from shardspeed.offload import CPUAdam  # noqa: E402


def _deepspeed_adam():
    try:
        from deepspeed.ops.adam import DeepSpeedCPUAdam

        p = torch.nn.Parameter(torch.zeros(16))
        p.grad = torch.zeros(16)
        DeepSpeedCPUAdam([p]).step()  # builds the op now (minutes the first time)
        return DeepSpeedCPUAdam
    except Exception as e:  # noqa: BLE001 - report and go on without it
        print(f"deepspeed CPU Adam unavailable: {type(e).__name__}: {e}", file=sys.stderr)
        return None


def make_methods(ds_cls):
    m = {
        "torch-fused": lambda ps: torch.optim.AdamW(ps, lr=1e-3, weight_decay=0.01, fused=True),
        "torch-foreach": lambda ps: torch.optim.AdamW(ps, lr=1e-3, weight_decay=0.01, foreach=True),
        "shardspeed": lambda ps: CPUAdam(ps, lr=1e-3, weight_decay=0.01),
        "shardspeed-2t": lambda ps: CPUAdam(ps, lr=1e-3, weight_decay=0.01, threads=2),
    }
    if ds_cls is not None:
        m["deepspeed"] = lambda ps: ds_cls(ps, lr=1e-3, weight_decay=0.01, adamw_mode=True)
    return m


def time_method(make, n: int, steps: int) -> float:
    p = torch.nn.Parameter(torch.randn(n))
    p.grad = torch.randn(n)
    opt = make([p])
    opt.step()  # states allocated, kernels warm
    ts = []
    for _ in range(steps):
        t0 = time.perf_counter()
        opt.step()
        ts.append(time.perf_counter() - t0)
    del opt, p
    return statistics.median(ts)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sizes", type=float, nargs="+", default=[10e6, 50e6, 100e6])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    ap.add_argument("--json", default=None, help="write the results here")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    ds = _deepspeed_adam()
    methods = make_methods(ds)
    rng = random.Random(0)
    results = {}
    for size in args.sizes:
        n = int(size)
        per = {k: [] for k in methods}
        for _ in range(args.rounds):
            order = list(methods)
            rng.shuffle(order)
            for k in order:
                per[k].append(time_method(methods[k], n, args.steps))
        results[n] = {k: statistics.median(v) for k, v in per.items()}
        results[n]["_all"] = per
    names = list(methods)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {os.cpu_count()} cpus; "
          f"median of {args.rounds} interleaved rounds × {args.steps} steps")
    print("| elements | " + " | ".join(f"{k} (Mparam/s)" for k in names) + " | " +
          " | ".join(f"{k}/deepspeed" for k in names if k != "deepspeed" and "deepspeed" in names) + " |")
    print("|---" * (1 + len(names) + (len(names) - 1 if "deepspeed" in names else 0)) + "|")
    for n, r in results.items():
        rates = {k: n / r[k] / 1e6 for k in names}
        row = [f"{n / 1e6:.0f}M"] + [f"{rates[k]:.0f}" for k in names]
        if "deepspeed" in names:
            row += [f"{rates[k] / rates['deepspeed']:.2f}" for k in names if k != "deepspeed"]
        print("| " + " | ".join(row) + " |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({str(n): {k: v for k, v in r.items()} for n, r in results.items()}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
