"""Tensor-parallel slices in checkpoints: pure index arithmetic, no process group.

An entry of a tensor-parallel slice (format version 4) holds the flat range ``[start, end)`` of a rank's
*local slice* (``Entry.tp`` = ``[dim, blocks, rank, size]``: the :class:`~shardspeed.parallel.tp.slicing.TPSlice`
of the tensor's full shape). A reader at any other slicing (another TP degree, or none) maps each element
it wants to its index in the full tensor, then to the saved slice that holds it and the index there. Only
the cut dimension changes between the three, so the arithmetic is three integer divisions per element.
"""
from __future__ import annotations

import math
from typing import Iterator, List, Optional, Sequence, Tuple

import torch

from ..errors import CheckpointError
from ..parallel.tp.slicing import TPSlice

Spec = Optional[Tuple[int, int, int, int]]  # (dim, blocks, rank, size), None: the whole tensor


def spec_of(sl: Optional[TPSlice]) -> Spec:
    return None if sl is None else (sl.dim, sl.blocks, sl.rank, sl.size)


def _geometry(shape: Sequence[int], dim: int) -> Tuple[int, int]:
    """(elements per index of ``dim``, elements per index of the dimension outside it) of ``shape``."""
    inner = math.prod(int(s) for s in shape[dim + 1 :])
    return inner, inner * int(shape[dim])


def local_to_full(shape: Sequence[int], spec: Spec, idx: torch.Tensor) -> torch.Tensor:
    """Flat indices ``idx`` of the local slice ``spec`` of a tensor of ``shape`` → flat indices of the full
    tensor."""
    if spec is None:
        return idx
    dim, blocks, rank, size = spec
    block = int(shape[dim]) // blocks
    part = block // size
    local = list(shape)
    local[dim] = int(shape[dim]) // size
    inner, outer = _geometry(local, dim)
    o, c, i = idx // outer, (idx // inner) % local[dim], idx % inner
    full_c = (c // part) * block + rank * part + c % part
    f_inner, f_outer = _geometry(shape, dim)
    return o * f_outer + full_c * f_inner + i


def full_to_local(shape: Sequence[int], spec: Spec, full: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """(mask of the elements that slice ``spec`` holds, their flat index in that local slice) for flat
    indices ``full`` of a tensor of ``shape``."""
    if spec is None:
        return torch.ones_like(full, dtype=torch.bool), full
    dim, blocks, rank, size = spec
    block = int(shape[dim]) // blocks
    part = block // size
    inner, outer = _geometry(shape, dim)
    o, c, i = full // outer, (full // inner) % int(shape[dim]), full % inner
    b, w = c // block, c % block
    mask = (w // part) == rank
    local_n = int(shape[dim]) // size
    local = (b * part + w % part)
    return mask, o * (inner * local_n) + local * inner + i


def local_box_to_full(shape: Sequence[int], spec: Spec, offsets: List[int],
                      lengths: List[int]) -> Optional[Tuple[List[int], List[int]]]:
    """The N-D box of the full tensor holding a box of the local slice, or None when the local box spans
    two fused blocks (then it is two boxes of the full tensor)."""
    if spec is None:
        return offsets, lengths
    dim, blocks, rank, size = spec
    block = int(shape[dim]) // blocks
    part = block // size
    lo, n = offsets[dim], lengths[dim]
    if lo // part != (lo + n - 1) // part:
        return None
    out = list(offsets)
    out[dim] = (lo // part) * block + rank * part + lo % part
    return out, list(lengths)


def local_shape(shape: Sequence[int], spec: Spec) -> List[int]:
    out = [int(s) for s in shape]
    if spec is not None:
        out[spec[0]] //= spec[3]
    return out


#: elements whose index arithmetic is done at once (a few int64 temporaries of this length)
CHUNK = 1 << 22


def plan_sliced(shape: Sequence[int], want: Spec, start: int, end: int, entries: Sequence[Tuple[Spec, int, int]],
                chunk: int = CHUNK) -> Iterator[Tuple[int, torch.Tensor, torch.Tensor]]:
    """For elements ``[start, end)`` of slice ``want`` and saved ``entries`` (their slice, start, end), yield
    ``(entry index, positions in the output, positions in that entry)`` (grouped by entry, in entry order,
    at most ``chunk`` positions each) covering every wanted element once, from the first entry that holds
    it; raises when some element is in none. Memory: one flag per wanted element plus chunk-sized
    temporaries, so a reader holds one saved entry at a time."""
    n = end - start
    filled = torch.zeros(n, dtype=torch.bool)
    for k, (spec, lo, hi) in enumerate(entries):
        for c0 in range(0, n, chunk):
            c1 = min(n, c0 + chunk)
            full = local_to_full(shape, want, torch.arange(start + c0, start + c1, dtype=torch.int64))
            mask, local = full_to_local(shape, spec, full)
            sel = mask & ~filled[c0:c1] & (local >= lo) & (local < hi)
            if not bool(sel.any()):
                continue
            filled[c0:c1] |= sel
            pos = sel.nonzero().reshape(-1)
            yield k, pos + c0, local[pos] - lo
    if not bool(filled.all()):
        first = int((~filled).nonzero()[0])
        raise CheckpointError(f"element {start + first} of this slice (of {n} wanted from {start}) is in "
                              f"no checkpoint file")
