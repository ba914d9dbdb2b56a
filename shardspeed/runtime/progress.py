"""`engine.progress(...)`: a tqdm bar on global rank 0 showing loss, LR and samples/s.

The engine updates the bar's postfix after each optimizer step from its own counters (the last loss it
was given, the optimizer's LR, `global_samples`), and only when tqdm is about to redraw (at most every
`mininterval` seconds): reading the loss is then the only host sync it adds, none per micro-step.
"""
from __future__ import annotations

import time
import weakref
from typing import TYPE_CHECKING, Any, Iterable, Optional

from tqdm import tqdm

if TYPE_CHECKING:  # pragma: no cover
    from .engine import Engine


class EngineProgress(tqdm):
    """A tqdm bar tied to an engine. Without an iterable it counts optimizer steps (the engine advances
    it); with one it counts the iterable's items and the engine only refreshes the postfix."""

    def __init__(self, engine: Engine, iterable: Optional[Iterable] = None, *, count_steps: bool, **kwargs: Any):
        self._engine_ref = weakref.ref(engine)
        self._count_steps = count_steps
        self._t0 = time.perf_counter()
        self._samples0 = engine.global_samples
        self._postfix_time = 0.0
        super().__init__(iterable, **kwargs)

    def on_optimizer_step(self) -> None:
        """Called by the engine after each optimizer step."""
        if self.disable:
            return
        now = time.perf_counter()
        if now - self._postfix_time >= self.mininterval:
            self._postfix_time = now
            self.set_postfix(self.stats(now), refresh=not self._count_steps)
        if self._count_steps:
            self.update(1)

    def stats(self, now: Optional[float] = None) -> dict:
        """loss (the last one given to backward), lr (the first group's) and samples/s since the bar began."""
        engine = self._engine_ref()
        if engine is None:
            return {}
        now = time.perf_counter() if now is None else now
        loss = engine.last_loss
        lrs = engine.get_lr()
        rate = (engine.global_samples - self._samples0) / max(now - self._t0, 1e-9)
        return {"loss": f"{float(loss):.4f}" if loss is not None else "n/a",
                "lr": f"{lrs[0]:.3g}" if lrs else "n/a",
                "samples/s": f"{rate:.1f}"}

    def close(self) -> None:
        engine = self._engine_ref() if hasattr(self, "_engine_ref") else None
        if engine is not None:
            engine.detach_progress(self)
        super().close()


def make_progress(engine: Engine, iterable: Optional[Iterable] = None, total: Optional[int] = None,
                  desc: Optional[str] = "train", disable: Optional[bool] = None, **kwargs: Any) -> EngineProgress:
    """See :meth:`Engine.progress`."""
    if engine.global_rank != 0:
        disable = True  # tqdm's None (off when the output is not a TTY) still applies on rank 0
    bar = EngineProgress(engine, iterable, count_steps=iterable is None, total=total, desc=desc, disable=disable,
                         **kwargs)
    engine.attach_progress(bar)
    return bar


__all__ = ["EngineProgress", "make_progress"]
