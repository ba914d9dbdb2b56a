"""How much of a training step the matmuls take: the ceiling on what compiling can win on this host.

    python benchmarks/op_share.py --model gpt [--steps 2]

One process, one thread, plain torch (the model of ``benchmarks/models.py``, AdamW), profiled with
torch.profiler after two warm-up steps. Inductor hands matmuls and attention to the same kernels eager uses
and fuses only the elementwise work between them, so ``1 / (1 - elementwise share of forward and backward)``
bounds the step-time ratio compiled blocks can reach (the optimizer step is not compiled either way).
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

MATMUL = {"aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::_scaled_dot_product_flash_attention_for_cpu",
          "aten::_scaled_dot_product_flash_attention_for_cpu_backward"}
OPTIMIZER = {"aten::sqrt", "aten::addcdiv_", "aten::lerp_", "aten::_foreach_sqrt", "aten::_foreach_addcdiv_",
             "aten::_foreach_lerp_", "aten::_fused_adamw_"}


def main() -> None:
    from torch.profiler import ProfilerActivity, profile, record_function

    from benchmarks.models import build_model, make_batch

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="gpt")
    ap.add_argument("--steps", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(1)
    model = build_model(args.model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    x, y = make_batch(args.model, 0, 2, 0)

    def step() -> None:
        model(x, y).backward()
        with record_function("optimizer"):
            opt.step()
            opt.zero_grad()

    for _ in range(2):
        step()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(args.steps):
            step()
    events = prof.key_averages()
    total = sum(e.self_cpu_time_total for e in events)
    optim = next(e.cpu_time_total for e in events if e.key == "optimizer")
    mm = sum(e.self_cpu_time_total for e in events if e.key in MATMUL)
    rest = total - mm - optim
    print("| model | step ms | matmul + attention | optimizer step | other (fusable) | ceiling 1/(1-other) |")
    print("|---|---|---|---|---|---|")
    print(f"| {args.model} | {total / 1000 / args.steps:.0f} | {mm / total:.3f} | {optim / total:.3f} | "
          f"{rest / total:.3f} | {1 / (1 - rest / total):.3f}x |")


if __name__ == "__main__":
    main()
