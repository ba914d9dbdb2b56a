"""Full tensors from tensor-parallel slices (the 16-bit export of a tensor-parallel model)."""
from __future__ import annotations

from typing import Dict

import torch
import torch.nn as nn

from .comm import TPGroup
from .slicing import TPSlice, assemble


def tensor_parallel_slices(module: nn.Module) -> Dict[str, TPSlice]:
    """Every name (tied names too) of a parameter that holds a tensor-parallel slice, and its slice."""
    found = {n: getattr(p, "tp_slice", None) for n, p in module.named_parameters(remove_duplicate=False)}
    return {n: sl for n, sl in found.items() if sl is not None}


def gather_full(state: Dict[str, torch.Tensor], slices: Dict[str, TPSlice], group: TPGroup) -> Dict[str, torch.Tensor]:
    """``state`` with each sliced tensor replaced by the full one, all-gathered over the model group (a
    collective: every rank of the group calls it with the same names). Tied names share one full tensor."""
    out = dict(state)
    done: Dict[int, torch.Tensor] = {}
    for name in sorted(slices):
        local = state[name]
        if id(local) not in done:
            every = group.all_gather(local.unsqueeze(0), 0)
            done[id(local)] = assemble(list(every.unbind(0)), slices[name])
        out[name] = done[id(local)]
    return out
