"""Issue 27: what verifying NVMe swap reads costs: step time with the swap checksums on and off.

    python benchmarks/bench_nvme_checksum.py                      # 50M params, both layouts, 3 rounds: ~2 min
    python benchmarks/bench_nvme_checksum.py --size 100e6 --rounds 5 --layouts s2-onvme --batches 4,64

Each run is a fresh single-rank process (as ``bench_offload.py``): a bf16 MLP of about ``--size``
parameters (width 2048), AdamW, ``--batches`` rows per step, ``--steps`` timed steps after one warm-up, in
one of two layouts:

- ``s2-onvme``: ZeRO stage 2, ``offload_optimizer`` nvme (master and moments streamed from files);
- ``s3-pnvme``: ZeRO stage 3, ``offload_param`` nvme and ``offload_optimizer`` nvme (the parameter shards
  in a file as well).

``verify`` on/off is the environment variable ``SHARDSPEED_VERIFY_SWAP`` (an internal switch, not a config key), set
in the child before ``initialize``; the runs alternate on/off for ``--rounds`` rounds, and the table gives
the medians of all steps, and the median and quartiles of the on/off ratios round by round (the runs of one
round are adjacent in time, so the disk's drift hits both alike). The runs use one intra-op thread
(``--threads``): on a 2-core machine torch's OpenMP workers spin after each kernel and starve the store's I/O
threads, which made the runs without checksums up to 4x slower than those with them, and the comparison
meaningless. With 4 rows the step is mostly the offloaded optimizer's I/O. The swap files are read and
written with ``O_DIRECT`` where the file system allows it (:class:`shardspeed.offload.swap_io.SwapFile`), so
the I/O runs at the disk's speed; on a file system without it (tmpfs) the files sit in the page cache, I/O runs
at memory speed and the checksums cost their full CPU time (the numbers of record before O_DIRECT,
``nvme_checksum_s31``). As the difference of two noisy medians is only a few percent, the "on" runs also
time every checksum reduction (``swap_io._sum_blocks``, in whatever thread it runs: the store's reader and
writer threads, the parameter file's read-ahead thread, the training thread): ``checksum CPU s/step`` is its
CPU time (``time.thread_time``), the cost on a machine without idle cores; with idle cores the sums overlap
the transfers (each file's I/O thread moves one chunk while the caller sums another). A second table times candidate checksums over 64 MiB on one thread. JSON:
benchmarks/results/<tag>.json (default ``nvme_checksum``).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from benchmarks import bench_stage3_memory as s3m  # noqa: E402
from benchmarks.report import machine  # noqa: E402

LAYOUTS = ("s2-onvme", "s3-pnvme")


def _config(layout: str, nvme: str, sub_group: int, batch: int) -> dict:
    z: dict = {"stage": 2, "reduce_bucket_size": int(5e7), "sub_group_size": sub_group,
               "offload_optimizer": {"device": "nvme", "nvme_path": nvme, "buffer_count": 4}}
    if layout == "s3-pnvme":
        z.update(stage=3, stage3_param_persistence_threshold=0, offload_param={"device": "nvme", "nvme_path": nvme})
    return {"train_micro_batch_size_per_gpu": batch, "gradient_accumulation_steps": 1,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}}, "bf16": {"enabled": True},
            "zero_optimization": z}


def child(layout: str, verify: bool, size: float, steps: int, nvme: str, sub_group: int, batch: int) -> dict:
    import torch
    import torch.nn as nn

    import shardspeed
    from shardspeed.offload import store, swap_io

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(29500 + os.getpid() % 1000))
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    os.environ[store.VERIFY_SWAP_ENV] = "1" if verify else "0"
    spent = {"s": 0.0, "cpu_s": 0.0, "main_s": 0.0, "bytes": 0, "calls": 0}
    lock = threading.Lock()
    inner = swap_io._sum_blocks

    def timed(words, out):  # every checksum reduction, in whichever thread computes it
        t0, c0 = time.perf_counter(), time.thread_time()
        inner(words, out)
        with lock:
            spent["s"] += time.perf_counter() - t0
            spent["cpu_s"] += time.thread_time() - c0  # one intra-op thread: all of its CPU time is here
            spent["bytes"] += words.numel() * words.element_size()
            spent["calls"] += 1
            if threading.current_thread() is threading.main_thread():  # on the step's critical path
                spent["main_s"] += time.perf_counter() - t0

    swap_io._sum_blocks = timed  # looked up at each call (the optimizer store and the parameter file)
    width = 2048
    layers = max(1, round(size / (width * width + width)))
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(width, width) for _ in range(layers)])
    psi = sum(p.numel() for p in model.parameters())
    engine, *_ = shardspeed.initialize(model=model, config=_config(layout, nvme, sub_group, batch))
    x = torch.randn(batch, width)
    times = []
    for i in range(steps + 1):
        if i == 1:
            spent.update(s=0.0, cpu_s=0.0, main_s=0.0, bytes=0, calls=0)  # the warm-up step is not counted
        t0 = time.perf_counter()
        loss = engine(x).float().pow(2).mean()
        engine.backward(loss)
        engine.step()
        times.append(time.perf_counter() - t0)
    engine.master_weights.close()
    return {"layout": layout, "verify": verify, "psi": psi, "batch": batch, "step_s": times[1:],
            "checksum_s_per_step": spent["s"] / steps, "checksum_cpu_s_per_step": spent["cpu_s"] / steps,
            "checksum_bytes_per_step": spent["bytes"] / steps, "checksum_main_s_per_step": spent["main_s"] / steps,
            "checksum_calls_per_step": spent["calls"] / steps}


def checksum_speeds(mib: int = 64, reps: int = 5) -> dict:
    """GB/s of candidate checksums over ``mib`` MiB of random fp32 on one thread (median of ``reps``)."""
    import zlib

    import torch

    from shardspeed.offload.store import block_sums

    torch.set_num_threads(1)
    t = torch.randn(mib * 2**20 // 4)
    dst = torch.empty_like(t)
    view = t.numpy()
    fns = {"block_sums (int64 sum per 4 KiB, torch)": lambda: block_sums(t),
           "zlib.crc32": lambda: zlib.crc32(view), "zlib.adler32": lambda: zlib.adler32(view),
           "copy into a buffer (memcpy, for scale)": lambda: dst.copy_(t)}
    out = {}
    for name, fn in fns.items():
        fn()
        runs = []
        for _ in range(reps):
            t0 = time.perf_counter()
            fn()
            runs.append(time.perf_counter() - t0)
        out[name] = t.numel() * 4 / statistics.median(runs) / 1e9
    return out


def table(rows: dict) -> str:
    lines = ["| layout @ batch | Ψ | step s, verify off | step s, verify on | on / off | on / off by round: median "
             "[quartiles] | checksum CPU s/step | checksum CPU / step off | checksum wall s/step | of it on the training "
             "thread, / step off | checksummed GB/step |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for layout, r in rows.items():
        p = r["paired"]
        q = statistics.quantiles(p, n=4) if len(p) > 1 else [p[0], p[0], p[0]]
        lines.append(f"| {layout} | {r['psi'] / 1e6:.0f}M | {r['off_s']:.3f} | {r['on_s']:.3f} | {r['ratio']:.3f} | "
                     f"{statistics.median(p):.3f} [{q[0]:.3f}, {q[2]:.3f}] | "
                     f"{r['checksum_cpu_s']:.4f} | {100 * r['checksum_frac']:.1f}% | {r['checksum_s']:.4f} | "
                     f"{r['checksum_main_s']:.4f}, {100 * r['checksum_main_s'] / r['off_s']:.1f}% | "
                     f"{r['checksum_gb']:.2f} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--size", type=float, default=50e6)
    ap.add_argument("--layouts", default=",".join(LAYOUTS))
    ap.add_argument("--batches", default="4", help="rows per step, comma-separated (4: the step is mostly the "
                    "offloaded optimizer; more rows add forward/backward compute)")
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--sub-group-size", type=int, default=5_000_000)
    ap.add_argument("--threads", type=int, default=1, help="OMP_NUM_THREADS of the runs (intra-op threads)")
    ap.add_argument("--nvme-path", default=None)
    ap.add_argument("--tag", default="nvme_checksum")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        layout, verify, path = args.child.split(",", 2)
        layout, batch = layout.split("@")
        out = child(layout, verify == "1", args.size, args.steps, path, args.sub_group_size, int(batch))
        print("RESULT " + json.dumps(out))
        return 0
    t0 = time.time()
    meta = dict(machine(), command="python benchmarks/bench_nvme_checksum.py " + " ".join(
        argv if argv is not None else sys.argv[1:]))
    path = args.nvme_path or tempfile.mkdtemp(prefix="shardspeed-bench-nvme-")
    runs: dict = {}
    for rnd in range(args.rounds):
        for layout in [f"{lay}@{b}" for b in args.batches.split(",") for lay in args.layouts.split(",")]:
            for verify in ((True, False) if rnd % 2 else (False, True)):  # alternate which goes first
                cmd = [sys.executable, os.path.abspath(__file__), "--child", f"{layout},{int(verify)},{path}",
                       "--size", str(args.size), "--steps", str(args.steps), "--sub-group-size",
                       str(args.sub_group_size)]
                env = dict(os.environ, OMP_NUM_THREADS=str(args.threads), MKL_NUM_THREADS=str(args.threads))
                proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
                line = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
                if proc.returncode or not line:
                    print(proc.stdout[-2000:], proc.stderr[-4000:], file=sys.stderr)
                    return 1
                r = json.loads(line[0][7:])
                runs.setdefault(layout, {"on": [], "off": []})["on" if verify else "off"].append(r)
                print(f"  round {rnd}: {layout} verify {'on ' if verify else 'off'}: median step "
                      f"{statistics.median(r['step_s']):.3f}s, checksums {r['checksum_s_per_step']:.4f}s/step "
                      f"(CPU {r['checksum_cpu_s_per_step']:.4f}s)", flush=True)
    rows = {}
    for layout, rr in runs.items():
        on = statistics.median(s for r in rr["on"] for s in r["step_s"])
        off = statistics.median(s for r in rr["off"] for s in r["step_s"])
        ck = statistics.median(r["checksum_s_per_step"] for r in rr["on"])
        cpu = statistics.median(r["checksum_cpu_s_per_step"] for r in rr["on"])
        main = statistics.median(r.get("checksum_main_s_per_step", 0.0) for r in rr["on"])
        paired = sorted(statistics.median(a["step_s"]) / statistics.median(b["step_s"])  # round by round
                        for a, b in zip(rr["on"], rr["off"]))
        rows[layout] = {"psi": rr["on"][0]["psi"], "on_s": on, "off_s": off, "ratio": on / off, "checksum_s": ck,
                        "paired": paired,
                        "checksum_cpu_s": cpu, "checksum_frac": cpu / off, "checksum_main_s": main,
                        "checksum_gb": rr["on"][0]["checksum_bytes_per_step"] / 1e9, "runs": rr}
    speeds = checksum_speeds()
    text = table(rows) + "\n\n| checksum, 64 MiB, 1 thread | GB/s |\n|---|---|\n" + "\n".join(
        f"| {k} | {v:.2f} |" for k, v in speeds.items())
    meta["checksum_gb_per_s"] = speeds
    meta["sub_group_size"] = args.sub_group_size
    print(text)
    s3m.write_results(args.tag, meta, text, rows, t0)
    return 0


if __name__ == "__main__":
    sys.exit(main())
