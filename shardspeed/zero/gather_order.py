"""The order a model's units are gathered in, recorded on the first step and replayed for prefetch.

:class:`GatherOrder` keeps, per phase (forward, backward), the sequence of first gathers of the first step
that used each phase, the position reached in the running phase, and the first training forward's sequence
of unit uses with repeats (a unit used again later in the forward, a tied LM head, stays gathered in
between). :meth:`GatherOrder.window` picks the units to all-gather ahead of a use: at most ``PREFETCH_UNITS``
units and the prefetch bucket's elements ahead, units already held ahead counting in it (the bucket is one
fixed buffer, as DeepSpeed's), within ``stage3_max_live_parameters``.
"""
from __future__ import annotations

from typing import Callable, Dict, List, Optional, Sequence

#: units all-gathered ahead of their use at most: with one collective stream, a deeper window overlaps no
#: more communication, it only holds more gathered parameters (DeepSpeed's default 5e7-element prefetch
#: bucket would otherwise keep several transformer blocks gathered)
PREFETCH_UNITS = 1

FORWARD, BACKWARD = "forward", "backward"


class GatherOrder:
    """The traced gather order per phase, and the running phase's position in it."""

    def __init__(self) -> None:
        self.phase = FORWARD
        self._trace: Dict[str, List[int]] = {}
        self._tracing: Dict[str, List[int]] = {FORWARD: [], BACKWARD: []}
        self._pos: Dict[str, int] = {FORWARD: 0, BACKWARD: 0}
        self.fwd_uses: List[int] = []  # unit uses in order (with repeats) of the first training forward
        self.recording_uses = True
        self.uses_seen = 0
        self.replan = False  # a forward found a unit read outside the modules that gather it: trace again
        self.invalid = False  # invalidate() ran and no forward has started recording again

    def begin(self, phase: str) -> None:
        self.phase = phase
        self._pos[phase] = 0
        if phase != FORWARD:
            return
        self.uses_seen = 0
        self.invalid = False
        if self.replan:  # the last forward read units its modules did not gather: trace this one afresh
            self.replan = False
            self._trace.pop(FORWARD, None)
            self._tracing[FORWARD] = []
            self.fwd_uses, self.recording_uses = [], True

    def invalidate(self) -> None:
        """Forget the recorded order: the next forward and backward record it afresh."""
        self._trace, self._tracing = {}, {FORWARD: [], BACKWARD: []}
        self.fwd_uses, self.recording_uses = [], True
        self.invalid = True

    def use(self, index: int) -> None:
        """A forward's module takes unit ``index``."""
        self.uses_seen += 1
        if self.recording_uses:
            self.fwd_uses.append(index)

    def used_again(self, index: int) -> bool:
        """The traced forward uses unit ``index`` again after the current use."""
        return not self.recording_uses and index in self.fwd_uses[self.uses_seen :]

    def record(self, index: int) -> None:
        tr = self._tracing.get(self.phase)
        if tr is not None and index not in tr:
            tr.append(index)

    def freeze(self) -> None:
        """End of a backward: the phases recorded so far become the plan."""
        for phase, tr in list(self._tracing.items()):
            if tr and phase not in self._trace:
                self._trace[phase] = list(tr)
        if FORWARD in self._trace and BACKWARD in self._trace:
            self._tracing = {}
        if self.fwd_uses:
            self.recording_uses = False  # the first training forward's sequence of unit uses is the plan
        self.phase = FORWARD

    def ahead(self) -> List[int]:
        """The traced units after the running phase's position."""
        order = self._trace.get(self.phase) or []
        return order[self._pos[self.phase] + 1 :]

    def backward_guess(self, count: int) -> List[int]:
        """The order a backward will likely finish units in, before one has: the reverse of the last forward's
        first uses, then the units not used."""
        used = list(reversed(self._tracing.get(FORWARD) or self._trace.get(FORWARD, [])))
        seen = set(used)
        return used + [i for i in range(count - 1, -1, -1) if i not in seen]

    def window(self, index: int, starting: Sequence[int], numel: Callable[[int], int],
               held: Callable[[int], bool], persistent: Callable[[int], bool], budget: int) -> List[int]:
        """The units to all-gather ahead of ``index`` (see the module docstring); ``starting`` are about to
        be gathered for it, ``budget`` the elements the window may still take."""
        order: Optional[List[int]] = self._trace.get(self.phase)
        if not order:
            return []
        try:
            pos = order.index(index, self._pos[self.phase])
        except ValueError:  # a use past its traced position (a tied weight used again): prefetch nothing
            return []
        self._pos[self.phase] = pos
        plan: List[int] = []
        ahead = 0
        for nxt in order[pos + 1 :]:
            is_held = held(nxt)
            if nxt in starting or nxt in plan or (is_held and persistent(nxt)):
                continue  # a persistent unit once gathered stays: not part of the window
            if ahead >= PREFETCH_UNITS or numel(nxt) > budget:
                break
            budget -= numel(nxt)
            ahead += 1
            if not is_held:
                plan.append(nxt)
        return plan
