"""Issue 12: the largest model on this machine. Train a GPT whose fp32 master weights and Adam states (12 bytes a
parameter) are larger than the machine's RAM: ZeRO stage 3, parameters and optimizer states in NVMe files,
activation checkpointing of every block, the model built under ``shardspeed.zero.Init`` (never whole).

    python benchmarks/bench_scale.py                   # 2.28B parameters (29 x 2560), 3 steps, world 1
    python benchmarks/bench_scale.py --layers 2 --embd 256 --heads 4   # a dry run of the same path, seconds

Prints the parameter count, peak RSS (VmHWM of each worker over the whole run, ``MALLOC_MMAP_THRESHOLD_=65536``),
the estimator's prediction for the same config, disk use of the NVMe directory, seconds per step and the losses
beside a small reference GPT trained on the same batch with the same config (without NVMe): both must be finite
and falling. The files are deleted at the end. JSON: benchmarks/results/scale.json.
"""
from __future__ import annotations

import argparse
import gc
import importlib
import json
import math
import os
import shutil
import subprocess
import sys
import time
import traceback
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from benchmarks.harness import (  # noqa: E402
    init_gloo,
    next_result,
    proc_status_kb,
    reset_peak_rss,
    spawn_workers,
    stop_workers,
    worker_setup,
)

GiB = 2**30


def ds_config(args, nvme: bool) -> dict[str, Any]:
    zero: dict[str, Any] = {"stage": 3, "sub_group_size": int(args.sub_group), "stage3_prefetch_bucket_size": int(1e8)}
    if nvme:
        zero["offload_param"] = {"device": "nvme", "nvme_path": args.nvme_path}
        zero["offload_optimizer"] = {"device": "nvme", "nvme_path": args.nvme_path, "buffer_count": 2}
    return {"train_micro_batch_size_per_gpu": args.micro_batch, "gradient_accumulation_steps": 1,
            "bf16": {"enabled": True}, "gradient_clipping": 1.0, "zero_optimization": zero,
            "optimizer": {"type": "AdamW", "params": {"lr": args.lr, "weight_decay": 0.0}}}


def du(path: str) -> int:
    """Bytes allocated on disk under ``path`` (what ``du -s`` counts: preallocated files in full)."""
    if not os.path.exists(path):
        return 0
    out = subprocess.run(["du", "-sb", "--apparent-size", path], capture_output=True, text=True)
    alloc = subprocess.run(["du", "-sB1", path], capture_output=True, text=True)
    return max(int(out.stdout.split()[0] or 0), int(alloc.stdout.split()[0] or 0))


def train(gpt_cfg, args, nvme: bool, rank: int, world: int) -> dict[str, Any]:
    import torch

    import shardspeed
    from shardspeed.checkpointing import checkpoint_blocks
    from shardspeed.models import GPT

    gen = torch.Generator().manual_seed(1234)  # one fixed batch, seen every step: the loss must fall
    x = torch.randint(0, gpt_cfg.vocab_size, (args.micro_batch, args.seq), generator=gen)
    y = torch.roll(x, -1, dims=1)
    gc.collect()
    base = proc_status_kb("VmRSS")
    reset_peak_rss()
    t0 = time.perf_counter()
    torch.manual_seed(0)
    with shardspeed.zero.Init(dtype=torch.bfloat16):
        model = GPT(gpt_cfg)
    checkpoint_blocks(model, policy="full")
    engine, *_ = shardspeed.initialize(model=model, config=ds_config(args, nvme))
    build_s = time.perf_counter() - t0
    n_params = sum(math.prod(s) for u in engine.master_weights.units for s in u.shapes)
    disk = {"after_build": du(args.nvme_path)} if nvme else {}
    losses, times = [], []
    for i in range(args.steps):
        t = time.perf_counter()
        loss = engine(x, y)
        engine.backward(loss)
        engine.step()
        losses.append(float(loss))
        times.append(time.perf_counter() - t)
        if nvme:
            disk[f"after_step{i + 1}"] = du(args.nvme_path)
        if rank == 0:
            print(f"  {'nvme' if nvme else 'ref '} step {i + 1}: loss {losses[-1]:.4f}, {times[-1]:.1f} s, "
                  f"RSS peak so far {proc_status_kb('VmHWM') / 2**20:.2f} GiB", flush=True)
    peak_kb = proc_status_kb("VmHWM")
    engine.master_weights.close()
    del engine, model
    gc.collect()
    return {"params": n_params, "losses": losses, "s_per_step": times, "build_s": build_s,
            "peak_rss_bytes": peak_kb * 1024, "base_rss_bytes": base * 1024, "disk": disk}


def _worker(args, rank: int, world: int, port: int, res_q) -> None:
    worker_setup(rank, world, port, threads=args.threads)
    try:
        init_gloo(rank, world)
        from shardspeed.models import GPTConfig

        big = GPTConfig(vocab_size=256, block_size=max(64, args.seq), n_layer=args.layers, n_head=args.heads,
                        n_embd=args.embd, dropout=0.0)
        small = GPTConfig(vocab_size=256, block_size=max(64, args.seq), n_layer=2, n_head=4, n_embd=128)
        ref = train(small, args, nvme=False, rank=rank, world=world)
        res_q.put((rank, "ref", ref))
        out = train(big, args, nvme=True, rank=rank, world=world)
        res_q.put((rank, "ok", out))
        import torch.distributed as dist

        dist.barrier()
        dist.destroy_process_group()
    except BaseException:
        res_q.put((rank, "error", traceback.format_exc()))


