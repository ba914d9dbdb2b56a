"""The reducer's records of one backward: a unit's gradient buffers and progress (:class:`UnitGrads`) and a
group of small units reduced in one collective (:class:`SmallUnitGroup`). Owned by
:class:`~shardspeed.zero.reducer.GradientReducer`; nothing else reads them."""
from __future__ import annotations

from typing import List, Optional, Union

import torch

from ..comm.collectives import CommHandle
from .unit import FlatParamUnit


class UnitGrads:
    """Gradient buffers and progress of one unit within the current backward.

    Arrivals are counted per parameter: a parameter's gradient hook fires once per backward graph that uses
    it, so a parameter used in several reentrant-checkpointed segments reports several times. The unit is
    complete when every trainable parameter has arrived and, once learned from the first backward, as many
    times as then (``expected``); a gradient that arrives after its unit was sent goes into a fresh bucket
    and is reduced again at the end of the backward (reductions add up: every contribution counts once)."""

    __slots__ = ("unit", "bucket", "sending", "result", "launched", "dirty", "handle", "wire", "counts", "seen",
                 "arrivals", "expected", "round", "at_round", "round_tasks", "written")

    def __init__(self, unit: FlatParamUnit):
        self.unit = unit
        self.bucket: Optional[torch.Tensor] = None  # full-size, accum dtype: local sums not yet reduced
        # stages 2-3: the parameters whose gradient the bucket holds (the first one is copied in, not added to
        # zeros; the rest of the bucket is zeroed when it is sent); None: the bucket is all zeros or sums
        self.written: Optional[set] = None
        self.sending: Optional[torch.Tensor] = None  # a bucket whose reduction is in flight
        # the reduced, averaged gradient since the last step: chunk-sized (every_micro_step policy), else the
        # full-size buffer a reduction left its result in (only this rank's chunk of it is meaningful)
        self.result: Optional[torch.Tensor] = None
        self.launched = False
        self.dirty = False  # the bucket holds gradients not reduced yet
        self.handle: Optional[CommHandle] = None
        self.wire: Optional[torch.Tensor] = None  # the tensor sent, when the wire dtype differs
        self.counts = [0] * len(unit.params)  # arrivals per parameter in this backward
        self.seen = 0  # trainable parameters arrived at least once
        self.arrivals = 0
        self.expected: Optional[int] = None  # arrivals in a whole backward, learned from the first one
        self.round = 1  # stage 3 release tracking: arrivals of every parameter counted up to `round`
        self.at_round = 0
        self.round_tasks: set = set()  # autograd graph tasks the current round's arrivals came from

    def reset(self) -> None:
        self.launched = False
        self.counts = [0] * len(self.unit.params)
        self.seen = self.arrivals = self.at_round = 0
        self.round = 1
        self.round_tasks = set()

    def zero_unwritten(self, bucket: torch.Tensor) -> None:
        """Before ``bucket`` is sent: zero what no gradient was written into (parameters without one this
        backward, and the padding); nothing to do for a bucket that was zeroed when taken."""
        if self.written is None:
            return
        for i in range(len(self.unit.params)):
            if i not in self.written:
                self.unit.param_view(bucket, i).zero_()
        bucket[self.unit.layout.numel :].zero_()
        self.written = None

    @property
    def complete(self) -> bool:
        """Every trainable parameter has arrived, as often as a whole backward brings them."""
        return self.seen == len(self.unit.grad_params) and (self.expected is None or self.arrivals >= self.expected)


class SmallUnitGroup:
    """Small units reduced in one collective: each rank's chunks of every member side by side in ``wire``
    (rank r's row holds chunk r of each member, at ``offsets``)."""

    __slots__ = ("members", "offsets", "sizes", "wire", "handle")

    def __init__(self, members: List[UnitGrads], offsets: List[int], sizes: List[int], wire: torch.Tensor,
                 handle: CommHandle):
        self.members, self.offsets, self.sizes, self.wire, self.handle = members, offsets, sizes, wire, handle


def reduction_done(g: Union[UnitGrads, SmallUnitGroup]) -> bool:
    """Whether an in-flight reduction has finished (without waiting)."""
    assert g.handle is not None
    return g.handle.is_completed()
