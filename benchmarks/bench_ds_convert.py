"""Coming from DeepSpeed: time and peak extra memory of reading a DeepSpeed checkpoint, shardspeed beside
DeepSpeed, interleaved in one run.

    python benchmarks/bench_ds_convert.py                    # ~50M params, ZeRO 2, world 2, 2 rounds
    python benchmarks/bench_ds_convert.py --layers 24 --width 2048 --stage 3

DeepSpeed (``DS_ACCELERATOR=cpu``, torch's AdamW, gloo) trains one step of a stack of ``--layers`` Linear
layers and saves at ZeRO ``--stage``. Then, per round, in fresh processes:

- offline, one process: ``shardspeed convert`` (DeepSpeed → ours: weights and both Adam moments) against
  DeepSpeed's ``zero_to_fp32`` (``convert_zero_checkpoint_to_fp32_state_dict``: the fp32 weights only);
- online, ``torchrun`` world 2: shardspeed's ``engine.load_checkpoint`` of the DeepSpeed checkpoint against
  DeepSpeed's own ``load_checkpoint`` of it (worst rank).

Memory is the peak above the level just before the call, sampled every 5 ms: ``+RSS`` (all resident
pages, file-backed ones included: shardspeed reads DeepSpeed's files memory-mapped) and ``+anon``
(anonymous memory only, what the process itself allocated). ``MALLOC_MMAP_THRESHOLD_`` is fixed so freed
buffers go back to the system. Figures are from one run; on a shared box times are noisy, memory is not.
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
from typing import Dict, List

ENV = {"DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1", "MALLOC_MMAP_THRESHOLD_": "1048576"}


def _mem() -> Dict[str, int]:
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            k, _, v = line.partition(":")
            if k in ("VmRSS", "RssAnon"):
                out[k] = int(v.split()[0]) * 1024
    return out


class Peak:
    """Peak RSS and anonymous memory above the levels at entry, sampled by a thread."""

    def __enter__(self):
        self.base = _mem()
        self.peak = dict(self.base)
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)
        self._t.start()
        self.t0 = time.perf_counter()
        return self

    def _sample(self):
        for k, v in _mem().items():
            self.peak[k] = max(self.peak[k], v)

    def _run(self):
        while not self._stop.wait(0.005):
            self._sample()

    def __exit__(self, *exc):
        self.seconds = time.perf_counter() - self.t0
        self._stop.set()
        self._t.join()
        self._sample()
        self.row = {"s": self.seconds, "rss": self.peak["VmRSS"] - self.base["VmRSS"],
                    "anon": self.peak["RssAnon"] - self.base["RssAnon"]}


def _model(layers: int, width: int):
    import torch

    torch.manual_seed(0)
    return torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(layers)])


def _config(stage: int, world: int) -> dict:
    return {"train_batch_size": 2 * world, "train_micro_batch_size_per_gpu": 2,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "torch_adam": True}},
            "zero_optimization": {"stage": stage}}


def _init(backend: str):
    if backend == "deepspeed":
        import deepspeed

        deepspeed.init_distributed(dist_backend="gloo")
        import logging

        deepspeed.utils.logger.setLevel(logging.WARNING)
    else:
        from shardspeed import init_distributed

        init_distributed(backend="gloo")


def _engine(backend: str, args):
    import torch.distributed as dist

    model = _model(args.layers, args.width)
    cfg = _config(args.stage, dist.get_world_size())
    if backend == "deepspeed":
        import deepspeed

        return deepspeed.initialize(model=model, config=cfg, model_parameters=list(model.parameters()))[0]
    import shardspeed

    return shardspeed.initialize(model=model, config=cfg)[0]


def save_worker(args) -> None:
    import torch

    _init("deepspeed")
    engine = _engine("deepspeed", args)
    loss = engine(torch.randn(2, args.width)).float().pow(2).mean()
    engine.backward(loss)
    engine.step()
    engine.save_checkpoint(args.dir, tag="ds")


def load_worker(args) -> None:
    import torch.distributed as dist

    _init(args.worker)
    engine = _engine(args.worker, args)
    dist.barrier()
    with Peak() as p:
        engine.load_checkpoint(args.dir, tag="ds")
        dist.barrier()
    rows: List[object] = [None] * dist.get_world_size()
    dist.all_gather_object(rows, p.row)
    if dist.get_rank() == 0:
        with open(args.out, "w") as f:
            json.dump({"s": max(r["s"] for r in rows), "rss": max(r["rss"] for r in rows),
                       "anon": max(r["anon"] for r in rows)}, f)
    dist.destroy_process_group()


def offline_worker(args) -> None:
    if args.worker == "shardspeed-convert":
        from shardspeed.checkpoint.deepspeed_layout.to_ours import import_deepspeed

        with Peak() as p:
            import_deepspeed(args.dir, args.dst, tag="ds")
    else:
        from deepspeed.utils.zero_to_fp32 import convert_zero_checkpoint_to_fp32_state_dict

        with Peak() as p:
            convert_zero_checkpoint_to_fp32_state_dict(args.dir, args.dst, tag="ds")
    with open(args.out, "w") as f:
        json.dump(p.row, f)


def _run(cmd: List[str], out: str) -> Dict[str, float]:
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, **ENV, PYTHONPATH=os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")])))
    subprocess.run(cmd, check=True, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    with open(out) as f:
        return json.load(f)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--stage", type=int, default=2)
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--width", type=int, default=2048)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--results", default="benchmarks/results/ds_convert.json")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    p.add_argument("--dir", help=argparse.SUPPRESS)
    p.add_argument("--dst", help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker == "save":
        return save_worker(args)
    if args.worker in ("shardspeed", "deepspeed"):
        return load_worker(args)
    if args.worker:
        return offline_worker(args)
    me = os.path.abspath(__file__)
    common = ["--stage", str(args.stage), "--layers", str(args.layers), "--width", str(args.width)]
    tmp = tempfile.mkdtemp(prefix="bench-ds-convert-")
    ckpt, out = os.path.join(tmp, "ckpt"), os.path.join(tmp, "row.json")
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={args.world}", me]
    root = os.path.dirname(os.path.dirname(me))
    subprocess.run(torchrun + ["--worker", "save", "--dir", ckpt] + common, check=True, stdout=subprocess.DEVNULL,
                   stderr=subprocess.DEVNULL, env=dict(os.environ, **ENV, PYTHONPATH=root))
    size = sum(os.path.getsize(os.path.join(dp, f)) for dp, _, fs in os.walk(ckpt) for f in fs)
    systems = {"shardspeed convert": [sys.executable, me, "--worker", "shardspeed-convert"],
               "zero_to_fp32": [sys.executable, me, "--worker", "zero_to_fp32"],
               "shardspeed load": torchrun + ["--worker", "shardspeed"],
               "deepspeed load": torchrun + ["--worker", "deepspeed"]}
    rows: Dict[str, List[Dict[str, float]]] = {k: [] for k in systems}
    for _ in range(args.rounds):  # interleaved
        for name, cmd in systems.items():
            dst = os.path.join(tmp, "dst")
            rows[name].append(_run(cmd + ["--dir", ckpt, "--dst", dst, "--out", out] + common, out))
            shutil.rmtree(dst, ignore_errors=True)
    shutil.rmtree(tmp, ignore_errors=True)
    n = args.layers * (args.width * args.width + args.width)
    print(f"\nreading DeepSpeed's ZeRO-{args.stage} checkpoint of a {n / 1e6:.0f}M-parameter model (fp32, AdamW, "
          f"{size / 2**20:.0f} MB on disk, world {args.world}); the largest tensor is "
          f"{args.width * args.width * 4 / 2**20:.0f} MB; median of {args.rounds} interleaved rounds")
    print(f"{'system':<20}{'s':>8}{'+RSS MB':>10}{'+anon MB':>10}")
    summary = {}
    for name, rs in rows.items():
        med = {k: sorted(r[k] for r in rs)[len(rs) // 2] for k in ("s", "rss", "anon")}
        summary[name] = med
        print(f"{name:<20}{med['s']:>8.2f}{med['rss'] / 2**20:>10.0f}{med['anon'] / 2**20:>10.0f}")
    os.makedirs(os.path.dirname(args.results) or ".", exist_ok=True)
    with open(args.results, "w") as f:
        json.dump({"stage": args.stage, "world": args.world, "layers": args.layers, "width": args.width,
                   "bytes": size, "rounds": rows, "median": summary}, f, indent=1)


if __name__ == "__main__":
    main()
