"""What ZeRO records on a parameter, and the only code that sets it: zero.Init's tag and DeepSpeed's ``ds_*``
attributes.

``_shardspeed_init``: an :class:`~shardspeed.zero.init.InitShard`, set by ``zero.Init`` when it shards the
parameter (this rank's slice of it, as DeepSpeed's ``ds_tensor`` travels on its parameters); removed when
stage 3 takes the slice into a unit. The attribute name stays on the parameter (code outside shardspeed may
check ``hasattr(p, "_shardspeed_init")``); inside shardspeed every reader and writer goes through here.

``ds_status``, ``ds_shape``, ``ds_numel``, ``ds_id``, ``ds_active_sub_modules``: DeepSpeed's read-only
attributes, which TRL, peft and transformers read. Nothing on a parameter points at its unit or at what
gathers it: the root of a model's units finds a parameter's unit through a map it owns
(:meth:`~shardspeed.zero.root.ZeroRoot.unit_of`).
"""
from __future__ import annotations

from enum import Enum
from typing import TYPE_CHECKING, Iterable, Optional

import torch

if TYPE_CHECKING:
    from .init import InitShard

#: The attribute ``zero.Init`` sets.
INIT_TAG = "_shardspeed_init"


class ZeroParamStatus(Enum):
    """A ZeRO-3 parameter's ``ds_status`` (``deepspeed.runtime.zero.partition_parameters.ZeroParamStatus``):
    whole on this rank (``AVAILABLE``), only its shard here (``NOT_AVAILABLE``), or being gathered
    (``INFLIGHT``). The values are DeepSpeed's. TRL gathers the parameters that are not ``AVAILABLE``."""

    AVAILABLE = 1
    NOT_AVAILABLE = 2
    INFLIGHT = 3


def set_status(params: Iterable[torch.Tensor], status: ZeroParamStatus) -> None:
    """Record ``status`` on each of ``params`` (their unit's state changed: the unit sets it at every
    transition, INFLIGHT while its all-gather runs)."""
    for p in params:
        p.ds_status = status  # type: ignore[attr-defined]


def mark_stage3(params: Iterable[torch.Tensor], shapes: Iterable, status: ZeroParamStatus) -> None:
    """A unit took ``params`` (whole shapes ``shapes``): give them DeepSpeed's per-parameter ZeRO-3 attributes
    (:func:`set_ds_attributes`, ``ds_status``). shardspeed counts uses per unit, not per parameter, so
    ``ds_active_sub_modules`` is present and empty, as DeepSpeed's is outside a forward (TRL clears it before
    generating)."""
    for p, shape in zip(params, shapes):
        set_ds_attributes(p, shape)
        p.ds_status = status  # type: ignore[attr-defined]
        if not hasattr(p, "ds_active_sub_modules"):
            p.ds_active_sub_modules = set()  # type: ignore[attr-defined]


# ---- zero.Init's tag --------------------------------------------------------------------------------------

def init_shard_of(p: torch.Tensor) -> Optional[InitShard]:
    """This rank's slice of ``p`` when ``zero.Init`` sharded it (and no unit has taken it yet), else None."""
    return getattr(p, INIT_TAG, None)


def tag_init_shard(p: torch.Tensor, info: InitShard) -> None:
    """Record that ``zero.Init`` sharded ``p``: ``info`` holds this rank's slice."""
    setattr(p, INIT_TAG, info)
    set_ds_attributes(p, info.shape)
    set_status((p,), ZeroParamStatus.NOT_AVAILABLE)


def set_ds_attributes(p: torch.Tensor, shape) -> None:
    """DeepSpeed's read-only attributes of a partitioned parameter, which callers read instead of the
    placeholder's shape: ``ds_shape`` / ``ds_numel`` (peft's LoRA layers, the Hugging Face Trainer's parameter
    count) and ``ds_id`` (unique while the parameter lives). Kept when a unit takes the parameter;
    ``ds_status`` follows the gathers (:func:`set_status`)."""
    if getattr(p, "ds_shape", None) is None:
        p.ds_shape = torch.Size(shape)  # type: ignore[attr-defined]
        p.ds_numel = p.ds_shape.numel()  # type: ignore[attr-defined]
        p.ds_id = id(p)  # type: ignore[attr-defined]


def clear_init_shard(p: torch.Tensor) -> None:
    """Drop ``zero.Init``'s tag (a unit now holds the slice); nothing to do when ``p`` has none."""
    if hasattr(p, INIT_TAG):
        delattr(p, INIT_TAG)


# ---- stage 3's mark ---------------------------------------------------------------------------------------

def in_stage3_unit(p: torch.Tensor) -> bool:
    """A stage-3 unit holds ``p``: :func:`mark_stage3` gave it shardspeed's ``ds_status`` and
    ``ds_active_sub_modules`` (zero.Init sets only the first). Which unit, and which root gathers it, only the
    root knows (:meth:`~.root.ZeroRoot.unit_of`)."""
    return (isinstance(getattr(p, "ds_status", None), ZeroParamStatus) and hasattr(p, "ds_active_sub_modules")
            and init_shard_of(p) is None)


def is_sharded(p: torch.Tensor) -> bool:
    """True when ``p`` holds only a placeholder: sharded by ``zero.Init`` or by a stage-3 unit."""
    return init_shard_of(p) is not None or in_stage3_unit(p)
