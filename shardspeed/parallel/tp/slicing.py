"""Where a tensor-parallel slice lies in the full tensor: pure arithmetic, no process group.

A weight is cut along one dimension ``dim`` into ``size`` parts, one per tensor-parallel rank. A fused
weight (GPT-2's ``c_attn``: q, k and v stacked along the output dimension) is first seen as ``blocks``
equal blocks along ``dim``, each cut into ``size`` parts; rank ``r`` holds part ``r`` of every block,
concatenated, so that it computes whole heads of q, k and v.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple

import torch

from ...errors import ConfigError


@dataclass(frozen=True)
class TPSlice:
    """The place of a rank's slice in the full tensor: ``full_shape`` cut along ``dim`` (``blocks`` fused
    blocks, each in ``size`` parts); this rank holds part ``rank``."""

    full_shape: Tuple[int, ...]
    dim: int
    blocks: int
    rank: int
    size: int

    def boxes(self) -> List[Tuple[List[int], List[int]]]:
        """``(offsets, lengths)`` in the full tensor of each contiguous piece of the local slice, in the order
        they are concatenated locally (one per fused block)."""
        block = self.full_shape[self.dim] // self.blocks
        part = block // self.size
        out = []
        for b in range(self.blocks):
            offsets = [0] * len(self.full_shape)
            lengths = list(self.full_shape)
            offsets[self.dim] = b * block + self.rank * part
            lengths[self.dim] = part
            out.append((offsets, lengths))
        return out

    @property
    def local_shape(self) -> Tuple[int, ...]:
        shape = list(self.full_shape)
        shape[self.dim] //= self.size
        return tuple(shape)


def check_divisible(layer: str, what: str, value: int, size: int) -> None:
    """A one-line error naming the layer and the sizes when ``size`` does not divide ``value``."""
    if value % size:
        raise ConfigError(f"tensor_parallel.autotp_size {size} does not divide {what} ({value}) of layer '{layer}'; "
                          f"choose a size that divides it (or leave the layer replicated with a "
                          f"partition_config 'skip' spec)")


def make_slice(layer: str, full_shape: Sequence[int], dim: int, blocks: int, rank: int, size: int) -> TPSlice:
    """The slice of rank ``rank``, after checking that the sizes divide (errors name the layer)."""
    n = int(full_shape[dim])
    if n % blocks:
        raise ConfigError(f"layer '{layer}': dimension {dim} of its weight {tuple(full_shape)} is not {blocks} equal "
                          f"fused blocks")
    what = f"dimension {dim} of its weight {tuple(full_shape)}" + (
        f" in each of its {blocks} fused blocks" if blocks > 1 else "")
    check_divisible(layer, what, n // blocks, size)
    return TPSlice(tuple(int(s) for s in full_shape), dim, blocks, rank, size)


def take(full: torch.Tensor, sl: TPSlice) -> torch.Tensor:
    """The local slice ``sl`` of ``full`` (a new contiguous tensor)."""
    parts = [full.narrow(sl.dim, off[sl.dim], ln[sl.dim]) for off, ln in sl.boxes()]
    return torch.cat(parts, dim=sl.dim).contiguous()


def assemble(locals_: Sequence[torch.Tensor], sl: TPSlice, device: Optional[torch.device] = None) -> torch.Tensor:
    """The full tensor from every rank's local slice (rank order); ``sl`` is any rank's slice description;
    ``device``: where the full tensor is made (default the CPU)."""
    full = torch.empty(sl.full_shape, dtype=locals_[0].dtype, device=device)
    for r, local in enumerate(locals_):
        mine = TPSlice(sl.full_shape, sl.dim, sl.blocks, r, sl.size)
        pieces = local.split(sl.full_shape[sl.dim] // sl.blocks // sl.size, dim=sl.dim)
        for (off, ln), piece in zip(mine.boxes(), pieces):
            full.narrow(sl.dim, off[sl.dim], ln[sl.dim]).copy_(piece)
    return full
