"""The wire schedule of a root's gradient reductions: :class:`ReductionQueue`.

It decides when each :class:`~.owned_unit.OwnedUnit`'s filled bucket goes out and holds what is shared while
it does: the launch order, the bucket pool, the reductions in flight and their bound.

- Units are launched strictly in one fixed order, so every rank issues the same collectives in the same
  sequence even when gradient hooks fire in another order (unused parameters, data-dependent control flow).
  The order starts as the root's guess and is adopted from rank 0's first backward (one broadcast).
- Stages 2-3: units smaller than ``coalesce_numel`` are reduce-scattered together, in groups of about that
  size; finished reductions give their buckets back to the pool for the next unit of the same size.
- Bounds: at most ``max_buckets`` full-size buckets in flight, or (stage 3) ``max_alive_numel`` elements of
  buckets alive; past it, the oldest reduction is waited for before a new bucket is filled.

The root calls it at each event (a bucket needed, a unit complete, the end of a backward); it calls nothing
back.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple, Union

import torch

from ..comm.collectives import Collectives, CommHandle
from .owned_unit import OwnedUnit, ReduceOp, ReducePolicy


@dataclass
class SmallUnitGroup:
    """Small units reduced in one collective: rank r's row of ``wire`` holds chunk r of each member."""

    members: List[OwnedUnit]
    offsets: List[int]
    sizes: List[int]
    wire: torch.Tensor
    handle: CommHandle


Reduction = Union[OwnedUnit, SmallUnitGroup]


