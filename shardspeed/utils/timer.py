"""``deepspeed.utils.timer.ThroughputTimer``: the engine's ``tput_timer`` (DeepSpeed-Chat calls its
``update_epoch_count()`` and reads ``avg_samples_per_sec()``).

It counts as DeepSpeed's does: ``start()`` at each forward, ``stop(global_step=...)`` at each ``step()``;
samples per second average over the optimizer steps after the first ``start_step`` of the run. It logs
nothing itself: the engine's ``steps_per_print`` line already reports throughput (shardspeed.runtime.reporting).
"""
from __future__ import annotations

import time
from typing import Any, Callable, Optional

from ..compat.alias import module_getattr


class ThroughputTimer:
    """Micro-step, optimizer-step and epoch counts, and the average samples per second."""

    def __init__(self, config: Any = None, batch_size: Optional[int] = None, start_step: int = 2,
                 steps_per_output: Optional[int] = None, monitor_memory: bool = False,
                 logging_fn: Optional[Callable[[str], None]] = None):
        self.config = config
        self.batch_size = 1 if batch_size is None else batch_size
        self.start_step, self.steps_per_output = start_step, steps_per_output
        self.monitor_memory, self.logging = monitor_memory, logging_fn
        self.epoch_count = self.micro_step_count = self.global_step_count = 0
        self.total_elapsed_time = self.step_elapsed_time = 0.0
        self.start_time = self.end_time = 0.0
        self.started = False

    def update_epoch_count(self) -> None:
        self.epoch_count += 1
        self.micro_step_count = 0

    def start(self) -> None:
        self.started = True
        if self.global_step_count >= self.start_step:
            self.start_time = time.time()

    def stop(self, global_step: bool = False, report_speed: bool = True) -> None:
        """End a micro-step (``global_step``: it ended an optimizer step). ``report_speed`` is accepted;
        nothing is printed (see the module's note)."""
        if not self.started:
            return
        self.started = False
        self.micro_step_count += 1
        if global_step:
            self.global_step_count += 1
        if self.start_time > 0:
            self.end_time = time.time()
            duration = self.end_time - self.start_time
            self.total_elapsed_time += duration
            self.step_elapsed_time += duration
            self.start_time = 0.0
            if global_step:
                self.step_elapsed_time = 0.0

    def avg_samples_per_sec(self) -> float:
        """Samples per second over the timed optimizer steps (DeepSpeed's formula); -inf before any."""
        timed_steps = self.global_step_count - self.start_step
        if timed_steps > 0 and self.total_elapsed_time > 0:
            return self.batch_size / (self.total_elapsed_time / timed_steps)
        return float("-inf")


__getattr__ = module_getattr(__name__)
