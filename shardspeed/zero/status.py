"""DeepSpeed's per-parameter ZeRO-3 status, kept on stage-3 parameters for code written against DeepSpeed.

``p.ds_status`` is a :class:`ZeroParamStatus`: ``AVAILABLE`` while the parameter's unit is gathered (its
``.data`` is the whole tensor), ``INFLIGHT`` while the unit's all-gather runs, ``NOT_AVAILABLE`` while only
this rank's shard is held. :class:`~shardspeed.zero.unit.ShardedParamUnit` sets it at every transition, so
it is always the unit's state. TRL reads it to decide whether to gather an LM head it uses outside its
module (``maybe_gather_lm_head_ctx``).

``p.ds_active_sub_modules`` is DeepSpeed's set of modules whose forward is using the parameter. shardspeed
counts uses per unit (:class:`~shardspeed.zero.stage3.ParamManager`), not per parameter, so the set is
present and empty, as DeepSpeed's is outside a forward; TRL clears it before generating.
"""
from __future__ import annotations

from enum import Enum
from typing import Iterable

import torch


class ZeroParamStatus(Enum):
    """The values are DeepSpeed's (``deepspeed.runtime.zero.partition_parameters.ZeroParamStatus``)."""

    AVAILABLE = 1  # whole on this rank
    NOT_AVAILABLE = 2  # only this rank's shard is held
    INFLIGHT = 3  # being gathered


def set_status(params: Iterable[torch.Tensor], status: ZeroParamStatus) -> None:
    """Record ``status`` on each of ``params`` (their unit's state changed)."""
    for p in params:
        p.ds_status = status  # type: ignore[attr-defined]


def mark_stage3(params: Iterable[torch.Tensor], status: ZeroParamStatus) -> None:
    """A unit took ``params``: give them DeepSpeed's two per-parameter ZeRO-3 attributes."""
    for p in params:
        p.ds_status = status  # type: ignore[attr-defined]
        if not hasattr(p, "ds_active_sub_modules"):
            p.ds_active_sub_modules = set()  # type: ignore[attr-defined]