class ReductionQueue:
    """Launch order, bucket pool and in-flight reductions of one root's units."""

    def __init__(self, owned: Sequence[OwnedUnit], comm: Collectives, policy: ReducePolicy, *,
                 max_buckets: Optional[int] = None, coalesce_numel: int = 0, max_alive_numel: int = 0):
        self.owned = list(owned)
        self.comm = comm
        self.policy = policy
        self.world = comm.world
        self.divisor = float(self.world) / policy.summed_ranks  # the reduced sum is divided by this
        self.order: List[int] = [o.index for o in self.owned if o.unit.grad_params]
        self.order_learned = False
        self._completion: List[int] = []  # units in the order they completed in this backward
        self._next_launch = 0
        self._in_flight: List[Reduction] = []
        self.coalesce_numel = int(coalesce_numel) if policy.every_micro_step else 0
        self._small: List[OwnedUnit] = []  # launched (in order), waiting for their group to fill
        self._pool: Dict[int, List[torch.Tensor]] = {}  # spare stage 2-3 buckets by size
        self.max_buckets = max_buckets
        self.max_alive_numel = int(max_alive_numel)
        self.launch_log: List[Tuple[int, int]] = []  # (unit index, gradient hooks still to come in backward)
        self._hooks_to_come = 0

    def begin(self, guess: Optional[List[int]]) -> None:
        """A backward starts; ``guess``: the order it will likely complete units in (given until the order is
        learned)."""
        if guess is not None and not self.order_learned:  # the same guess on every rank
            self.order = [i for i in guess if self.owned[i].unit.grad_params]
        self._next_launch = 0
        self._hooks_to_come = sum(len(o.unit.grad_params) for o in self.owned)
        self.launch_log.clear()
        self._completion.clear()

    def fill(self, o: OwnedUnit) -> None:
        """Give ``o`` a bucket, within the bound. Stages 2-3 take a fresh one uninitialised (``o.written``
        says which parameters' views hold gradients); stages 0-1 keep one zeroed buffer summing micro-steps."""
        self._make_room(o.unit.layout.padded_numel)
        self._take(o)

    def _take(self, o: OwnedUnit) -> None:
        n = o.unit.layout.padded_numel
        free = self._pool.get(n)
        fresh = self.policy.every_micro_step
        if free:
            o.bucket = free.pop() if fresh else free.pop().zero_()
        else:
            o.bucket = (torch.empty if fresh else torch.zeros)(n, dtype=self.policy.accum_dtype, device=o.unit.device)
        o.written = set() if fresh else None

    def arrived(self, o: OwnedUnit, reduce_now: bool) -> None:
        """One gradient hook of ``o`` ran; launch what the fixed order allows once ``o`` is complete."""
        self._hooks_to_come -= 1
        if o.launched or not o.complete:
            return
        self._completion.append(o.index)
        if reduce_now:
            while self._next_launch < len(self.order) and self.owned[self.order[self._next_launch]].complete:
                self._launch(self.owned[self.order[self._next_launch]])
                self._next_launch += 1

    def _launch(self, o: OwnedUnit) -> None:
        if o.launched:
            return
        if o.bucket is None:  # no gradient this backward: zeros, so every rank issues the same collectives
            self._take(o)
        self.launch_log.append((o.index, self._hooks_to_come))
        o.take_bucket()
        n = o.unit.layout.padded_numel
        if (n < self.coalesce_numel and self.policy.op is ReduceOp.REDUCE_SCATTER and o.unit.comm is None
                and o.unit.wire_dtype is None):
            self._small.append(o)
            if sum(s.unit.layout.padded_numel for s in self._small) >= self.coalesce_numel:
                self._flush_small()
            return  # a larger unit may go first: every rank makes the same choices, so the sequence agrees
        o.launch(self.policy, o.comm)
        self._in_flight.append(o)
        self._bound_in_flight()

    def _flush_small(self) -> None:
        """Reduce the pending small units in one reduce-scatter (their buckets are copied and released)."""
        if not self._small:
            return
        group, self._small = self._small, []
        world, rank = self.world, group[0].unit.rank
        sizes = [o.unit.layout.padded_numel // world for o in group]
        dtype = group[0].sending.dtype if self.policy.grad_codec else self.policy.comm_dtype  # type: ignore[union-attr]
        wire = torch.empty(world, sum(sizes), dtype=dtype, device=group[0].unit.device)
        offsets, off = [], 0
        for o, c in zip(group, sizes):
            assert o.sending is not None
            wire[:, off : off + c].copy_(o.sending.view(world, c))
            self._recycle(o.sending)
            o.sending = None
            offsets.append(off)
            off += c
        if self.policy.predivide_factor != 1.0:
            wire.div_(self.policy.predivide_factor)
        handle = self.policy.reduce_scatter(self.comm, wire[rank], wire.view(-1))
        self._in_flight.append(SmallUnitGroup(group, offsets, sizes, wire, handle))
        self._bound_in_flight()

    def _bound_in_flight(self) -> None:
        self._reap()  # block only past the bound
        while self.max_buckets is not None and len(self._in_flight) > self.max_buckets:
            self._complete(self._in_flight.pop(0))

    def _recycle(self, t: torch.Tensor) -> None:
        """Keep a freed bucket for the next unit of its size (transformer blocks all match), within
        ``max_buckets`` buckets, or ``max_alive_numel`` elements (stage 3), alive."""
        if self.max_alive_numel:
            keep = self._alive_numel() + t.numel() <= self.max_alive_numel
        else:
            keep = len(self._in_flight) + sum(len(v) for v in self._pool.values()) < (self.max_buckets or 0)
        if keep:
            self._pool.setdefault(t.numel(), []).append(t)

    def _alive_numel(self) -> int:
        """Elements of the full-size buckets alive besides those being filled: in flight, and spare."""
        flying = sum(x.wire.numel() if isinstance(x, SmallUnitGroup) else x.unit.layout.padded_numel
                     for x in self._in_flight)
        return flying + sum(n * len(v) for n, v in self._pool.items())

    def _make_room(self, numel: int) -> None:
        """Before a new full-size bucket of ``numel`` elements is filled: finish the reductions done and, at
        the bound, wait for the oldest in flight (stage 3: one largest unit alive; a block's reduction then
        overlaps the next block's backward up to its first gradient, and its bucket is reused)."""
        self._reap()
        while self._in_flight and self._over_bound(numel):
            self._complete(self._in_flight.pop(0))
        if self.max_alive_numel and self._over_bound(numel):  # spares of other sizes hold the excess: free them
            for n in [n for n in self._pool if n != numel]:
                del self._pool[n]

    def _over_bound(self, numel: int) -> bool:
        if self.max_buckets is not None and len(self._in_flight) >= self.max_buckets:
            return True
        if not self.max_alive_numel:
            return False
        reused = numel if self._pool.get(numel) else 0
        return self._alive_numel() - reused + numel > self.max_alive_numel

    def _reap(self) -> None:
        """Stages 2-3: finish the reductions already done, without blocking (their buckets go to the pool)."""
        while self._in_flight and self.policy.every_micro_step and self._in_flight[0].handle.is_completed():  # type: ignore[union-attr]
            self._complete(self._in_flight.pop(0))

    def _complete(self, x: Reduction) -> None:
        """Wait for one reduction and average it into where the optimizer reads it."""
        if isinstance(x, OwnedUnit):
            freed = x.finish_reduce(self.policy, self.divisor)
            if freed is not None:
                self._recycle(freed)
            return
        x.handle.wait()
        row = x.wire[x.members[0].unit.rank]
        scale = self.policy.predivide_factor / self.divisor
        for o, off, c in zip(x.members, x.offsets, x.sizes):
            o.add_reduced(row[off : off + c], scale, self.policy.accum_dtype)

    def finish_backward(self) -> None:
        """The end of a backward that reduces: launch what is left, wait, and (once) learn the order."""
        self.launch_all_and_wait()
        if not self.order_learned:
            self._learn_order()

    def launch_all_and_wait(self, again: bool = False) -> None:
        """Launch, in the fixed order, every unit not sent yet, then every unit that received gradients after
        it was sent (the same units on every rank: they ran the same graph), and wait for all of them.
        ``again``: every unit holding unreduced gradients is sent (before the step)."""
        if again:
            self._next_launch = 0
            for o in self.owned:
                o.launched = False
        for ui in self.order[self._next_launch :]:
            self._launch(self.owned[ui])
        self._next_launch = len(self.order)
        self._flush_small()
        self._wait_in_flight()
        for o in [self.owned[ui] for ui in self.order if self.owned[ui].dirty]:
            o.launched = False
            self._launch(o)
        self._flush_small()
        self._wait_in_flight()
        self._pool.clear()  # spare buckets serve one backward; nothing full-size is kept between steps

    def _wait_in_flight(self) -> None:
        while self._in_flight:
            self._complete(self._in_flight.pop(0))

    def _learn_order(self) -> None:
        """Adopt the order in which units completed in the first backward, as rank 0 saw it (early units go
        while backward still runs; every rank issues the same collectives in the same sequence)."""
        self.order_learned = True
        seen = list(dict.fromkeys(self._completion))
        order = seen + [i for i in self.order if i not in seen]
        t = torch.tensor(order, dtype=torch.int64, device=self.owned[0].unit.device if self.owned else "cpu")
        if self.world > 1 and t.numel():
            self.comm.broadcast(t, 0)
        self.order = [int(i) for i in t.tolist()]

    def held_tensors(self) -> List[torch.Tensor]:
        """Spare buckets and coalesced groups in flight (the units' own buffers are theirs)."""
        out = [t for free in self._pool.values() for t in free]
        return out + [x.wire for x in self._in_flight if isinstance(x, SmallUnitGroup)]
