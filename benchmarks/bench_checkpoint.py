"""Checkpoint save/load time and peak extra memory: shardspeed vs DeepSpeed, same model, stage, world.

    python benchmarks/bench_checkpoint.py                 # both backends, world 2, stage 2, ~201M params
    python benchmarks/bench_checkpoint.py --stage 3 --layers 6

The driver launches ``torchrun --nproc-per-node WORLD`` once per backend (gloo, CPU; DeepSpeed with
``DS_ACCELERATOR=cpu`` and torch's AdamW). Each rank builds the model (a stack of ``--layers`` Linear
layers of ``--width``), takes one optimizer step (so Adam's states exist), then times ``save_checkpoint``
and, in a fresh engine, ``load_checkpoint``. Memory is the peak RSS above the RSS just before the call,
sampled every 5 ms on each rank (the worst rank is reported). Results go to a table and a JSON file.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class PeakRSS:
    """Peak resident memory above the level at entry, sampled by a thread."""

    def __enter__(self):
        self.base = self.peak = _rss()
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)
        self._t.start()
        return self

    def _run(self):
        while not self._stop.wait(0.005):
            self.peak = max(self.peak, _rss())

    def __exit__(self, *exc):
        self._stop.set()
        self._t.join()
        self.peak = max(self.peak, _rss())
        self.extra = self.peak - self.base


def _model(layers: int, width: int):
    import torch

    torch.manual_seed(0)
    return torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(layers)])


def _config(stage: int, world: int) -> dict:
    return {"train_batch_size": 2 * world, "train_micro_batch_size_per_gpu": 2,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "torch_adam": True}},
            "zero_optimization": {"stage": stage, "stage3_gather_16bit_weights_on_model_save": True},
            "zero_allow_untested_optimizer": True}


def _engine(backend: str, args, world: int):
    import torch

    cfg = _config(args.stage, world)
    model = _model(args.layers, args.width)
    if backend == "deepspeed":
        import deepspeed

        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        cfg["optimizer"] = None
        del cfg["optimizer"]
        engine, *_ = deepspeed.initialize(model=model, optimizer=opt, config=cfg)
    else:
        import shardspeed

        cfg["optimizer"]["params"].pop("torch_adam")
        engine, *_ = shardspeed.initialize(model=model, config=cfg)
    return engine


def worker(args) -> None:
    import torch
    import torch.distributed as dist

    backend = args.worker
    if backend == "deepspeed":
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
        import deepspeed

        deepspeed.init_distributed(dist_backend="gloo")
    else:
        from shardspeed import init_distributed

        init_distributed(backend="gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    engine = _engine(backend, args, world)
    x = torch.randn(2, args.width)
    loss = engine(x).float().pow(2).mean()
    engine.backward(loss)
    engine.step()
    nparams = sum(p.numel() for p in _model(1, args.width).parameters()) * args.layers
    dist.barrier()
    with PeakRSS() as m_save:
        t0 = time.perf_counter()
        engine.save_checkpoint(args.dir, tag="bench")
        dist.barrier()
        t_save = time.perf_counter() - t0
    del engine
    import gc

    gc.collect()
    engine = _engine(backend, args, world)
    dist.barrier()
    with PeakRSS() as m_load:
        t0 = time.perf_counter()
        engine.load_checkpoint(args.dir, tag="bench")
        dist.barrier()
        t_load = time.perf_counter() - t0
    size = sum(os.path.getsize(os.path.join(dp, f)) for dp, _, fs in os.walk(os.path.join(args.dir, "bench")) for f in fs)
    row = {"rank": rank, "save_s": t_save, "load_s": t_load, "save_extra_rss": m_save.extra,
           "load_extra_rss": m_load.extra, "bytes": size, "params": nparams}
    rows = [None] * world
    dist.all_gather_object(rows, row)
    if rank == 0:
        with open(args.out, "w") as f:
            json.dump(rows, f)
    dist.destroy_process_group()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--stage", type=int, default=2)
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--width", type=int, default=4096)
    p.add_argument("--backends", default="shardspeed,deepspeed")
    p.add_argument("--results", default="benchmarks/results/checkpoint.json")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    p.add_argument("--dir", help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        return worker(args)
    results = {}
    for backend in args.backends.split(","):
        d = tempfile.mkdtemp(prefix=f"bench-ckpt-{backend}-")
        out = os.path.join(d, "result.json")
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={args.world}",
               os.path.abspath(__file__), "--worker", backend, "--dir", os.path.join(d, "ckpt"), "--out", out,
               "--stage", str(args.stage), "--layers", str(args.layers), "--width", str(args.width)]
        root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        env = dict(os.environ, DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1",
                   PYTHONPATH=os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")])))
        subprocess.run(cmd, check=True, env=env, stdout=subprocess.DEVNULL if backend == "deepspeed" else None)
        with open(out) as f:
            results[backend] = json.load(f)
        shutil.rmtree(d, ignore_errors=True)
    n = next(iter(results.values()))[0]["params"]
    print(f"\ncheckpoint of a {n / 1e6:.0f}M-parameter model (fp32, AdamW), ZeRO stage {args.stage}, world {args.world}, "
          f"gloo/CPU; memory = peak RSS above the level before the call, worst rank")
    print(f"{'backend':<12}{'save s':>9}{'load s':>9}{'save +RSS MB':>14}{'load +RSS MB':>14}{'on disk MB':>12}")
    for backend, rows in results.items():
        print(f"{backend:<12}{max(r['save_s'] for r in rows):>9.2f}{max(r['load_s'] for r in rows):>9.2f}"
              f"{max(r['save_extra_rss'] for r in rows) / 2**20:>14.0f}{max(r['load_extra_rss'] for r in rows) / 2**20:>14.0f}"
              f"{rows[0]['bytes'] / 2**20:>12.0f}")
    os.makedirs(os.path.dirname(args.results) or ".", exist_ok=True)
    with open(args.results, "w") as f:
        json.dump({"stage": args.stage, "world": args.world, "layers": args.layers, "width": args.width,
                   "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
