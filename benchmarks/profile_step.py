"""Where one system's step time goes: torch.profiler on rank 0 over a few steps, 2 gloo ranks.

    python benchmarks/profile_step.py --system ss2 --model gpt-quick [--steps 4] [--rows 25]

Prints the profiler's table sorted by self CPU time (collectives show as gloo:* / c10d:: entries, the
optimizer as aten::_fused_adamw_, the library's Python as the ops it issues).
"""
from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _rank(rank, world, port, system, model_name, steps, rows, out):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank), DS_ACCELERATOR="cpu")
    import warnings

    warnings.filterwarnings("ignore")
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    from benchmarks.models import MODELS, build_model, make_batch
    from benchmarks.systems import build_system

    sysobj = build_system(system, build_model(model_name), MODELS[model_name]["batch"])
    batches = [make_batch(model_name, i, world, rank) for i in range(steps + 2)]
    for x, y in batches[:2]:
        sysobj.step(x, y)
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], record_shapes=False) as prof:
        for x, y in batches[2:]:
            float(sysobj.step(x, y))
    if rank == 0:
        table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=rows)
        print(f"== {system} on {model_name}, {steps} steps, rank 0")
        print(table)
        if out:
            with open(out, "w") as f:
                f.write(table)
    dist.barrier()
    dist.destroy_process_group()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--system", default="ss2")
    ap.add_argument("--model", default="gpt-quick")
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--rows", type=int, default=25)
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    import torch.multiprocessing as mp

    from benchmarks.harness import _free_port

    mp.spawn(_rank, args=(args.world, _free_port(), args.system, args.model, args.steps, args.rows, args.out),
             nprocs=args.world)
    return 0


if __name__ == "__main__":
    sys.exit(main())
