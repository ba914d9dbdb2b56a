"""What the engine reports on its steps, one part per job, each called by the engine with what it reports
on: :class:`ModelStateBytes` (``memory_breakdown``), :class:`StepLog` (the ``steps_per_print`` line, a
skipped step's line) and :class:`StepFlops` (the flops profiler around its step). None of them sees the
engine: :func:`step_reports` builds them from the engine's parts, and the engine hands them a
:class:`~shardspeed.monitor.step_snapshot.StepSnapshot` after each step."""
from __future__ import annotations

import logging
import time
from contextlib import nullcontext
from typing import TYPE_CHECKING, Any, ContextManager, Dict, List, Optional, Tuple, Union

import torch

from ..comm.collectives import CommsLogger
from ..mesh.topology import Topology
from ..monitor.step_snapshot import StepSnapshot
from ..monitor.timers import Timers
from ..precision.loss_scaler import DynamicLossScaler, StaticLossScaler
from ..profiling.peak import peak_flops
from ..zero.master import MasterWeights
from ..zero.root import ZeroRoot
from .parts import EngineParts

if TYPE_CHECKING:  # pragma: no cover
    from ..monitor.step_events import StepEvents
    from ..profiling.engine_profiler import StepFlopsProfiler

logger = logging.getLogger("shardspeed")


class ModelStateBytes:
    """Bytes of model states this rank holds, counted from the tensors of the master weights and the units' root."""

    def __init__(self, master: MasterWeights, reducer: ZeroRoot, device: torch.device):
        self._master = master
        self._reducer = reducer
        self._device = device

    def _parameter_bytes(self) -> tuple:
        """(on the device, in host memory): each storage once (a stage 0-2 shard views its unit's buffer)."""
        on_device = on_host = 0
        seen = set()
        for unit in self._master.units:
            held = [(unit.full, False)] if unit.full is not None and unit.full.numel() else []
            shard = unit.placement.resident()  # None: the shard is in a file (not counted)
            if shard is not None:
                held.append((shard, not unit.placement.on_device))
            for t, host in held:
                key = t.untyped_storage().data_ptr()
                if key not in seen:
                    seen.add(key)
                    n = t.numel() * t.element_size()
                    on_host, on_device = (on_host + n, on_device) if host else (on_host, on_device + n)
        return on_device, on_host

    def count(self) -> Dict[str, int]:
        """See :meth:`Engine.memory_breakdown`."""
        params, host_params = self._parameter_bytes()
        master = self._master.held_bytes()
        out = {"parameters": params, "gradients": self._reducer.held_bytes(), "master_weights": master["master"],
               "optimizer_states": master["optimizer"]}
        out["total"] = sum(out.values())
        # held off the device (offload_param / offload_optimizer): not in "total"
        out["offloaded_parameters"] = host_params
        out["offloaded_master_weights"] = master.get("offloaded_master", 0)
        out["offloaded_optimizer_states"] = master.get("offloaded_optimizer", 0)
        if self._device.type == "cuda":
            out["allocator_peak"] = torch.cuda.max_memory_allocated(self._device)
            out["allocator_current"] = torch.cuda.memory_allocated(self._device)
        return out


