"""`engine.progress(...)`: a tqdm bar on global rank 0 showing loss, LR and samples/s.

The engine owns a :class:`ProgressSlot` and hands it each optimizer step's
:class:`~shardspeed.monitor.step_snapshot.StepSnapshot`; the slot's bar updates its postfix from it only
when tqdm is about to redraw (at most every `mininterval` seconds): reading the loss is then the only host
sync it adds, none per micro-step. The bar never sees the engine; closing it empties the slot.
"""
from __future__ import annotations

import time
from typing import Any, Iterable, Optional

from tqdm import tqdm

from ..monitor.step_snapshot import StepSnapshot


class ProgressSlot:
    """The engine's place for its one bar: the last step's snapshot, and the bar told of each step."""

    def __init__(self) -> None:
        self.bar: Any = None  # anything with on_optimizer_step() (Engine.attach_progress's contract)
        self.last: Optional[StepSnapshot] = None

    def attach(self, bar: Any) -> None:
        self.bar = bar

    def detach(self, bar: Any) -> None:
        if self.bar is bar:
            self.bar = None

    def after_step(self, done: StepSnapshot) -> None:
        """Called by the engine after each optimizer step."""
        self.last = done
        if self.bar is not None:
            self.bar.on_optimizer_step()


class EngineProgress(tqdm):
    """A tqdm bar fed by a :class:`ProgressSlot`. Without an iterable it counts optimizer steps; with one it
    counts the iterable's items and the steps only refresh the postfix. ``samples0``: the engine's
    ``global_samples`` when the bar begins (its samples/s counts from there)."""

    def __init__(self, slot: ProgressSlot, samples0: int, iterable: Optional[Iterable] = None, *,
                 count_steps: bool, **kwargs: Any):
        self._slot = slot
        self._count_steps = count_steps
        self._t0 = time.perf_counter()
        self._samples0 = samples0
        self._postfix_time = 0.0
        super().__init__(iterable, **kwargs)

    def on_optimizer_step(self) -> None:
        """Called by the slot after each optimizer step."""
        if self.disable:
            return
        now = time.perf_counter()
        if now - self._postfix_time >= self.mininterval:
            self._postfix_time = now
            self.set_postfix(self.stats(now), refresh=not self._count_steps)
        if self._count_steps:
            self.update(1)

    def stats(self, now: Optional[float] = None) -> dict:
        """loss (the last one given to backward), lr (the first group's) and samples/s since the bar began,
        as of the last optimizer step; empty before one."""
        done = self._slot.last
        if done is None:
            return {}
        now = time.perf_counter() if now is None else now
        rate = (done.samples - self._samples0) / max(now - self._t0, 1e-9)
        return {"loss": f"{float(done.loss):.4f}" if done.loss is not None else "n/a",
                "lr": f"{done.lrs[0]:.3g}" if done.lrs else "n/a",
                "samples/s": f"{rate:.1f}"}

    def close(self) -> None:
        if hasattr(self, "_slot"):
            self._slot.detach(self)
        super().close()


def make_progress(slot: ProgressSlot, rank: int, samples0: int, iterable: Optional[Iterable] = None,
                  total: Optional[int] = None, desc: Optional[str] = "train", disable: Optional[bool] = None,
                  **kwargs: Any) -> EngineProgress:
    """See :meth:`Engine.progress`: a bar on global rank ``rank``, attached to ``slot``."""
    if rank != 0:
        disable = True  # tqdm's None (off when the output is not a TTY) still applies on rank 0
    bar = EngineProgress(slot, samples0, iterable, count_steps=iterable is None, total=total, desc=desc,
                         disable=disable, **kwargs)
    slot.attach(bar)
    return bar


__all__ = ["EngineProgress", "ProgressSlot", "make_progress"]
