"""Which live stage-3 root holds a parameter, for DeepSpeed's functions that take bare parameters
(``GatheredParameters``, ``gathered_for_compute``). The roots are kept, weakly, by the process's one holder
(:data:`shardspeed.mesh.current.CURRENT`): registered when built, gone when closed or collected."""
from __future__ import annotations

from typing import TYPE_CHECKING, Optional, Tuple

import torch

from ..mesh.current import CURRENT

if TYPE_CHECKING:
    from .owned_unit import OwnedUnit
    from .root import ZeroRoot



def unit_of(p: torch.Tensor) -> Optional[Tuple[OwnedUnit, ZeroRoot]]:
    """The stage-3 unit holding ``p`` and its root, or None for a parameter no live stage-3 root holds."""
    for root in list(CURRENT.roots):
        owned = root.unit_of(p)
        if owned is not None:
            return owned, root
    return None
