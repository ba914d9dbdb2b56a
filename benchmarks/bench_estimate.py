"""Issue 12: the memory estimator's predicted per-rank peak against measured peak RSS.

    python benchmarks/bench_estimate.py            # stage {0,1,2,3} x micro-batch {1,2,4,8} x checkpointing
                                                   # on/off x optimizer offload on/off: 56 configs, 46 min
                                                   # on this shared 2-core box under load
    python benchmarks/bench_estimate.py --quick    # 15 configs, ~5 min
    python benchmarks/bench_estimate.py --from-json benchmarks/results/estimate.json   # predict again, no run

One group of ``--world`` (default 2) gloo processes runs every config in turn, each in a fresh engine on the
same GPT (``MODEL`` below, fp32, AdamW, dropout 0.1, sequence ``--seq``), two optimizer steps per config.
Checkpointing wraps each block's forward in ``torch.utils.checkpoint`` (non-reentrant). Offload is
``offload_optimizer: {"device": "cpu"}`` (on this CPU-only machine host and device are the same memory, so
the prediction compared is device + host).

Measured, per rank, as benchmarks/bench_stage3_memory.py does: ``MALLOC_MMAP_THRESHOLD_=65536`` (so freed
tensors go back to the system), ``VmHWM`` reset (``/proc/self/clear_refs``) just before the model is built;
the config's peak is that high-water mark at the end of its second step minus ``VmRSS`` just before the
build (the process's torch/gloo baseline, which no estimator of model memory predicts). Max over ranks.

Predicted: ``shardspeed.estimate.estimate_peak`` on a description of the same model built on the meta
device and activations calibrated by one traced forward on fake tensors (no memory), for the same config.
Error = predicted / measured - 1; the target is |error| <= 10% and never below -5% where the estimate says
the config fits. JSON: benchmarks/results/estimate[-quick].json.
"""
from __future__ import annotations

import argparse
import gc
import importlib
import json
import os
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

MiB = 2**20
MODEL = dict(vocab_size=256, block_size=1024, n_layer=4, n_head=6, n_embd=384, dropout=0.1)


def grid(quick: bool) -> list[dict[str, Any]]:
    stages = (0, 1, 2, 3)
    mbs = (1, 4) if quick else (1, 2, 4, 8)
    out = []
    for stage in stages:
        for offload in (False, True):
            if offload and (stage == 0 or (quick and stage in (1, 2))):
                continue
            for ckpt in (False, True):
                for mb in mbs:
                    if quick and (ckpt and mb == 1):
                        continue
                    out.append({"stage": stage, "offload": offload, "ckpt": ckpt, "mb": mb})
    return out


def ds_config(stage: int, mb: int, offload: bool, world: int) -> dict[str, Any]:
    zero: dict[str, Any] = {"stage": stage}
    if offload:
        zero["offload_optimizer"] = {"device": "cpu"}
    return {"train_batch_size": mb * world, "train_micro_batch_size_per_gpu": mb,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.01}},
            "gradient_clipping": 1.0, "zero_optimization": zero}


def _run_one(c: dict[str, Any], seq: int, steps: int, world: int, rank: int) -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    import shardspeed
    from shardspeed.models import GPT, GPTConfig

    gen = torch.Generator().manual_seed(1000 + rank)
    batches = [(torch.randint(0, MODEL["vocab_size"], (c["mb"], seq), generator=gen),
                torch.randint(0, MODEL["vocab_size"], (c["mb"], seq), generator=gen)) for _ in range(steps)]
    gc.collect()
    dist.barrier()
    base = proc_status_kb("VmRSS")
    reset_peak_rss()
    torch.manual_seed(0)
    model = GPT(GPTConfig(**MODEL))
    if c["ckpt"]:
        from shardspeed.checkpointing import checkpoint_blocks

        checkpoint_blocks(model, policy="full")
    engine, *_ = shardspeed.initialize(model=model, config=ds_config(c["stage"], c["mb"], c["offload"], world))
    build_peak = proc_status_kb("VmHWM")
    losses, t0 = [], time.perf_counter()
    for x, y in batches:
        loss = engine(x, y)
        engine.backward(loss)
        engine.step()
        losses.append(float(loss))
        del loss
    peak = proc_status_kb("VmHWM")
    breakdown = engine.memory_breakdown()
    engine.master_weights.close()
    del engine, model
    gc.collect()
    return {**c, "base_kb": base, "peak_kb": peak, "build_peak_kb": build_peak, "losses": losses,
            "s_per_step": (time.perf_counter() - t0) / steps, "breakdown": breakdown}


def _worker(configs: list[dict[str, Any]], seq: int, steps: int, rank: int, world: int, port: int, res_q) -> None:
    worker_setup(rank, world, port, threads=1)
    try:
        init_gloo(rank, world)
        import torch  # noqa: F401

        import shardspeed  # noqa: F401

        # one throw-away config first: the first engine in a process pays one-time costs (lazy kernels,
        # thread pools, gloo buffers) that no later config sees
        _run_one({"stage": 0, "offload": False, "ckpt": False, "mb": 1}, seq, 1, world, rank)
        for c in configs:
            res_q.put((rank, "ok", _run_one(c, seq, steps, world, rank)))
        import torch.distributed as dist

        dist.barrier()
        dist.destroy_process_group()
    except BaseException:
        res_q.put((rank, "error", traceback.format_exc()))


