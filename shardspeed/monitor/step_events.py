"""The events the engine writes after every optimizer step (see docs/monitoring.md).

DeepSpeed's, at each accumulation boundary, keyed by ``global_samples`` after the step:
``Train/Samples/lr`` (after the schedule's step), ``Train/Samples/loss_scale`` (fp16 only) and, with
``wall_clock_breakdown``, ``Train/Samples/elapsed_time_ms_{forward,backward,backward_inner,
backward_allreduce,step}`` (milliseconds summed over the step's micro-batches). Then ours:
``train_loss`` (the name DeepSpeed's pipeline engine uses; its plain engine writes no loss) and the
additions below, each written only when it is known.
"""
from __future__ import annotations

import os
import time
from typing import Any, Dict, List, Optional

import torch

from .master import MonitorMaster
from .sink import Event
from .step_snapshot import StepSnapshot
from .timers import Timers

PREFIX = "Train/Samples/"
TIMER_EVENTS = ("forward", "backward", "backward_inner", "backward_allreduce", "step")


def host_rss_bytes() -> Optional[int]:
    """Resident set size of this process: /proc/self/statm, else psutil, else None."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError, AttributeError):
        pass
    try:
        import psutil  # type: ignore[import-untyped,import-not-found,unused-ignore]
    except ImportError:
        return None
    return int(psutil.Process().memory_info().rss)


def device_bytes(device: torch.device) -> Optional[int]:
    """Bytes the caching allocator holds in tensors on an accelerator; None on the CPU (see host RSS)."""
    if device.type == "cuda":
        return int(torch.cuda.memory_allocated(device))
    return None


class StepEvents:
    """Collects what one optimizer step's events need and writes them through a :class:`MonitorMaster`.

    Built by the builder when a monitor block is enabled; every rank has one (the train loss is averaged
    over the data-parallel group, a collective), only rank 0's master has sinks."""

    def __init__(self, master: MonitorMaster, *, collectives: Any, comms_logger: Any, device: torch.device,
                 world_size: int, write_loss_scale: bool, write_timers: bool):
        self.master = master
        self.collectives = collectives
        self.comms_logger = comms_logger
        self.device = device
        self.world_size = max(1, int(world_size))
        self.write_loss_scale = write_loss_scale
        self.write_timers = write_timers
        #: samples to tokens (``engine.set_tokens_per_sample``); None: no tokens_per_sec
        self.tokens_per_sample: Optional[float] = None
        #: training FLOPs (forward + backward) of one sample (``engine.set_flops_per_sample``); None: no tflops
        self.flops_per_sample: Optional[float] = None
        #: one device's peak FLOP/s in the training dtype (``engine.set_peak_flops``); None: no mfu
        self.peak_flops: Optional[float] = None
        self._loss_sum: Optional[torch.Tensor] = None
        self._loss_count = 0
        self._t_prev_step: Optional[float] = None
        self._comm_seen = self._comm_total()

    # ---- fed by the engine -------------------------------------------------------------------------
    def add_loss(self, loss: torch.Tensor) -> None:
        """A micro-batch's loss (as given to ``backward``): kept on the device, no host sync."""
        value = loss.detach().float()
        self._loss_sum = value if self._loss_sum is None else self._loss_sum + value
        self._loss_count += 1

    def _comm_total(self) -> float:
        return float(sum(s["msg_bytes"] for s in self.comms_logger.summary().values()))

    def _mean_loss(self) -> Optional[float]:
        """Mean micro-batch loss of this step over the data-parallel group (ranks that saw a loss); one
        all_reduce on every rank, every step."""
        mine = (self._loss_sum / self._loss_count) if self._loss_sum is not None else None
        self._loss_sum, self._loss_count = None, 0
        buf = torch.zeros(2, dtype=torch.float32, device=self.device)
        if mine is not None:
            buf[0] = mine
            buf[1] = 1.0
        if self.collectives.world > 1:
            self.collectives.all_reduce(buf)
        total, ranks = buf.tolist()
        return total / ranks if ranks > 0 else None

    # ---- after the optimizer step --------------------------------------------------------------------
    def after_step(self, done: StepSnapshot, timers: Timers) -> None:
        """Called by the engine on every rank after each optimizer step (the accumulation boundary)."""
        now = time.perf_counter()
        comm_now = self._comm_total()
        comm_delta = comm_now - self._comm_seen if comm_now >= self._comm_seen else comm_now  # logger reset
        loss = self._mean_loss()
        self._comm_seen = self._comm_total()  # the loss's own all_reduce is not counted in a step
        elapsed = None if self._t_prev_step is None else now - self._t_prev_step
        self._t_prev_step = now
        ms: Dict[str, float] = timers.take_step_ms() if self.write_timers else {}
        if not self.master.sinks:
            return
        step = int(done.samples)

        ds: List[Event] = [(PREFIX + "lr", float(done.lrs[0]), step)]
        if self.write_loss_scale:
            ds.append((PREFIX + "loss_scale", float(done.loss_scale), step))
        if self.write_timers:
            allreduce = ms.get("backward_allreduce", 0.0)
            ms["backward_inner"] = max(0.0, ms.get("backward", 0.0) - allreduce)
            ms["backward_allreduce"] = allreduce
            ds += [(PREFIX + f"elapsed_time_ms_{name}", float(ms.get(name, 0.0)), step) for name in TIMER_EVENTS]

        ours: List[Event] = []
        if loss is not None:
            ours.append((PREFIX + "train_loss", loss, step))
        if elapsed is not None and elapsed > 0:
            samples_per_sec = done.batch / elapsed
            ours.append((PREFIX + "samples_per_sec", samples_per_sec, step))
            if self.tokens_per_sample:
                ours.append((PREFIX + "tokens_per_sec", samples_per_sec * self.tokens_per_sample, step))
            if self.flops_per_sample:
                per_device = self.flops_per_sample * samples_per_sec / self.world_size
                ours.append((PREFIX + "tflops", per_device / 1e12, step))
                if self.peak_flops:
                    ours.append((PREFIX + "mfu", per_device / self.peak_flops, step))
        if done.grad_norm is not None:
            ours.append((PREFIX + "grad_norm", float(done.grad_norm), step))
        dev = device_bytes(self.device)
        if dev is not None:
            ours.append((PREFIX + "memory_device_bytes", dev, step))
        rss = host_rss_bytes()
        if rss is not None:
            ours.append((PREFIX + "memory_host_rss_bytes", rss, step))
        ours.append((PREFIX + "comm_bytes_per_step", int(comm_delta), step))
        self.master.write_events(ds + ours)