class StepLog:
    """The log line every ``steps_per_print`` steps on global rank 0: loss, LR, loss scale, gradient norm,
    samples/s; then the timers (``timers``: given under ``wall_clock_breakdown``; reset on every rank), the
    model states' bytes (``memory``: given under ``memory_breakdown``) and the collectives' table."""

    def __init__(self, every: Optional[int], timers: Optional[Timers], comms_logger: CommsLogger,
                 memory: Optional[ModelStateBytes], rank: int):
        self._every = every
        self._timers = timers
        self._comms_logger = comms_logger
        self._memory = memory
        self._rank = rank  # global: only rank 0 writes the lines
        self._t_last_print = time.perf_counter()
        self._samples_since_print = 0

    def skipped(self, step: int, grad_norm: Any, skipped_so_far: int, scaler: Union[StaticLossScaler, DynamicLossScaler]
                ) -> None:
        """Step ``step`` was skipped (a gradient overflow, or a NaN/inf norm): one line on rank 0."""
        if self._rank != 0:
            return
        if scaler.dynamic:  # routine under fp16 loss scaling
            logger.info("step %d: gradient overflow, step skipped; loss scale now %g", step, scaler.scale)
        else:
            logger.warning("step %d: the global gradient norm is %s: step skipped on every rank (%d skipped so far), "
                           "the LR schedule holds. A NaN/inf loss or gradient on some rank, e.g. from bad data; set "
                           "bf16.check_grad_overflow false to apply such steps anyway.", step, grad_norm, skipped_so_far)

    def after_step(self, done: StepSnapshot) -> None:
        """An optimizer step ended (skipped or not): log it when it is time."""
        self._samples_since_print += done.batch
        every = self._every or 0
        due = every > 0 and done.step % every == 0
        if not due or self._rank != 0:
            if due and self._timers is not None:
                self._timers.report_and_reset()
            return
        now = time.perf_counter()
        rate = self._samples_since_print / max(now - self._t_last_print, 1e-9)
        self._t_last_print, self._samples_since_print = now, 0
        lrs: List[str] = [f"{x:.3g}" for x in done.lrs]
        norm = done.grad_norm
        logger.info("step=%d loss=%.4f lr=%s loss_scale=%g grad_norm=%s samples/s=%.1f", done.step,
                    float(done.loss) if done.loss is not None else float("nan"), lrs, done.loss_scale,
                    f"{norm:.4f}" if norm is not None else "n/a", rate)
        if self._timers is not None:
            logger.info("time per call: %s", self._timers.report_and_reset())
        if self._memory is not None:
            logger.info("memory (bytes): %s", self._memory.count())
        if self._comms_logger.keep_records:
            logger.info("collectives so far:\n%s", self._comms_logger.table())


class StepFlops:
    """The flops profiler at its step (logic in :mod:`shardspeed.profiling`): its context around forward,
    backward and step, its report after the step, and the FLOPs per step it then gives the monitors."""

    def __init__(self, profiler: Optional[StepFlopsProfiler], monitor: Optional[StepEvents], topology: Topology,
                 train_dtype: torch.dtype):
        self._profiler = profiler
        self._monitor = monitor
        self._topology = topology
        self._train_dtype = train_dtype

    def active(self, step: int) -> bool:
        return self._profiler is not None and self._profiler.active(step)

    def scope(self, phase: str, step: int) -> ContextManager[Any]:
        """At the profiled step: the profiler's context for ``phase`` (forward, backward, step)."""
        return getattr(self._profiler, phase)() if self.active(step) else nullcontext()

    def report(self, done: StepSnapshot, micro_batch_size: int) -> None:
        """After the profiled step: the profiler's report; the monitors can then write tflops (and mfu)."""
        assert self._profiler is not None
        topo, world = self._topology, torch.distributed.get_world_size()
        self._profiler.finish(report_step=done.step, rank=torch.distributed.get_rank(), world_size=world,
                              dp_size=topo.shard_size, mp_size=topo.pipe_model_size, micro_batch_size=micro_batch_size)
        per_step = self.per_step(measured=False)
        if self._monitor is not None and per_step:
            self._monitor.flops_per_sample = per_step * world / done.batch
            self._monitor.peak_flops = peak_flops(topo.device, self._train_dtype)

    def per_step(self, measured: bool) -> Optional[int]:
        """See :meth:`Engine.flops_per_step`."""
        prof = self._profiler
        if prof is None or prof.model_flops_per_step is None:
            return None
        if not measured:
            return prof.model_flops_per_step
        return int(prof.fwd_flops_per_step or 0) + int(prof.bwd_flops_per_step or 0)


def step_reports(parts: EngineParts) -> Tuple[ModelStateBytes, StepLog, StepFlops]:
    """The engine's reporting parts, built from its parts (the engine calls them; none holds the engine)."""
    memory = ModelStateBytes(parts.master, parts.zero, parts.topology.device)
    log = StepLog(parts.steps_per_print, parts.timers if parts.wall_clock_breakdown else None, parts.comms_logger,
                  memory if parts.memory_breakdown else None, torch.distributed.get_rank())
    return memory, log, StepFlops(parts.flops_profiler, parts.monitor, parts.topology, parts.train_dtype)
