"""Lightning's own DeepSpeed strategy, unpatched, on CUDA: ``Trainer(strategy="deepspeed_stage_2"|"deepspeed_stage_3",
accelerator="cuda")`` with ``import deepspeed`` resolving to shardspeed's package, beside the real DeepSpeed when
it is installed (the same script, tests/lightning_ds_fit.py, without ``--patch-cpu-check``).

    python benchmarks/device_lightning.py [--out DIR] [--devices N]

N: every visible GPU unless given (Lightning needs one GPU per rank; one GPU is a world-1 run). DIR: ``--out``,
else ``$OUT``, else a new temporary folder.

Prints one line per stage: the largest per-batch loss difference and fp32-weight difference against DeepSpeed
(or "no oracle" where DeepSpeed is not installed), and writes DIR/summary.json. Exit status 1 when a run fails or
a difference is above 1e-5 (fp32). The CPU test of the same comparison is tests/test_lightning_deepspeed.py.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "tests", "lightning_ds_fit.py")
sys.path.insert(0, ROOT)


def _run(name: str, out: str, pythonpath: str, devices: int) -> bool:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "PYTHONPATH")}
    if pythonpath:
        env["PYTHONPATH"] = pythonpath
    proc = subprocess.run([sys.executable, SCRIPT, os.path.join(out, name), "--devices", str(devices)], env=env,
                          capture_output=True, text=True, timeout=1200)
    if proc.returncode != 0:
        print(f"{name}: failed (exit {proc.returncode})\n{proc.stderr[-4000:]}", file=sys.stderr)
    return proc.returncode == 0


def _diffs(out: str, stage: int, devices: int) -> dict:
    def load(name: str, rank: int) -> dict:
        with open(os.path.join(out, name, f"s{stage}.rank{rank}.json")) as f:
            return json.load(f)

    loss = max(abs(a[2] - b[2]) for r in range(devices)
               for a, b in zip(load("ours", r)["rows"], load("real", r)["rows"]))
    ours, real = load("ours", 0)["fp32"], load("real", 0)["fp32"]
    weight = max(abs(a - b) for k in ours for a, b in zip(ours[k], real[k])) if sorted(ours) == sorted(real) else None
    return {"loss_max_diff": loss, "weight_max_diff": weight}


def main() -> int:
    import torch

    from shardspeed.compat import site_path

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None)
    parser.add_argument("--devices", type=int, default=torch.cuda.device_count())
    args = parser.parse_args()
    if args.devices < 1:
        print("device_lightning: no CUDA device", file=sys.stderr)
        return 1
    out = args.out or os.environ.get("OUT") or tempfile.mkdtemp(prefix="device-lightning-")
    ok = _run("ours", out, os.pathsep.join([site_path(), ROOT]), args.devices)
    oracle = importlib.util.find_spec("deepspeed") is not None
    ok = (_run("real", out, "", args.devices) if oracle else True) and ok
    summary: dict = {"devices": args.devices, "oracle": oracle, "ok": ok}
    for stage in (2, 3):
        if ok and oracle:
            summary[f"stage{stage}"] = d = _diffs(out, stage, args.devices)
            print(f"stage {stage}: loss max diff {d['loss_max_diff']:.3g}, fp32 weights max diff {d['weight_max_diff']}")
            ok = ok and d["loss_max_diff"] <= 1e-5 and d["weight_max_diff"] is not None and d["weight_max_diff"] <= 1e-5
        elif ok:
            print(f"stage {stage}: ran ({args.devices} GPUs); no oracle (DeepSpeed not installed)")
    summary["ok"] = ok
    with open(os.path.join(out, "summary.json"), "w") as f:
        json.dump(summary, f, indent=1)
    print(f"results in {out}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
