"""Kill a saving process at a named point of the save, for the crash tests: ``install("point[=N][@rank]")``
replaces ``shardspeed.checkpoint.format.CRASH_HOOK`` in this process (call it in the worker, before the save).
``bytes=N``: the rank dies after writing N bytes of its own file; ``@rank``: only that rank dies."""
from __future__ import annotations

import os
import signal
from typing import Optional


class KillAt:
    def __init__(self, spec: str) -> None:
        spec, _, rank = spec.partition("@")
        self.point, _, count = spec.partition("=")
        self.rank = int(rank) if rank else None
        self.count = int(count) if count else None

    def _mine(self, rank: int) -> bool:
        return self.rank is None or self.rank == rank

    def at(self, point: str, rank: int) -> None:
        if point == self.point and self._mine(rank):
            os.kill(os.getpid(), signal.SIGKILL)

    def kill_after_bytes(self, rank: int) -> Optional[int]:
        return self.count if self.point == "bytes" and self._mine(rank) else None


def install(spec: str) -> None:
    from shardspeed.checkpoint import format

    format.CRASH_HOOK = KillAt(spec)
