"""The few-second probe of the link and the optimizer step: ``python -m shardspeed.autotune.bandwidth OUT``.

Run under torchrun at the job's world size (the tuner launches it like a trial). Every rank times
all-reduces of a small and a large message (latency, bus bandwidth); rank 0 also times an Adam step per
element on the training device and on the host (the offloaded step's kernel) and a device↔host copy,
then writes :class:`shardspeed.autotune.model.LinkProfile`'s fields as JSON to OUT.
"""
from __future__ import annotations

import json
import statistics
import sys
import time
from typing import Any, Callable, Dict

import torch
import torch.distributed as dist

from shardspeed.mesh.init import init_distributed, local_device, shutdown_distributed
from shardspeed.offload.cpu_adam import AdamHyper, adam_step

_SMALL, _LARGE = 1 << 10, 1 << 22  # elements (fp32): 4 KiB and 16 MiB


def _timed(fn: Callable[[], Any], device: torch.device, reps: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(reps):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def _fit_link(t_small: float, t_large: float, factor: float) -> Dict[str, float]:
    """Latency and bus bandwidth from the times of a small and a large message (``factor``: bytes each rank
    sends per byte of message, the ring's)."""
    return {"latency": t_small, "bandwidth": factor * (_LARGE - _SMALL) * 4 / max(t_large - t_small, 1e-9)}


def _collective(coll: Any, name: str, full: torch.Tensor, shard: torch.Tensor) -> Callable[[], Any]:
    if name == "all_gather":
        return lambda: coll.all_gather(full, shard)
    if name == "reduce_scatter":
        return lambda: coll.reduce_scatter(shard, full)
    return lambda: coll.all_reduce(full)


def probe_link(device: torch.device) -> Dict[str, float]:
    """Latency (s) and ring bus bandwidth (bytes/s) of each collective the engine uses, from a small and a
    large message: all-reduce (``latency_s``, ``bus_bandwidth``), all-gather and reduce-scatter into / out of
    one flat tensor (``all_gather_*``, ``reduce_scatter_*``: the stage 1-3 calls, which on some backends
    cost more than half an all-reduce)."""
    from shardspeed.comm.collectives import Collectives

    n = dist.get_world_size()
    if n == 1:
        return {"latency_s": 0.0, "bus_bandwidth": float("inf")}
    coll = Collectives.over(None)
    out: Dict[str, float] = {}
    for name, factor in (("all_reduce", 2.0), ("all_gather", 1.0), ("reduce_scatter", 1.0)):
        times = []
        for elems, reps in ((_SMALL, 20), (_LARGE, 5)):
            full = torch.ones(elems * n if name == "all_gather" else elems, device=device)
            shard = torch.ones(elems if name == "all_gather" else elems // n, device=device)
            times.append(_timed(_collective(coll, name, full, shard), device, reps))
        link = _fit_link(times[0], times[1], factor * (n - 1) / n)
        prefix = "" if name == "all_reduce" else name + "_"
        out[prefix + "latency_s"] = link["latency"]
        out[prefix + "bus_bandwidth"] = link["bandwidth"]
    return out


def probe_compute(device: torch.device, elems: int = 1 << 21) -> Dict[str, float]:
    """Seconds per element of an AdamW step on the device and on the host; device↔host copy bandwidth."""
    p = torch.zeros(elems, device=device)
    p.grad = torch.ones_like(p)
    opt = torch.optim.AdamW([p], lr=1e-3)
    dev = _timed(opt.step, device, 5) / elems
    h = AdamHyper(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0, decoupled=True)
    hp, hg, m, v = (torch.zeros(elems) for _ in range(4))
    step = torch.zeros((), dtype=torch.float32)
    host = _timed(lambda: adam_step(hp, hg, m, v, step.add_(1), h), torch.device("cpu"), 5) / elems
    dst = torch.empty(elems, pin_memory=device.type == "cuda")
    copy = elems * 4 / _timed(lambda: dst.copy_(p.detach()), device, 5)
    return {"adam_s_per_elem": dev, "host_adam_s_per_elem": host, "copy_bandwidth": copy}


def main(argv: list[str]) -> int:
    out = argv[0] if argv else "bandwidth.json"
    init_distributed()
    device = local_device()
    result = probe_link(device)
    if dist.get_rank() == 0:
        result.update(probe_compute(device))
        with open(out, "w") as f:
            json.dump(result, f)
    shutdown_distributed()  # rank 0 (the store's host under the trial launcher) leaves last
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
