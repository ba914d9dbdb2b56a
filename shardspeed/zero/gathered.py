"""``GatheredParameters``: read (or edit on one rank) stage-3 parameters outside forward."""
from __future__ import annotations

from contextlib import contextmanager
from typing import Iterable, Optional, Union

import torch
import torch.nn as nn

from .live_roots import unit_of
from .tags import ZeroParamStatus, in_stage3_unit, init_shard_of, set_status
from .unit import UnitState


def _as_list(params) -> list:
    if isinstance(params, (torch.Tensor, nn.Parameter)):
        return [params]
    return list(params)


def _units_of(params) -> list:
    """(unit, root) of each stage-3 unit holding one of ``params``, once each."""
    seen, out = set(), []
    for p in params:
        found = unit_of(p)
        if found is None:
            continue  # not a stage-3 parameter: already whole, nothing to gather
        owned, root = found
        if id(owned) not in seen:
            seen.add(id(owned))
            out.append((owned.unit, root))
    return out


def _init_sharded(params) -> list:
    """Parameters built under ``zero.Init`` that no engine has taken yet (sharded one by one), once each."""
    seen, out = set(), []
    for p in params:
        if init_shard_of(p) is not None and id(p) not in seen and not in_stage3_unit(p):
            seen.add(id(p))
            out.append(p)
    return out


@contextmanager
def GatheredParameters(params: Union[nn.Parameter, Iterable[nn.Parameter]], modifier_rank: Optional[int] = None,
                       fwd_module=None, enabled: bool = True):
    """Gather the units holding ``params`` for the body of the ``with`` block.

    With ``modifier_rank`` set, that rank's edits are broadcast to every rank on exit and written into
    the shards and the fp32 master weights (so the optimizer continues from the edited values).
    Parameters built under ``zero.Init`` and not yet in an engine are gathered one by one the same way.
    Parameters of stages 0-2 are always whole: the context then does nothing. Every rank must enter it.
    """
    from .init import active_init

    params = _as_list(params) if enabled else []
    units = _units_of(params)
    loose = _init_sharded(params)
    ctx = active_init()
    if loose and ctx is not None:
        ctx._flush()  # a live whole copy of one of them goes back into its shard first
    already = [u.state is UnitState.GATHERED for u, _ in units]
    for unit, manager in units:
        unit.gather(unit.comm if unit.comm is not None else manager.comm)  # expert units: their expert-data group
    saved = []
    for p in loose:
        saved.append(p.data)
        with torch.no_grad():
            info = init_shard_of(p)
            assert info is not None
            full = info.gather_full()
            p.data = full.to(dtype=p.dtype, device=p.device) if p.data.numel() else full
            set_status((p,), ZeroParamStatus.AVAILABLE)
    try:
        yield
    finally:
        for (unit, manager), was_gathered in zip(units, already):
            if modifier_rank is not None:  # (an expert unit: that rank of its expert-data group)
                (unit.comm if unit.comm is not None else manager.comm).broadcast(unit.full, modifier_rank)
                unit.write_shard(unit.full[slice(*unit.layout.chunk_range(unit.rank))])
                manager.shard_written(unit.index)
            if not was_gathered:
                unit.release()
        for p, placeholder in zip(loose, saved):
            info = init_shard_of(p)
            assert info is not None
            if modifier_rank is not None:
                full = p.data.to(info.shard.dtype).contiguous()
                if info.collectives is not None and info.world > 1:
                    info.collectives.broadcast(full, modifier_rank)
                info.write_full(full)
            p.data = placeholder
            set_status((p,), ZeroParamStatus.NOT_AVAILABLE)


def _in_autograd() -> bool:
    """Autograd is running a backward (a custom function's backward, a recompute)."""
    return torch._C._current_graph_task_id() != -1


@contextmanager
def gathered_for_compute(params: Iterable[torch.Tensor], until_gradient: bool = False):
    """Stage-3 ``params`` whole for a computation that takes them as tensors, e.g. a tiled function
    (autograd records its inputs' shapes when it is applied, and its tiles call the parameters' modules
    many times). In a forward (or outside one) the units are gathered through their manager and held,
    reference-counted as a module's forward holds them, so those modules' hooks do not release them between
    tiles; released on exit unless something else holds them. ``until_gradient``: on a normal exit they stay
    gathered until the backward has their gradients instead (a function that computed its parameters'
    gradients in its forward hands them to autograd in its backward, where autograd needs the parameters
    whole to accumulate them, and no module of theirs runs to gather them). In a backward they are gathered
    as the backward's units (released when their gradients are in, or at its end). Stages 0-2: nothing to
    do. Every rank must enter it (the gathers are collective)."""
    units = _units_of(params)
    backward = _in_autograd()
    for unit, manager in units:
        if backward:
            manager.gather_for_backward([unit.index])
        else:
            manager.hold(unit.index)
    if backward:
        yield
        return
    keep = False
    try:
        yield
        keep = until_gradient
    finally:
        for unit, manager in units:
            if keep:
                manager.hold_until_gradient(unit.index)
            else:
                manager.unhold(unit.index)
