"""gloo's reduce-scatter and all-gather forms against the ones shardspeed's ``Collectives`` issues on gloo.

    python benchmarks/bench_gloo_collectives.py              # 46 MB fp32 message, world 2 and 4: ~1 min
    python benchmarks/bench_gloo_collectives.py --mb 92 --worlds 2

Each world is one group of fresh gloo processes on loopback (one intra-op thread each). Per form: the median
of ``--reps`` calls (a barrier before and after each), and the growth of the process's peak RSS during the
calls (VmHWM reset before them; ``MALLOC_MMAP_THRESHOLD_`` fixed so freed temporaries leave the process),
worst rank. Forms:

- reduce-scatter: torch's ``reduce_scatter_single`` (tensor form) and ``reduce_scatter`` over chunk views
  (list form; what ``Collectives`` issued before), both of which gloo runs as an all-reduce, and
  ``Collectives.reduce_scatter`` (point-to-point exchanges from 64 KiB chunks, in place); ``all_reduce``
  of the same message for scale;
- all-gather: torch's ``all_gather_single`` and ``Collectives.all_gather`` (one broadcast per rank).

Every form's result is checked against ``all_reduce`` / the concatenated shards. JSON:
benchmarks/results/gloo_collectives.json.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)


def _hwm_mib() -> float:
    with open("/proc/self/status") as f:
        return int(f.read().split("VmHWM:")[1].split()[0]) / 1024


def _worker(rank: int, world: int, port: int, numel: int, reps: int, q) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    import warnings

    warnings.filterwarnings("ignore")
    import torch
    import torch.distributed as dist

    from shardspeed.comm.collectives import Collectives, CommsLogger
    from shardspeed.mesh.topology import Topology

    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    c = Collectives(Topology.data_parallel(), CommsLogger())
    n = numel // world
    base = torch.arange(world * n, dtype=torch.float32) % 977
    src = base * (rank + 1)  # integer values: sums exact in any order
    x, out, full, shard = src.clone(), torch.empty(n), torch.empty(world * n), src[:n].clone() + rank
    want_rs = src.clone()
    dist.all_reduce(want_rs)
    want_rs = want_rs.view(world, n)[rank].clone()
    want_ag = torch.cat([base[:n] * (r + 1) + r for r in range(world)])

    def rs_tensor():
        fn = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
        fn(out, x)
        return out

    def rs_list():
        dist.reduce_scatter(out, list(x.view(world, n).unbind(0)))
        return out

    def rs_ours():
        mine = x.view(world, n)[rank]
        c.reduce_scatter(mine, x)
        return mine

    def ag_tensor():
        fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        fn(full, shard)
        return full

    def ag_ours():
        c.all_gather(full, shard)
        return full

    forms = {"reduce-scatter, gloo tensor form": (rs_tensor, want_rs),
             "reduce-scatter, gloo list form (before)": (rs_list, want_rs),
             "reduce-scatter, Collectives (exchanges)": (rs_ours, want_rs),
             "all-reduce (for scale)": (lambda: dist.all_reduce(x) or x, None),
             "all-gather, gloo tensor form": (ag_tensor, want_ag),
             "all-gather, Collectives (broadcasts)": (ag_ours, want_ag)}
    rows = {}
    for name, (fn, want) in forms.items():
        x.copy_(src)
        ok = want is None or torch.equal(fn(), want)
        times = []
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        base = _hwm_mib()
        for _ in range(reps):
            x.copy_(src)
            dist.barrier()
            t = time.perf_counter()
            fn()
            dist.barrier()
            times.append(time.perf_counter() - t)
        rows[name] = {"ms": 1e3 * statistics.median(times), "hwm_growth_mib": _hwm_mib() - base, "correct": ok}
    q.put((rank, rows))
    dist.destroy_process_group()


def run_world(world: int, numel: int, reps: int) -> dict:
    import torch.multiprocessing as mp

    from benchmarks.harness import _free_port

    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_worker, args=(r, world, port, numel, reps, q)) for r in range(world)]
    for p in procs:
        p.start()
    got = dict(q.get(timeout=600) for _ in procs)
    for p in procs:
        p.join()
    names = list(got[0])
    return {n: {"ms": max(got[r][n]["ms"] for r in got), "hwm_growth_mib": max(got[r][n]["hwm_growth_mib"] for r in got),
                "correct": all(got[r][n]["correct"] for r in got)} for n in names}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--mb", type=float, default=46.0, help="message size (MB, fp32)")
    ap.add_argument("--worlds", default="2,4")
    ap.add_argument("--reps", type=int, default=8)
    ap.add_argument("--mmap-threshold", type=int, default=65536)
    args = ap.parse_args(argv)
    os.environ["MALLOC_MMAP_THRESHOLD_"] = str(args.mmap_threshold)
    numel = int(args.mb * 1e6 / 4) // 4096 * 4096
    results = {}
    for w in (int(s) for s in args.worlds.split(",")):
        results[w] = run_world(w, numel, args.reps)
    lines = [f"gloo on loopback, {numel * 4 / 1e6:.1f} MB fp32 message, median of {args.reps} calls, worst rank; "
             f"{os.cpu_count()} cores", "", "| form | " + " | ".join(f"world {w}: ms, +peak MiB" for w in results) + " |",
             "|---|" + "---|" * len(results)]
    for name in next(iter(results.values())):
        cells = [f"{r[name]['ms']:.1f}, +{r[name]['hwm_growth_mib']:.0f}{'' if r[name]['correct'] else ' WRONG'}"
                 for r in results.values()]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    table = "\n".join(lines)
    print(table)
    with open(os.path.join(ROOT, "benchmarks", "results", "gloo_collectives.json"), "w") as f:
        json.dump({"command": " ".join(["python", "benchmarks/bench_gloo_collectives.py", *(argv or sys.argv[1:])]),
                   "numel": numel, "results": results, "table": table}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
