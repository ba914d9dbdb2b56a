"""``GatheredParameters``: read (or edit on one rank) stage-3 parameters outside forward."""
from __future__ import annotations

from contextlib import contextmanager
from typing import Iterable, Optional, Union

import torch
import torch.nn as nn

from .unit import UnitState


def _units_of(params) -> list:
    if isinstance(params, (torch.Tensor, nn.Parameter)):
        params = [params]
    seen, out = set(), []
    for p in params:
        info = getattr(p, "_shardspeed_unit", None)
        if info is None:
            continue  # not a stage-3 parameter: already whole, nothing to gather
        unit, _, manager = info
        if unit.index not in seen:
            seen.add(unit.index)
            out.append((unit, manager))
    return out


@contextmanager
def GatheredParameters(params: Union[nn.Parameter, Iterable[nn.Parameter]], modifier_rank: Optional[int] = None,
                       fwd_module=None, enabled: bool = True):
    """Gather the units holding ``params`` for the body of the ``with`` block.

    With ``modifier_rank`` set, that rank's edits are broadcast to every rank on exit and written into
    the shards and the fp32 master weights (so the optimizer continues from the edited values).
    Parameters of stages 0-2 are always whole: the context then does nothing. Every rank must enter it.
    """
    units = _units_of(params) if enabled else []
    already = [u.state is UnitState.GATHERED for u, _ in units]
    for unit, manager in units:
        unit.gather(manager.comm)
    try:
        yield
    finally:
        for (unit, manager), was_gathered in zip(units, already):
            if modifier_rank is not None:
                manager.comm.broadcast(unit.full, modifier_rank)
                unit.write_shard(unit.full[slice(*unit.layout.chunk_range(unit.rank))])
                if manager.master is not None:
                    manager.master.refresh_from_shard(unit.index)
            if not was_gathered:
                unit.release()
