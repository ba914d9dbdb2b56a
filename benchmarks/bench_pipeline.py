"""Pipeline bubble on layers that sleep: shardspeed's schedules against theory and DeepSpeed's PipelineEngine.

Each layer sleeps t in forward and 2t in backward (t for the input gradient, t for the weight gradient,
in separate autograd nodes, so the zero-bubble schedules can split them). The model has 2p layers: two per
rank (one stage of two layers, or two one-layer chunks for the interleaved and V schedules), so every
rank's compute per step is m × 2 × 3t whatever the schedule. Measured bubble = 1 − that / step time.

    python benchmarks/bench_pipeline.py [--t 0.02] [--steps 2] [--p 2 4] [--m 8 16] [--systems 1f1b deepspeed]

Writes benchmarks/results/bench_pipeline.{json,md}. DeepSpeed columns are skipped when it is absent.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback
from typing import Any, Dict, List, Optional

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from benchmarks.harness import init_gloo, run_once, worker_setup  # noqa: E402

SCHEDULES = ["1f1b", "gpipe", "interleaved_1f1b", "zbv", "dualpipev"]


def theory(schedule: str, p: int, m: int) -> Optional[float]:
    sys.path.insert(0, ROOT)
    from shardspeed.pipe.partition import bubble_fraction

    if schedule in ("1f1b", "gpipe", "deepspeed"):
        return bubble_fraction("1f1b", p, m)
    if schedule == "interleaved_1f1b":
        return bubble_fraction(schedule, p, m, 2)
    return None  # zero-bubble V schedules: about 0 when F = B = W (Qi et al. 2024)


def _make_layer_class():
    import torch
    import torch.nn as nn

    class Sleep(torch.autograd.Function):
        """Sleep t/2 forward and t backward (one for the input gradient, one for the weight gradient)."""

        @staticmethod
        def forward(ctx, x, t):
            ctx.t = t
            time.sleep(t / 2)
            return x.clone()

        @staticmethod
        def backward(ctx, g):
            time.sleep(ctx.t)
            return g, None

    class SleepLayer(nn.Module):
        def __init__(self, t: float):
            super().__init__()
            self.t = t
            self.w = nn.Parameter(torch.zeros(1))

        def forward(self, x):
            return Sleep.apply(x, self.t) + Sleep.apply(self.w, self.t)

    return SleepLayer


def _loss(out, y):
    return ((out - y) ** 2).mean()


def _worker(rank: int, world: int, port: int, system: str, m: int, t: float, steps: int, q) -> None:
    worker_setup(rank, world, port, threads=1)
    try:
        import torch
        import torch.distributed as dist

        init_gloo(rank, world)
        layer = _make_layer_class()
        cfg: Dict[str, Any] = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": m,
                               "gradient_clipping": 0.0, "optimizer": {"type": "SGD", "params": {"lr": 1e-3}}}
        if system == "deepspeed":
            import deepspeed
            import deepspeed.pipe as pipe

            deepspeed.init_distributed(dist_backend="gloo")
            init = deepspeed.initialize
        else:
            import shardspeed
            import shardspeed.pipe as pipe  # type: ignore[no-redef]

            init = shardspeed.initialize
            cfg["pipeline"] = {"schedule": system}
        model = pipe.PipelineModule([pipe.LayerSpec(layer, t) for _ in range(2 * world)], num_stages=world,
                                    loss_fn=_loss, partition_method="uniform")
        engine, *_ = init(model=model, config=cfg, model_parameters=list(model.parameters()))
        torch.manual_seed(0)  # the first and last stages must read the same batches
        x, y = torch.randn(1, 8), torch.randn(1, 8)
        times = []
        for i in range(steps + 1):  # the first step builds the schedule: not timed
            dist.barrier()
            t0 = time.perf_counter()
            engine.train_batch(iter([(x, y)] * m))
            dist.barrier()
            if i:
                times.append(time.perf_counter() - t0)
        if rank == 0:
            q.put(("ok", min(times)))
        dist.destroy_process_group()
    except BaseException:
        q.put(("error", traceback.format_exc()))


def measure(system: str, p: int, m: int, t: float, steps: int) -> float:
    return float(run_once(_worker, p, (system, m, t, steps), 600, f"{system} p={p} m={m}"))


def main(argv: Optional[List[str]] = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--t", type=float, default=0.02, help="forward sleep per layer (s); backward sleeps 2t")
    ap.add_argument("--steps", type=int, default=2, help="timed steps per case (the fastest is kept)")
    ap.add_argument("--p", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--m", type=int, nargs="+", default=[8, 16])
    ap.add_argument("--systems", nargs="+", default=None, help="schedules and/or 'deepspeed' (default: all)")
    ap.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results", "bench_pipeline"))
    args = ap.parse_args(argv)
    import importlib.util

    systems = args.systems or SCHEDULES + (["deepspeed"] if importlib.util.find_spec("deepspeed") else [])
    rows = []
    for p in args.p:
        for m in args.m:
            work = m * 2 * 3 * args.t  # every rank: m micro-batches × 2 layers × (t + 2t)
            for system in systems:
                step = measure(system, p, m, args.t, args.steps)
                rows.append({"p": p, "m": m, "system": system, "step_s": round(step, 4),
                             "bubble": round(1 - work / step, 3), "theory": theory(system, p, m)})
                print(json.dumps(rows[-1]), flush=True)
    with open(args.out + ".json", "w") as f:
        json.dump({"t": args.t, "steps": args.steps, "rows": rows}, f, indent=1)
    lines = [f"# Pipeline bubble on sleeping layers (forward {args.t * 1e3:g} ms, backward {2 * args.t * 1e3:g} ms "
             f"per layer; 2 layers per rank; gloo, CPU)", "",
             "| p | m | system | step (s) | bubble | 1F1B theory / interleaved theory |", "|---|---|---|---|---|---|"]
    for r in rows:
        th = "-" if r["theory"] is None else f"{r['theory']:.3f}"
        lines.append(f"| {r['p']} | {r['m']} | {r['system']} | {r['step_s']:.3f} | {r['bubble']:.3f} | {th} |")
    with open(args.out + ".md", "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
