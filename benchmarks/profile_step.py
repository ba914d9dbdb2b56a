"""Where a system's step time goes: torch.profiler on rank 0 over a few steps, 2 gloo ranks.

    python benchmarks/profile_step.py --systems ddp,fsdp2,ss3 --model gpt [--steps 3]

For each system (run one after another, each in a fresh pair of processes) rank 0 profiles ``--steps``
steps after two warm-up steps and reports a breakdown in milliseconds per step:

- ``forward`` / ``backward`` / ``optimizer``: wall time of the three phases (marked with
  ``record_function`` by this script: ``engine(x)``/``engine.backward``/``engine.step`` for the libraries,
  ``model(x)``/``loss.backward()``/clip + ``opt.step`` for DDP and FSDP2);
- inside them: for shardspeed, the time in its stage-3 forward hooks, in waiting for parameter
  all-gathers, in waiting for gradient reduce-scatters/all-reduces, in the gradient hook (copy into
  buckets) and in the Adam kernel. The script wraps those library methods with ``record_function`` labels
  (``ss::...``), it changes nothing else. For FSDP2 its own ``FSDP::...`` labels are reported; for every
  system the collective launches (``c10d::``/``gloo:``) and the optimizer kernel (``aten::_fused_adamw_``).

Times are inclusive (a label's time contains the labels it calls) and are CPU time on rank 0's main
thread; gloo runs its collectives on its own threads, which compete for the same 2 cores. Writes
``benchmarks/results/profile-<model><tag>.{json,md}`` and the raw tables ``profile-<model>-<system>.txt``.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")


def _label(obj, name: str, label: str) -> None:
    """Wrap ``obj.name`` (a class's method) in a profiler range; nothing else changes."""
    import functools

    from torch.profiler import record_function

    fn = getattr(obj, name)

    @functools.wraps(fn)
    def wrapped(*a, **k):
        with record_function(label):
            return fn(*a, **k)

    setattr(obj, name, wrapped)


def _instrument_shardspeed() -> None:
    from shardspeed.zero import reductions, root, unit

    _label(unit.ShardedParamUnit, "start_gather", "ss::gather_launch")
    _label(unit.ShardedParamUnit, "finish_gather", "ss::gather_wait")
    _label(unit.ShardedParamUnit, "release", "ss::release")
    _label(root.ZeroRoot, "_on_grad", "ss::grad_hook")
    _label(reductions.ReductionQueue, "_launch", "ss::reduce_launch")
    _label(reductions.ReductionQueue, "_complete", "ss::reduce_wait")
    _label(root.ZeroRoot, "_end_backward", "ss::finish_backward")
    _label(root.ZeroRoot, "gather_for_backward", "ss::pre_backward_hook")
    pm = root.ZeroRoot
    orig_pre, orig_post = pm._make_pre_forward, pm._make_post_forward

    def make_pre(self, idx):
        h = orig_pre(self, idx)

        def hook(m, a, k):
            from torch.profiler import record_function

            with record_function("ss::pre_forward_hook"):
                return h(m, a, k)
        return hook

    def make_post(self, idx):
        h = orig_post(self, idx)

        def hook(m, a, o):
            from torch.profiler import record_function

            with record_function("ss::post_forward_hook"):
                return h(m, a, o)
        return hook

    pm._make_pre_forward, pm._make_post_forward = make_pre, make_post


def _phases(sysobj):
    """(forward, backward, optimizer) callables for one system."""
    import torch

    from benchmarks.systems import CLIP

    if hasattr(sysobj, "engine"):
        e = sysobj.engine
        return (lambda x, y: e(x, y)), (lambda loss: e.backward(loss)), (lambda: e.step())
    m = sysobj.model

    def optim():
        torch.nn.utils.clip_grad_norm_(m.parameters(), CLIP)
        sysobj.opt.step()
        sysobj.opt.zero_grad(set_to_none=True)

    return (lambda x, y: m(x, y)), (lambda loss: loss.backward()), optim


KEYS = ["phase::forward", "phase::backward", "phase::optimizer",
        "ss::pre_forward_hook", "ss::post_forward_hook", "ss::pre_backward_hook", "ss::gather_launch",
        "ss::gather_wait", "ss::release", "ss::grad_hook", "ss::reduce_launch", "ss::reduce_wait",
        "ss::finish_backward",
        "FSDP::pre_forward", "FSDP::post_forward", "FSDP::pre_backward", "FSDP::post_backward",
        "FSDP::all_gather", "FSDP::all_gather_copy_out", "FSDP::post_backward_reduce",
        "FSDP::root_pre_forward", "FSDP::root_post_backward_callback", "FSDP::backward_prefetch",
        "DistributedDataParallel.forward",
        "aten::_fused_adamw_", "aten::_foreach_norm", "aten::mm", "aten::addmm", "aten::bmm",
        "aten::_scaled_dot_product_flash_attention_for_cpu", "aten::copy_", "aten::add_", "aten::zero_",
        "aten::empty", "aten::cat", "aten::split_with_sizes_copy", "aten::chunk_cat",
        "c10d::allgather_", "c10d::_allgather_base_", "c10d::reduce_scatter_", "c10d::_reduce_scatter_base_",
        "c10d::allreduce_", "c10d::wait", "c10d::allgather_into_tensor_coalesced_",
        "gloo:all_gather", "gloo:reduce_scatter", "gloo:all_reduce"]


def _rank(rank, world, port, system, model_name, steps, rows, out_prefix):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank), DS_ACCELERATOR="cpu")
    import logging
    import time
    import warnings

    warnings.filterwarnings("ignore")
    logging.disable(logging.WARNING)
    import torch
    import torch.distributed as dist
    from torch.profiler import ProfilerActivity, profile, record_function

    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    if system.startswith("ss"):
        _instrument_shardspeed()
    from benchmarks.models import MODELS, build_model, make_batch
    from benchmarks.systems import build_system

    sysobj = build_system(system, build_model(model_name), MODELS[model_name]["batch"])
    fwd, bwd, opt = _phases(sysobj)
    batches = [make_batch(model_name, i, world, rank) for i in range(steps + 2)]

    def step(x, y):
        with record_function("phase::forward"):
            loss = fwd(x, y)
        with record_function("phase::backward"):
            bwd(loss)
        with record_function("phase::optimizer"):
            opt()
        return loss

    for x, y in batches[:2]:
        float(step(x, y))
    dist.barrier()
    walls = []
    with profile(activities=[ProfilerActivity.CPU], record_shapes=False) as prof:
        for x, y in batches[2:]:
            t = time.perf_counter()
            float(step(x, y))
            walls.append(time.perf_counter() - t)
    dist.barrier()
    if rank == 0:
        ka: dict = {}
        for e in prof.key_averages():  # FSDP2 labels carry the module: "FSDP::pre_forward (blocks.2)"
            k = e.key.split(" (")[0] if e.key.startswith("FSDP::") else e.key
            a = ka.setdefault(k, [0.0, 0.0, 0])
            a[0] += e.cpu_time_total
            a[1] += e.self_cpu_time_total
            a[2] += e.count
        br = {"system": system, "model": model_name, "steps": steps,
              "wall_ms_per_step": 1e3 * sum(walls) / len(walls)}
        for k in KEYS:
            if k in ka:
                br[k] = {"ms_per_step": ka[k][0] / 1e3 / steps, "self_ms_per_step": ka[k][1] / 1e3 / steps,
                         "calls_per_step": ka[k][2] / steps}
        table = prof.key_averages().table(sort_by="cpu_time_total", row_limit=rows)
        print(f"== {system} on {model_name}, {steps} steps, rank 0: {br['wall_ms_per_step']:.0f} ms/step")
        with open(f"{out_prefix}-{system}.txt", "w") as f:
            f.write(table)
        with open(f"{out_prefix}-{system}.json", "w") as f:
            json.dump(br, f, indent=1)
    dist.barrier()
    dist.destroy_process_group()