def predict(args, world: int) -> dict[str, Any]:
    from shardspeed.estimate import describe_gpt, estimate_peak
    from shardspeed.models import GPTConfig

    cfg = ds_config(args, nvme=True)
    gpt = GPTConfig(vocab_size=256, block_size=max(64, args.seq), n_layer=args.layers, n_head=args.heads,
                    n_embd=args.embd, dropout=0.0)
    spec = describe_gpt(gpt, cfg, micro_batch=args.micro_batch, seq_len=args.seq, checkpointing=True)
    est = estimate_peak(spec, cfg, world_size=world, zero_init=True, built_dtype=__import__("torch").bfloat16)
    return {"params": spec.num_params, "total": est.total, "device": est.device, "host": est.host, "nvme": est.nvme,
            "terms": est.terms, "startup": est.startup_device + est.startup_host}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=29)
    ap.add_argument("--embd", type=int, default=2560)
    ap.add_argument("--heads", type=int, default=20)
    ap.add_argument("--seq", type=int, default=32)
    ap.add_argument("--micro-batch", type=int, default=1)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--lr", type=float, default=2e-6,
                    help="higher rates overshoot on one batch at this width (docs/memory.md: 3e-4, 1e-4, 1e-5 did)")
    ap.add_argument("--sub-group", type=float, default=5e7, help="sub_group_size: elements per optimizer tile")
    ap.add_argument("--world", type=int, default=1)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--nvme-path", default="/tmp/shardspeed-scale")
    ap.add_argument("--tag", default="scale")
    args = ap.parse_args(argv)
    os.environ["MALLOC_MMAP_THRESHOLD_"] = "65536"
    os.makedirs(args.nvme_path, exist_ok=True)
    t0 = time.time()
    pred = predict(args, args.world)
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    print(f"GPT {args.layers} x {args.embd} ({args.heads} heads): {pred['params']:,} parameters; fp32 master + Adam "
          f"= {12 * pred['params'] / GiB:.1f} GiB against {ram / GiB:.1f} GiB of RAM; predicted peak "
          f"{pred['total'] / GiB:.2f} GiB per rank, files {pred['nvme'] / GiB:.1f} GiB per rank", flush=True)
    target = importlib.import_module("benchmarks.bench_scale")._worker
    procs, res_q = spawn_workers(target, args.world, lambda r, port, q: (args, r, args.world, port, q))
    got: dict[str, dict[int, Any]] = {"ref": {}, "ok": {}}
    try:
        deadline = time.monotonic() + 6 * 3600
        while len(got["ok"]) < args.world:
            rank, kind, payload = next_result(res_q, procs, "bench_scale", deadline)
            got[kind][rank] = payload
    finally:
        stop_workers(procs, 60)
        shutil.rmtree(args.nvme_path, ignore_errors=True)
    big, ref = got["ok"][0], got["ref"][0]
    peak = max(r["peak_rss_bytes"] for r in got["ok"].values())
    base = max(r["base_rss_bytes"] for r in got["ok"].values())
    disk = max(max(r["disk"].values()) for r in got["ok"].values()) * args.world
    finite = all(math.isfinite(v) for v in big["losses"])
    falling = finite and big["losses"][-1] < big["losses"][0]
    rows = [
        ("parameters", f"{big['params']:,}"),
        ("fp32 master + Adam (12 B/param)", f"{12 * big['params'] / GiB:.1f} GiB (RAM {ram / GiB:.1f} GiB)"),
        ("peak RSS per rank (VmHWM)", f"{peak / GiB:.2f} GiB ({(peak - base) / GiB:.2f} over the pre-build RSS)"),
        ("predicted peak per rank", f"{pred['total'] / GiB:.2f} GiB (start-up {pred['startup'] / GiB:.2f})"),
        ("disk use (all ranks, max)", f"{disk / GiB:.1f} GiB (predicted {args.world * pred['nvme'] / GiB:.1f})"),
        ("build s", f"{big['build_s']:.0f}"),
        ("s/step", ", ".join(f"{t:.0f}" for t in big["s_per_step"])),
        ("losses", ", ".join(f"{v:.4f}" for v in big["losses"]) + f" ({'finite, falling' if falling else 'NOT FALLING'})"),
        ("reference losses (2 x 128)", ", ".join(f"{v:.4f}" for v in ref["losses"])),
    ]
    width = max(len(k) for k, _ in rows)
    text = "\n".join(f"{k:<{width}}  {v}" for k, v in rows)
    print(text)
    os.makedirs(os.path.join(ROOT, "benchmarks", "results"), exist_ok=True)
    path = os.path.join(ROOT, "benchmarks", "results", f"{args.tag}.json")
    with open(path, "w") as f:
        json.dump({"args": vars(args), "prediction": pred, "big": got["ok"], "reference": got["ref"], "table": text,
                   "wall_s": time.time() - t0}, f, indent=1, default=float)
    print("wrote", os.path.relpath(path), f"({time.time() - t0:.0f}s); files under {args.nvme_path} removed")
    return 0 if falling else 1


if __name__ == "__main__":
    import signal

    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    sys.exit(main())
