"""Stage 3's check that every rank gathers the same units, without a host sync per gather.

Ranks whose forward or backward took different modules (rank-dependent control flow) would issue
mismatched all-gathers, which gloo answers with an abort or garbage and NCCL with a hang. So before a batch
of all-gathers the parameter manager issues one tiny all-reduce of a fingerprint of the batch, on the same
group, asynchronously (:meth:`GatherAgreements.start`); the collectives run in issue order on every rank,
so the k-th agreement of each rank meets the k-th of the others. It is checked before any unit it covers
is used (:meth:`GatherAgreements.check_before_use`), and all are checked when a phase ends
(:meth:`GatherAgreements.check_all`): a divergence is a :class:`~shardspeed.errors.DistributedError` on every
rank naming the modules, before a mismatched gather's result is read. Checking at use rather than at launch
takes the sync point (and the wait for the slowest rank) off the launch, where it cost 3.5% of a stage-3
step on the suite's GPT.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Callable, Deque, List

import torch
import torch.distributed as dist

from ..comm.collectives import Collectives, CommHandle
from ..errors import DistributedError


@dataclass
class _Agreement:
    units: List[int]
    needed: int
    phase: str
    fingerprint: int
    handle: CommHandle  # its tensor: [max fp, max -fp, max needed, max -needed] once done


class GatherAgreements:
    """The agreements issued and not yet checked, oldest first. ``name_of(unit)`` names a unit's module
    for the error."""

    def __init__(self, comm: Collectives, name_of: Callable[[int], str]):
        self._comm = comm
        self._name_of = name_of
        self._pending: Deque[_Agreement] = deque()

    def start(self, units: List[int], needed: int, phase: str, device: torch.device) -> None:
        """Issue the agreement for the all-gathers of ``units`` about to start (for unit ``needed``)."""
        if self._comm.world == 1 or not units:
            return
        fp = 0
        for i in units:  # a fingerprint of the sequence, in 62 bits
            fp = (fp * 1_000_003 + i + 1) % (1 << 62)
        t = torch.tensor([fp, -fp, needed, -needed], dtype=torch.int64, device=device)
        handle = self._comm.all_reduce(t, op=dist.ReduceOp.MAX, async_op=True)
        self._pending.append(_Agreement(list(units), needed, phase, fp, handle))

    def check_before_use(self, unit: int) -> None:
        """Check every agreement up to the newest one covering ``unit`` (older ones finished long ago)."""
        last = None
        for k, a in enumerate(self._pending):
            if unit in a.units:
                last = k
        if last is not None:
            for _ in range(last + 1):
                self._check(self._pending.popleft())

    def check_all(self) -> None:
        while self._pending:
            self._check(self._pending.popleft())

    def _check(self, a: _Agreement) -> None:
        t = a.handle.wait()
        if int(t[0]) == a.fingerprint and int(t[1]) == -a.fingerprint:
            return
        self._pending.clear()
        lo, hi = -int(t[3]), int(t[2])
        other = hi if hi != a.needed else lo
        raise DistributedError(
            f"ZeRO stage 3: ranks diverged in the {a.phase}: this rank (data-parallel rank "
            f"{self._comm.topology.shard_rank}) needs the parameters of {self._name_of(a.needed)} (unit {a.needed}) "
            f"while other ranks need unit {other} ({self._name_of(other)}). Stage 3 gathers parameters "
            f"collectively, so every rank must run the same modules in the same order; rank-dependent control "
            f"flow (a module skipped on some ranks) needs stage 0-2, or make the choice the same on every rank "
            f"(e.g. decide it on rank 0 and broadcast it)."
        )
