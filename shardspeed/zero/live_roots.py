"""The stage-3 roots alive in this process, for DeepSpeed's functions that take bare parameters
(``GatheredParameters``, ``gathered_for_compute``): each asks the roots which one holds a parameter.

A root is registered when built and forgotten when it is closed or collected (a weak set)."""
from __future__ import annotations

import weakref
from typing import TYPE_CHECKING, Optional, Tuple

import torch

if TYPE_CHECKING:
    from .owned_unit import OwnedUnit
    from .root import ZeroRoot

ROOTS: weakref.WeakSet[ZeroRoot] = weakref.WeakSet()


def unit_of(p: torch.Tensor) -> Optional[Tuple[OwnedUnit, ZeroRoot]]:
    """The stage-3 unit holding ``p`` and its root, or None for a parameter no live stage-3 root holds."""
    for root in list(ROOTS):
        owned = root.unit_of(p)
        if owned is not None:
            return owned, root
    return None
