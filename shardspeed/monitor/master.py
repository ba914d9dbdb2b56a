"""``MonitorMaster``: DeepSpeed's fan-out of events to every enabled sink, on global rank 0 only."""
from __future__ import annotations

import atexit
from typing import List, Sequence

from .sink import Event, Sink


class MonitorMaster:
    """``engine.monitor``: ``write_events([(name, value, samples)])`` sends events to the enabled sinks.

    ``enabled`` says whether any monitor block is enabled (the same on every rank); only global rank 0
    holds sinks, so calls on the other ranks write nothing (as DeepSpeed's)."""

    def __init__(self, sinks: Sequence[Sink] = (), enabled: bool = False):
        self.sinks: List[Sink] = list(sinks)
        self.enabled = bool(enabled)
        if self.sinks:
            atexit.register(self.close)

    def write_events(self, events: List[Event]) -> None:
        if not events:
            return
        for sink in self.sinks:
            sink.write_events(events)

    def close(self) -> None:
        sinks, self.sinks = self.sinks, []
        for sink in sinks:
            sink.close()
