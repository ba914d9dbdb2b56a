"""A trial's profile window: the engine's side of autotuning (DeepSpeed's ``_autotuning_exit``).

With ``autotuning.enabled`` the builder hands the engine a :class:`ProfileWindow`; the engine calls
:meth:`ProfileWindow.after_step` after each optimizer step. The window times optimizer steps
``start_profile_step``..``end_profile_step`` (wall clock between step boundaries: forward, backward,
step and the script's own data loading, as the user will see it), then takes the peak memory of the
process, reduces both across ranks (max), writes the metrics as JSON on rank 0 and exits the process
(``SystemExit(0)``), as DeepSpeed's engine does.

Peak memory is the device's (CUDA allocator peak). On a CPU-only machine it is the process's peak RSS
counted from the engine's construction on (the kernel's high-water mark is reset then): the full model a
script builds before ``initialize`` is there at every stage and would hide what the stage saves. The
process's lifetime peak is reported too (``peak_rss``).
"""
from __future__ import annotations

import json
import logging
import os
import resource
import statistics
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

import torch
import torch.distributed as dist

from ..plan import BatchPlan, TrialPlan
from ..utils.safe_files import write_atomic

logger = logging.getLogger("shardspeed")


def peak_rss_bytes() -> int:
    """This process's peak resident set size (Linux reports KiB)."""
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024


def reset_peak_rss() -> bool:
    """Restart the kernel's peak-RSS count (VmHWM) from the current RSS (Linux /proc/self/clear_refs)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def proc_status_bytes(field: str) -> Optional[int]:
    """A ``kB`` field of ``/proc/self/status`` (``VmRSS``, ``VmHWM``, ...) in bytes; None where there is none."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def _vm_hwm() -> Optional[int]:
    return proc_status_bytes("VmHWM")


def peak_device_bytes(device: torch.device) -> int:
    """Peak memory of the training device: the CUDA allocator's peak; on CPU the peak RSS since the engine
    was built (VmHWM after :func:`reset_peak_rss`; the whole process's peak where /proc is missing)."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    return _vm_hwm() or peak_rss_bytes()


@dataclass
class ModelFacts:
    """What a trial learns about the model (written with the metrics, read by the cost model)."""

    num_params: int
    largest_unit: int  # elements of the largest ZeRO unit (stage 3 gathers one or two at a time)
    num_units: int
    expert_params: int = 0  # of num_params, this rank's experts (units over the expert-data group)
    ep_size: int = 1  # the ranks the experts are spread over


@dataclass
class ProfileWindow:
    """Times steps start..end, then writes ``metric_path`` (rank 0) and exits every rank."""

    start_step: int
    end_step: int
    metric_path: str
    train_batch_size: int
    micro_batch_size: int
    gradient_accumulation_steps: int
    facts: ModelFacts
    device: torch.device
    exit: bool = True  # False in tests: metrics written, process kept
    _last: Optional[float] = None
    _times: List[float] = field(default_factory=list)
    written: Optional[Dict[str, Any]] = None

    def after_step(self, global_steps: int, flops_per_step: Optional[int] = None) -> None:
        """Called once per optimizer step with the engine's step count (already incremented)."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # a host-device sync, only inside a trial
        now = time.perf_counter()
        if self._last is not None and self.start_step <= global_steps <= self.end_step:
            self._times.append(now - self._last)
        self._last = now
        if global_steps == self.end_step:
            self.written = self._finish(flops_per_step)
            if self.exit:
                self._exit()

    def _finish(self, flops_per_step: Optional[int]) -> Dict[str, Any]:
        step_s = statistics.median(self._times) if self._times else float("nan")
        peaks = torch.tensor([float(peak_device_bytes(self.device)), float(peak_rss_bytes()), step_s],
                             dtype=torch.float64)
        if dist.is_initialized():
            dist.all_reduce(peaks, op=dist.ReduceOp.MAX)  # the slowest and the fullest rank decide
        step_s = float(peaks[2])
        metrics: Dict[str, Any] = {
            "latency": step_s * 1000.0,  # ms per optimizer step, as DeepSpeed's
            "throughput": self.train_batch_size / step_s,  # samples/s
            "step_time_s": step_s,
            "step_times_s": self._times,
            "peak_memory": int(peaks[0]), "peak_rss": int(peaks[1]),
            "train_batch_size": self.train_batch_size, "micro_batch_size": self.micro_batch_size,
            "gradient_accumulation_steps": self.gradient_accumulation_steps,
            "num_params": self.facts.num_params, "largest_unit": self.facts.largest_unit,
            "num_units": self.facts.num_units, "expert_params": self.facts.expert_params,
            "ep_size": self.facts.ep_size,
        }
        if flops_per_step is not None:
            metrics["FLOPS_per_gpu"] = flops_per_step / step_s
        if not dist.is_initialized() or dist.get_rank() == 0:
            os.makedirs(os.path.dirname(os.path.abspath(self.metric_path)), exist_ok=True)
            write_atomic(self.metric_path, json.dumps(metrics).encode())  # the tuner never reads a torn file
            logger.info("autotuning: wrote metrics to %s", os.path.abspath(self.metric_path))
        return metrics

    def _exit(self) -> None:
        from shardspeed.mesh.init import shutdown_distributed

        shutdown_distributed()  # rank 0 (the store's host under the trial launcher) leaves last
        sys.stdout.flush()
        sys.stderr.flush()
        raise SystemExit(0)


def build_profile_window(trial: Optional[TrialPlan], batch: BatchPlan, units: List[Any],
                         device: torch.device) -> Optional[ProfileWindow]:
    """The window of an autotuning trial (the plan's ``report.trial``; None: not a trial, no window)."""
    if trial is None:
        return None
    sizes = [sum(int(torch.Size(s).numel()) for s in u.shapes) for u in units]
    experts = [u for u in units if getattr(u, "comm", None) is not None]  # over the expert-data group
    slices = [getattr(p, "tp_slice", None) for u in experts for p in u.params]
    facts = ModelFacts(num_params=sum(sizes), largest_unit=max(sizes, default=0), num_units=len(sizes),
                       expert_params=sum(int(torch.Size(s).numel()) for u in experts for s in u.shapes),
                       ep_size=max((sl.size for sl in slices if sl is not None), default=1))
    path = trial.metric_path or os.path.join(os.getcwd(), "autotuning_metric.json")
    if device.type == "cpu":
        reset_peak_rss()  # count what training holds, not the full model the script built before initialize
    return ProfileWindow(start_step=trial.start_step, end_step=trial.end_step, metric_path=path,
                         train_batch_size=batch.global_batch, micro_batch_size=batch.micro_batch,
                         gradient_accumulation_steps=batch.accumulation_steps, facts=facts, device=device)
