"""Issue 37: what ``python -c "import deepspeed"`` costs through shardspeed's opt-in package, beside the real
DeepSpeed's import.

    python benchmarks/bench_deepspeed_import.py            # 5 fresh processes per backend, medians
    python benchmarks/bench_deepspeed_import.py --runs 9 --json benchmarks/results/deepspeed_import.json

Backends, each in fresh processes, taken in turn (nothing cached in the interpreter; the OS file cache is warm
after the first, discarded, run of each):
  - ``shardspeed``: ``PYTHONPATH=$(shardspeed deepspeed-path):<checkout>`` -- ``import deepspeed`` is
    shardspeed's package;
  - ``deepspeed``: plain ``PYTHONPATH=<checkout>`` -- the installed DeepSpeed, as a user runs it (no
    ``DS_ACCELERATOR``: it detects the accelerator itself);
  - ``torch``: ``import torch`` alone, the floor both stand on.

Per run: the wall time of the whole ``python -c`` process (start to exit), the import alone
(``time.perf_counter`` around the statement), the process's max RSS (``getrusage(RUSAGE_SELF).ru_maxrss``
after the import), and what the import left started: ``torch.cuda.is_initialized()``,
``torch.distributed.is_initialized()``, threads, child processes, modules loaded, and which heavy
packages came in with it.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HEAVY = ("triton", "transformers", "accelerate", "numpy", "pydantic", "hjson", "psutil", "deepspeed.ops",
         "deepspeed.accelerator", "deepspeed.comm", "deepspeed.runtime.engine", "torch._dynamo", "sympy")

PROBE = r"""
import json, os, resource, sys, threading, time
t0 = time.perf_counter()
import {module}
t1 = time.perf_counter()
import torch
out = {{"import_s": t1 - t0, "maxrss_kib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss,
       "cuda_initialized": torch.cuda.is_initialized(),
       "dist_initialized": torch.distributed.is_available() and torch.distributed.is_initialized(),
       "threads": threading.active_count(), "modules": len(sys.modules),
       "origin": getattr(sys.modules["{module}"], "__file__", None),
       "heavy": [m for m in {heavy!r} if m in sys.modules]}}
out["children"] = sum(1 for p in os.listdir("/proc") if p.isdigit() and _ppid(p) == os.getpid())
print("PROBE " + json.dumps(out))
"""

CHILDREN = r"""
def _ppid(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[1])
    except OSError:
        return -1
"""


def site_path() -> str:
    out = subprocess.run([sys.executable, "-m", "shardspeed.cli", "deepspeed-path"], capture_output=True,
                         text=True, check=True, env=dict(os.environ, PYTHONPATH=ROOT))
    return out.stdout.strip().splitlines()[-1]


def backends() -> dict[str, tuple[str, str]]:
    """name -> (PYTHONPATH, module imported)."""
    return {"shardspeed": (os.pathsep.join([site_path(), ROOT]), "deepspeed"),
            "deepspeed": (ROOT, "deepspeed"),
            "torch alone": (ROOT, "torch")}


def one_run(pythonpath: str, module: str) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("DS_ACCELERATOR", "PYTHONPATH")}
    env["PYTHONPATH"] = pythonpath
    code = CHILDREN + PROBE.format(module=module, heavy=HEAVY)
    t0 = time.perf_counter()
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)
    wall = time.perf_counter() - t0
    if out.returncode != 0:
        raise SystemExit(f"import {module} failed (PYTHONPATH={pythonpath}): {out.stderr.strip()[-500:]}")
    line = [x for x in out.stdout.splitlines() if x.startswith("PROBE ")][-1]
    got = json.loads(line[len("PROBE "):])
    got["wall_s"] = wall
    return got


def measure(runs: int) -> dict[str, dict]:
    results = {}
    todo = backends()
    for path, module in todo.values():
        one_run(path, module)  # warm the file cache; not counted
    got: dict[str, list[dict]] = {name: [] for name in todo}
    for _ in range(runs):  # round-robin, so that the box's load falls on every backend alike
        for name, (path, module) in todo.items():
            got[name].append(one_run(path, module))
    for name, samples in got.items():
        last = samples[-1]
        results[name] = {
            "wall_s": statistics.median(s["wall_s"] for s in samples),
            "import_s": statistics.median(s["import_s"] for s in samples),
            "maxrss_mib": statistics.median(s["maxrss_kib"] for s in samples) / 1024,
            "cuda_initialized": any(s["cuda_initialized"] for s in samples),
            "dist_initialized": any(s["dist_initialized"] for s in samples),
            "threads": last["threads"], "children": last["children"], "modules": last["modules"],
            "heavy": last["heavy"], "origin": last["origin"], "runs": runs}
    return results


def table(results: dict[str, dict]) -> str:
    head = ("| `import` | wall (process) | import alone | max RSS | modules | threads | children "
            "| CUDA initialised | process group | heavy modules loaded |")
    rows = [head, "|" + "---|" * 10]
    for name, r in results.items():
        rows.append(f"| {name} | {r['wall_s']:.2f} s | {r['import_s']:.2f} s | {r['maxrss_mib']:.0f} MiB "
                    f"| {r['modules']} | {r['threads']} | {r['children']} | {r['cuda_initialized']} "
                    f"| {r['dist_initialized']} | {', '.join(r['heavy']) or '-'} |")
    return "\n".join(rows)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--json", default=None, help="also write the medians here")
    args = ap.parse_args()
    load = os.getloadavg()[0]
    results = measure(args.runs)
    print(f"median of {args.runs} fresh processes each; load average {load:.1f} on {os.cpu_count()} cores")
    print(table(results))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"load_average": load, "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
