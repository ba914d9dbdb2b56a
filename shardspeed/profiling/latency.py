"""Forward latency per module, from forward pre- and post-hooks (as DeepSpeed's profiler times modules)."""
from __future__ import annotations

import time
from typing import Any, Collection, Dict, List

import torch
import torch.nn as nn


class ModuleLatency:
    """Times each module's forwards (added up over calls) while attached; ``sync``: synchronise CUDA first."""

    def __init__(self) -> None:
        self.sync = False
        self._hooks: List[Any] = []
        self._t0: Dict[int, float] = {}
        self._duration: Dict[int, float] = {}

    def attach(self, model: nn.Module, ignored: Collection[type]) -> None:
        """Hook every module of ``model`` whose type is not in ``ignored``."""
        self.sync = any(p.is_cuda for p in model.parameters())
        for m in model.modules():
            if type(m) in ignored:
                continue
            self._hooks.append(m.register_forward_pre_hook(self._pre_hook))
            self._hooks.append(m.register_forward_hook(self._post_hook))

    def detach(self) -> None:
        """Remove the hooks; the durations stay until :meth:`clear`."""
        for h in self._hooks:
            h.remove()
        self._hooks.clear()

    def clear(self) -> None:
        self._duration.clear()
        self._t0.clear()

    def duration(self, m: nn.Module) -> float:
        """Seconds in ``m``'s forwards; a module never timed (e.g. a ModuleList) has its children's."""
        d = self._duration.get(id(m), 0.0)
        if d == 0:
            d = sum(self.duration(c) for c in m.children())
        return d

    def _now(self) -> float:
        if self.sync:
            torch.cuda.synchronize()
        return time.perf_counter()

    def _pre_hook(self, module: nn.Module, inputs) -> None:
        self._t0[id(module)] = self._now()

    def _post_hook(self, module: nn.Module, inputs, output) -> None:
        t0 = self._t0.pop(id(module), None)
        if t0 is not None:
            self._duration[id(module)] = self._duration.get(id(module), 0.0) + self._now() - t0
