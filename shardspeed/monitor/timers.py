"""Wall-clock timers for ``wall_clock_breakdown`` (forward, backward, reduce, step)."""
from __future__ import annotations

import time
from collections import defaultdict
from contextlib import contextmanager
from typing import Dict

import torch


class Timers:
    """Accumulates seconds per name; synchronises CUDA around each span (a host sync point) when enabled."""

    def __init__(self, enabled: bool, device: torch.device):
        self.enabled = enabled
        self._sync = enabled and device.type == "cuda"
        self.totals: Dict[str, float] = defaultdict(float)
        self.counts: Dict[str, int] = defaultdict(int)
        self.step_totals: Dict[str, float] = defaultdict(float)  # since the last optimizer step (the monitors')

    @contextmanager
    def __call__(self, name: str):
        if not self.enabled:
            yield
            return
        if self._sync:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        try:
            yield
        finally:
            if self._sync:
                torch.cuda.synchronize()
            dt = time.perf_counter() - t0
            self.totals[name] += dt
            self.counts[name] += 1
            self.step_totals[name] += dt

    def report_and_reset(self) -> str:
        parts = [f"{k}: {1000 * v / max(1, self.counts[k]):.1f}ms" for k, v in self.totals.items()]
        self.totals.clear()
        self.counts.clear()
        return " | ".join(parts)

    def take_step_ms(self) -> Dict[str, float]:
        """Milliseconds per name since the previous call (the monitors call it once per optimizer step)."""
        out = {k: 1000.0 * v for k, v in self.step_totals.items()}
        self.step_totals.clear()
        return out
