"""Host memory of offloaded training: with NVMe the peak RSS does not grow with the optimizer state.

    python benchmarks/bench_offload.py [--sizes 50e6 200e6] [--devices nvme cpu] [--nvme-path /tmp/x]

Each (size, device) runs in a fresh single-rank process: a bf16 MLP of about ``size`` parameters (width
4096, ZeRO stage 2, AdamW), a few training steps with ``offload_optimizer`` on ``device``. The peak RSS is
reset after ``initialize`` (``/proc/self/clear_refs``), so it covers the training steps only. The model
itself is in host memory on a CPU-only machine (bf16 parameters 2Ψ + bf16 gradients 2Ψ), so the table
also shows ``RSS − 4Ψ``: what offload adds. With ``nvme`` that is bounded by the streaming pool
(``buffer_count × 3 × sub_group_size × 4`` bytes plus two gradient tiles) whatever Ψ; with ``cpu`` it is
the fp32 master and both moments, 12Ψ.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))


def _vm(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    return 0


def child(size: float, device: str, nvme_path: str, steps: int, sub_group: int, buffer_count: int) -> dict:
    sys.path.insert(0, os.path.join(HERE, ".."))
    import torch
    import torch.nn as nn

    import shardspeed

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(29500 + os.getpid() % 1000))
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    width = 4096
    layers = max(1, round(size / (width * width + width)))
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(width, width) for _ in range(layers)])
    psi = sum(p.numel() for p in model.parameters())
    cfg = {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 1,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}},
        "bf16": {"enabled": True},
        "zero_optimization": {"stage": 2, "reduce_bucket_size": int(5e7), "sub_group_size": sub_group,
                              "offload_optimizer": {"device": device, "nvme_path": nvme_path,
                                                    "buffer_count": buffer_count}},
    }
    engine, *_ = shardspeed.initialize(model=model, config=cfg)
    x = torch.randn(4, width)
    import gc

    gc.collect()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset the peak RSS: measure the training steps only
    base = _vm("VmRSS")
    t0 = time.perf_counter()
    for _ in range(steps):
        loss = engine(x).float().pow(2).mean()
        engine.backward(loss)
        engine.step()
    dt = (time.perf_counter() - t0) / steps
    peak = _vm("VmHWM")
    held = engine.master_weights.held_bytes()
    files = held.get("nvme_files", 0)
    return {"psi": psi, "device": device, "peak_rss": peak, "rss_before_steps": base, "s_per_step": dt,
            "host_buffers": held.get("host_buffers", 0), "nvme_files": files,
            "offloaded_state_in_ram": held.get("offloaded_master", 0) + held.get("offloaded_optimizer", 0)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sizes", type=float, nargs="+", default=[50e6, 200e6])
    ap.add_argument("--devices", nargs="+", default=["nvme", "cpu"])
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--sub-group-size", type=int, default=5_000_000)
    ap.add_argument("--buffer-count", type=int, default=4)
    ap.add_argument("--nvme-path", default=None)
    ap.add_argument("--json", default=None)
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        size, device, path = args.child.split(",", 2)
        out = child(float(size), device, path, args.steps, args.sub_group_size, args.buffer_count)
        print("RESULT " + json.dumps(out))
        return 0
    path = args.nvme_path or tempfile.mkdtemp(prefix="shardspeed-bench-nvme-")
    rows = []
    for size in args.sizes:
        for device in args.devices:
            cmd = [sys.executable, os.path.abspath(__file__), "--child", f"{size},{device},{path}",
                   "--steps", str(args.steps), "--sub-group-size", str(args.sub_group_size),
                   "--buffer-count", str(args.buffer_count)]
            proc = subprocess.run(cmd, capture_output=True, text=True)
            line = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
            if proc.returncode or not line:
                print(proc.stdout[-2000:], proc.stderr[-4000:], file=sys.stderr)
                return 1
            rows.append(json.loads(line[0][7:]))
    gib = 2**30
    pool_bound = args.buffer_count * 3 * 4 * args.sub_group_size + 2 * 4 * args.sub_group_size
    print(f"stage 2, bf16, AdamW; sub_group_size {args.sub_group_size:,}, buffer_count {args.buffer_count}: "
          f"NVMe pool bound {pool_bound / gib:.3f} GiB")
    print("| Ψ (params) | device | peak RSS GiB | peak RSS − 4Ψ GiB | state in RAM GiB | host buffers GiB | "
          "files GiB | s/step |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['psi'] / 1e6:.0f}M | {r['device']} | {r['peak_rss'] / gib:.2f} | "
              f"{(r['peak_rss'] - 4 * r['psi']) / gib:.2f} | {r['offloaded_state_in_ram'] / gib:.2f} | "
              f"{r['host_buffers'] / gib:.3f} | {r['nvme_files'] / gib:.2f} | {r['s_per_step']:.2f} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