def measure(configs: list[dict[str, Any]], seq: int, steps: int, world: int, timeout: float) -> list[dict[str, Any]]:
    """Run ``configs`` on ``world`` fresh processes; per config the max over ranks of the peak over baseline."""
    target = importlib.import_module("benchmarks.bench_estimate")._worker
    procs, res_q = spawn_workers(target, world, lambda r, port, q: (configs, seq, steps, r, world, port, q))
    got: dict[int, list[dict[str, Any]]] = {r: [] for r in range(world)}
    deadline = time.monotonic() + timeout
    try:
        while any(len(v) < len(configs) for v in got.values()):
            rank, _, payload = next_result(res_q, procs, "bench_estimate", deadline)
            got[rank].append(payload)
            if all(len(v) > len(got[0]) - 1 for v in got.values()) and rank == world - 1:
                r = payload
                print(f"  measured stage {r['stage']} offload {int(r['offload'])} ckpt {int(r['ckpt'])} mb {r['mb']}: "
                      f"{(r['peak_kb'] - r['base_kb']) / 1024:.0f} MiB over baseline", flush=True)
    finally:
        stop_workers(procs, 30)
    out = []
    for i, c in enumerate(configs):
        reps = [got[r][i] for r in range(world)]
        out.append({**c, "measured_bytes": max((r["peak_kb"] - r["base_kb"]) * 1024 for r in reps),
                    "build_bytes": max((r["build_peak_kb"] - r["base_kb"]) * 1024 for r in reps),
                    "baseline_mib": max(r["base_kb"] for r in reps) / 1024, "losses": reps[0]["losses"],
                    "s_per_step": max(r["s_per_step"] for r in reps), "breakdown": reps[0]["breakdown"]})
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="a subset of 15 configs")
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--no-predict", action="store_true", help="measure only")
    ap.add_argument("--from-json", help="predict again for the measurements saved in this results file")
    args = ap.parse_args(argv)
    if args.from_json:
        with open(args.from_json) as f:
            saved = json.load(f)
        predict(saved["rows"], saved["seq"], saved["world"])
        print(table(saved["rows"], False))
        with open(args.from_json, "w") as f:
            json.dump(saved, f, indent=1, default=float)
        return 0
    os.environ["MALLOC_MMAP_THRESHOLD_"] = "65536"  # before any worker starts: glibc reads it once
    configs = grid(args.quick)
    print(f"GPT {MODEL}, seq {args.seq}, world {args.world}, fp32 AdamW, {len(configs)} configs", flush=True)
    t0 = time.time()
    rows = measure(configs, args.seq, args.steps, args.world, timeout=3600)
    if not args.no_predict:
        predict(rows, args.seq, args.world)
    print(table(rows, args.no_predict))
    os.makedirs(os.path.join(ROOT, "benchmarks", "results"), exist_ok=True)
    path = os.path.join(ROOT, "benchmarks", "results", "estimate-quick.json" if args.quick else "estimate.json")
    with open(path, "w") as f:
        json.dump({"model": MODEL, "seq": args.seq, "world": args.world, "wall_s": time.time() - t0, "rows": rows},
                  f, indent=1, default=float)
    print("wrote", os.path.relpath(path), f"({time.time() - t0:.0f}s)")
    return 0


def predict(rows: list[dict[str, Any]], seq: int, world: int) -> None:
    from shardspeed.estimate import describe_gpt, estimate_peak
    from shardspeed.models import GPTConfig

    for r in rows:
        cfg = ds_config(r["stage"], r["mb"], r["offload"], world)
        spec = describe_gpt(GPTConfig(**MODEL), cfg, micro_batch=r["mb"], seq_len=seq, checkpointing=r["ckpt"])
        est = estimate_peak(spec, cfg, world_size=world, checkpointing=r["ckpt"])
        r["predicted_bytes"] = est.total  # device and host are the same RAM here
        r["predicted"] = est.as_dict()
        r["error"] = r["predicted_bytes"] / r["measured_bytes"] - 1


def table(rows: list[dict[str, Any]], no_predict: bool) -> str:
    out = ["| stage | offload | ckpt | micro-batch | measured MiB | predicted MiB | error | s/step |",
           "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        pred = "–" if no_predict else f"{r['predicted_bytes'] / MiB:.0f}"
        err = "–" if no_predict else f"{100 * r['error']:+.1f}%"
        out.append(f"| {r['stage']} | {'cpu' if r['offload'] else '-'} | {'on' if r['ckpt'] else 'off'} | {r['mb']} "
                   f"| {r['measured_bytes'] / MiB:.0f} | {pred} | {err} | {r['s_per_step']:.2f} |")
    if not no_predict:
        errs = [r["error"] for r in rows]
        out.append(f"max |error| {100 * max(abs(e) for e in errs):.1f}%, worst under-prediction "
                   f"{100 * min(errs):+.1f}%, mean |error| {100 * sum(abs(e) for e in errs) / len(errs):.1f}%")
    return "\n".join(out)


if __name__ == "__main__":
    import signal

    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    sys.exit(main())
