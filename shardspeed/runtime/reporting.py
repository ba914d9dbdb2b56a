"""What the engine reports after a step: the ``steps_per_print`` log line, the flops profiler's step, and
``memory_breakdown`` (bytes of model states counted from the tensors). Owned by the engine as one part."""
from __future__ import annotations

import logging
import time
from contextlib import nullcontext
from typing import TYPE_CHECKING, Any, ContextManager, Dict, List, Optional

import torch

from .parts import EngineParts

if TYPE_CHECKING:  # pragma: no cover
    from .engine import Engine

logger = logging.getLogger("shardspeed")


def memory_breakdown(parts: EngineParts, device: torch.device) -> Dict[str, int]:
    """See :meth:`Engine.memory_breakdown`."""
    params = host_params = 0
    seen = set()  # storages already counted (a stage 0-2 shard is a view of its unit's full buffer)
    for unit in parts.master.units:
        held = [(unit.full, False)] if unit.full is not None and unit.full.numel() else []
        shard = unit.placement.resident()  # None: the shard is in a file (not counted)
        if shard is not None:
            held.append((shard, not unit.placement.on_device))
        for t, on_host in held:
            key = t.untyped_storage().data_ptr()
            if key in seen:
                continue
            seen.add(key)
            if on_host:
                host_params += t.numel() * t.element_size()
            else:
                params += t.numel() * t.element_size()
    master = parts.master.held_bytes()
    out = {
        "parameters": params,
        "gradients": parts.zero.held_bytes(),
        "master_weights": master["master"],
        "optimizer_states": master["optimizer"],
    }
    out["total"] = sum(out.values())
    # held off the device (offload_param / offload_optimizer): not in "total"
    out["offloaded_parameters"] = host_params
    out["offloaded_master_weights"] = master.get("offloaded_master", 0)
    out["offloaded_optimizer_states"] = master.get("offloaded_optimizer", 0)
    if device.type == "cuda":
        out["allocator_peak"] = torch.cuda.max_memory_allocated(device)
        out["allocator_current"] = torch.cuda.memory_allocated(device)
    return out


class StepReport:
    """The log line every ``steps_per_print`` steps (rank 0) and the flops profiler around its step."""

    def __init__(self, parts: EngineParts):
        self._parts = parts
        self._t_last_print = time.perf_counter()
        self._samples_since_print = 0

    # ---- the log line ----------------------------------------------------------------------------------
    def after_step(self, engine: Engine, samples: int) -> None:
        """An optimizer step of ``samples`` samples ended (skipped or not): log it when it is time."""
        p = self._parts
        self._samples_since_print += samples
        every = p.steps_per_print
        if not every or engine.global_steps % every != 0 or engine.global_rank != 0:
            if p.wall_clock_breakdown and every and engine.global_steps % every == 0:
                engine.timers.report_and_reset()
            return
        now = time.perf_counter()
        rate = self._samples_since_print / max(now - self._t_last_print, 1e-9)
        self._t_last_print, self._samples_since_print = now, 0
        loss, norm = engine.last_loss, engine.get_global_grad_norm()
        lrs: List[str] = [f"{x:.3g}" for x in engine.get_lr()]
        logger.info("step=%d loss=%.4f lr=%s loss_scale=%g grad_norm=%s samples/s=%.1f", engine.global_steps,
                    float(loss) if loss is not None else float("nan"), lrs, engine.cur_scale,
                    f"{norm:.4f}" if norm is not None else "n/a", rate)
        if p.wall_clock_breakdown:
            logger.info("time per call: %s", engine.timers.report_and_reset())
        if p.memory_breakdown:
            logger.info("memory (bytes): %s", engine.memory_breakdown())
        if p.comms_logger.keep_records:
            logger.info("collectives so far:\n%s", p.comms_logger.table())

    # ---- the flops profiler (logic in shardspeed.profiling) ---------------------------------------------
    def flops_active(self, step: int) -> bool:
        prof = self._parts.flops_profiler
        return prof is not None and prof.active(step)

    def flops_scope(self, phase: str, step: int) -> ContextManager[Any]:
        """At the profiled step: the profiler's context for ``phase`` (forward, backward, step)."""
        return getattr(self._parts.flops_profiler, phase)() if self.flops_active(step) else nullcontext()

    def flops_report(self, engine: Engine) -> None:
        p = self._parts
        assert p.flops_profiler is not None
        topo = p.topology
        p.flops_profiler.finish(
            report_step=engine.global_steps, rank=engine.global_rank, world_size=torch.distributed.get_world_size(),
            dp_size=topo.dp_size, mp_size=topo.mp_size, micro_batch_size=p.micro_batch_size)
        per_step = engine.flops_per_step()
        if p.monitor is not None and per_step:  # the monitors can now write tflops (and mfu on a GPU)
            world = torch.distributed.get_world_size()
            engine.set_flops_per_sample(per_step * world / p.train_batch_size)
            engine.set_peak_flops(engine.peak_flops())

    def flops_per_step(self, measured: bool) -> Optional[int]:
        prof = self._parts.flops_profiler
        if prof is None or prof.model_flops_per_step is None:
            return None
        if not measured:
            return prof.model_flops_per_step
        return int(prof.fwd_flops_per_step or 0) + int(prof.bwd_flops_per_step or 0)
