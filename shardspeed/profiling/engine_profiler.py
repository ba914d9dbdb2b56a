"""The config's ``flops_profiler`` inside the engine: at ``profile_step`` (the engine's ``global_steps``
before that step's optimizer update, as DeepSpeed counts it) the forward and the backward of every
micro-batch run under the counter; after the optimizer step rank 0 prints DeepSpeed's report of the last
micro-batch's forward (DeepSpeed resets the profile at every forward of the step), with the step's
fwd/bwd/step latencies, and every rank keeps the FLOPs of the whole step (``Engine.flops_per_step``)."""
from __future__ import annotations

import time
from contextlib import contextmanager
from typing import Callable, Iterator, Optional

import torch
import torch.nn as nn

from .profiler import FlopsProfiler, RunInfo


class StepFlopsProfiler:
    """Profiles one training step of an engine's module; built by the builder from ``flops_profiler``."""

    def __init__(self, module: nn.Module, *, profile_step: int, module_depth: int = -1, top_modules: int = 1,
                 detailed: bool = True, output_file: Optional[str] = None, recompute_fwd_factor: float = 0.0,
                 param_numel: Optional[Callable[[nn.Parameter], int]] = None, device: Optional[torch.device] = None):
        self.profile_step = profile_step
        self.module_depth = module_depth
        self.top_modules = top_modules
        self.detailed = detailed
        self.output_file = output_file
        self.profiler = FlopsProfiler(module, recompute_fwd_factor=recompute_fwd_factor, param_numel=param_numel)
        self._sync = device is not None and device.type == "cuda"
        self._reset_step()
        #: FLOPs of one optimizer step on this rank (every micro-batch), once profiled: the forward as counted,
        #: the backward as counted (or DeepSpeed's 2× estimate when it ran outside engine.backward()), and
        #: the model FLOPs 3 × forward (the MFU convention: no recomputation).
        self.fwd_flops_per_step: Optional[int] = None
        self.bwd_flops_per_step: Optional[int] = None
        self.model_flops_per_step: Optional[int] = None
        self.bwd_measured = False

    def _reset_step(self) -> None:
        self._fwd_total = self._bwd_total = 0
        self._backwards = 0
        self._fwd_latency = self._bwd_latency = self._step_latency = 0.0

    def _now(self) -> float:
        if self._sync:
            torch.cuda.synchronize()
        return time.perf_counter()

    def active(self, global_steps: int) -> bool:
        return global_steps == self.profile_step

    @contextmanager
    def forward(self) -> Iterator[None]:
        self.profiler.start_profile()  # resets: the report shows the step's last micro-batch, as DeepSpeed's
        t0 = self._now()
        try:
            yield
        finally:
            self._fwd_latency = self._now() - t0
            self.profiler.stop_profile()
            self._fwd_total += self.profiler.get_total_flops()

    @contextmanager
    def backward(self) -> Iterator[None]:
        before = self.profiler.get_backward_flops()
        t0 = self._now()
        try:
            with self.profiler.count_backward():
                yield
        finally:
            self._bwd_latency = self._now() - t0
            self._bwd_total += self.profiler.get_backward_flops() - before
            self._backwards += 1

    @contextmanager
    def step(self) -> Iterator[None]:
        t0 = self._now()
        try:
            yield
        finally:
            self._step_latency = self._now() - t0

    def finish(self, *, report_step: int, rank: int, world_size: int, dp_size: int, mp_size: int,
               micro_batch_size: int) -> None:
        """After the profiled step's optimizer update: keep the step's FLOPs; rank 0 prints the report."""
        fwd = self._fwd_total
        if self._backwards:
            bwd, self.bwd_measured = self._bwd_total, True
        else:  # backward ran outside engine.backward(): DeepSpeed's estimate
            bwd = int((2 + self.profiler.recompute_fwd_factor) * fwd)
        self.fwd_flops_per_step, self.bwd_flops_per_step, self.model_flops_per_step = fwd, bwd, 3 * fwd
        if rank == 0 and self.profiler.started:
            run = RunInfo(world_size=world_size, dp_size=dp_size, mp_size=mp_size, micro_batch_size=micro_batch_size,
                          fwd_latency=self._fwd_latency, bwd_latency=self._bwd_latency,
                          step_latency=self._step_latency,
                          bwd_flops=self.profiler.get_backward_flops() if self._backwards else None)
            self.profiler.print_model_profile(profile_step=report_step, module_depth=self.module_depth,
                                              top_modules=self.top_modules, detailed=self.detailed,
                                              output_file=self.output_file, run=run)
        self.profiler.end_profile()
        self._reset_step()