def breakdown_md(brs) -> str:
    def g(b, k):
        v = b.get(k)
        return v["ms_per_step"] if v else None

    f = lambda v: f"{v:.0f}" if v is not None else "–"  # noqa: E731
    rows = [
        ("step (wall, rank 0)", lambda b: b["wall_ms_per_step"]),
        ("forward", lambda b: g(b, "phase::forward")),
        ("  stage-3 pre/post-forward hooks (gather launch + wait + release)",
         lambda b: (g(b, "ss::pre_forward_hook") or 0) + (g(b, "ss::post_forward_hook") or 0) if "ss::pre_forward_hook" in b else None),
        ("  FSDP2 pre/post-forward (gather + copy-out + reshard)",
         lambda b: (g(b, "FSDP::pre_forward") or 0) + (g(b, "FSDP::post_forward") or 0) if "FSDP::pre_forward" in b else None),
        ("backward", lambda b: g(b, "phase::backward")),
        ("  stage-3 pre-backward hooks (re-gather)", lambda b: g(b, "ss::pre_backward_hook")),
        ("  FSDP2 pre-backward (re-gather)", lambda b: g(b, "FSDP::pre_backward")),
        ("  gradient hook: copy into buckets + launch (shardspeed)", lambda b: g(b, "ss::grad_hook")),
        ("  FSDP2 post-backward reduce (reduce-scatter launch + wait)", lambda b: g(b, "FSDP::post_backward_reduce")),
        ("  FSDP2 root post-backward callback (wait for the last reductions)", lambda b: g(b, "FSDP::root_post_backward_callback")),
        ("  end of backward: wait for the last reductions (shardspeed)", lambda b: g(b, "ss::finish_backward")),
        ("parameter all-gather: waiting (shardspeed, all phases)", lambda b: g(b, "ss::gather_wait")),
        ("parameter all-gather: launch + buffer alloc (shardspeed)", lambda b: g(b, "ss::gather_launch")),
        ("FSDP2 all-gather (launch, copy-in, wait) + copy-out",
         lambda b: (g(b, "FSDP::all_gather") or 0) + (g(b, "FSDP::all_gather_copy_out") or 0) if "FSDP::all_gather" in b else None),
        ("gradient reduce: waiting (shardspeed, all phases)", lambda b: g(b, "ss::reduce_wait")),
        ("c10d::wait (all systems that wait from Python)", lambda b: g(b, "c10d::wait")),
        ("optimizer phase (clip + Adam + stage-1/2 all-gather / stage-3 release)", lambda b: g(b, "phase::optimizer")),
        ("  Adam kernel (aten::_fused_adamw_)", lambda b: g(b, "aten::_fused_adamw_")),
        ("matmuls (aten::mm + addmm + bmm, all phases)",
         lambda b: sum(g(b, k) or 0 for k in ("aten::mm", "aten::addmm", "aten::bmm"))),
    ]
    names = [b["system"] for b in brs]
    out = ["| ms per step (rank 0, inclusive) | " + " | ".join(names) + " |", "|---|" + "---|" * len(names)]
    for label, fn in rows:
        vals = [fn(b) for b in brs]
        if all(v is None for v in vals):
            continue
        out.append(f"| {label} | " + " | ".join(f(v) for v in vals) + " |")
    return "\n".join(out)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--systems", "--system", default="ddp,fsdp2,ss3")
    ap.add_argument("--model", default="gpt")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--rows", type=int, default=40)
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--tag", default="", help="suffix of the combined files: profile-<model><tag>.{md,json}")
    args = ap.parse_args(argv)
    import torch.multiprocessing as mp

    from benchmarks.harness import _free_port

    os.makedirs(RESULTS, exist_ok=True)
    prefix = os.path.join(RESULTS, f"profile-{args.model}")
    brs = []
    for system in args.systems.split(","):
        mp.spawn(_rank, args=(args.world, _free_port(), system, args.model, args.steps, args.rows, prefix),
                 nprocs=args.world)
        with open(f"{prefix}-{system}.json") as f:
            brs.append(json.load(f))
    md = breakdown_md(brs)
    prefix += args.tag
    print(md)
    with open(prefix + ".md", "w") as f:
        f.write(f"`python benchmarks/profile_step.py --systems {args.systems} --model {args.model} "
                f"--steps {args.steps}`\n\n" + md + "\n")
    with open(prefix + ".json", "w") as f:
        json.dump(brs, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
