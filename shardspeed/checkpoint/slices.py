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


Run = Tuple[int, int, int, int]  # (entry index, offset in the output, offset in the entry, length)


def _reduced(shape: Sequence[int], specs: Sequence[Spec]) -> Optional[Tuple[Tuple[int, int], int]]:
    """When every slice cuts the same dimension: the tensor as ``(outer, D / g)`` segments of ``g × inner``
    elements that are contiguous in every slice (``g``: the gcd of every slice's part length), and that
    segment length; None when slices cut different dimensions."""
    dims = {s[0] for s in specs if s is not None}
    if len(dims) != 1:
        return None
    d = dims.pop()
    size_d = int(shape[d])
    g = size_d
    for s in specs:
        if s is not None:
            g = math.gcd(g, size_d // s[1] // s[3])
    inner = math.prod(int(x) for x in shape[d + 1 :])
    return (math.prod(int(x) for x in shape[:d]), size_d // g), g * inner


def _runs_of(k: int, dst: torch.Tensor, src: torch.Tensor, ln: torch.Tensor) -> List[Run]:
    """Merge copies that continue each other in both the output and the entry."""
    if dst.numel() == 0:
        return []
    brk = torch.ones(dst.numel(), dtype=torch.bool)
    brk[1:] = (dst[1:] != dst[:-1] + ln[:-1]) | (src[1:] != src[:-1] + ln[:-1])
    first = brk.nonzero().reshape(-1)
    total = torch.cumsum(ln, 0)
    last = torch.cat([first[1:] - 1, torch.tensor([dst.numel() - 1])])
    lengths = total[last] - total[first] + ln[first]
    return [(k, int(a), int(b), int(n)) for a, b, n in zip(dst[first], src[first], lengths)]


def copy_runs(shape: Sequence[int], want: Spec, start: int, end: int,
              entries: Sequence[Tuple[Spec, int, int]]) -> List[Run]:
    """The contiguous copies that assemble elements ``[start, end)`` of slice ``want`` from saved ``entries``
    (their slice, start, end), grouped by entry; raises when an element is in no entry or in two. Index
    arithmetic runs on segments that stay contiguous in every slice (a row-parallel slice: one per row;
    a column-parallel one: one in all), so a copy is a slice assignment, not an element gather."""
    red = _reduced(shape, [want] + [e[0] for e in entries])
    runs: List[Run] = []
    if red is None:  # slices cut different dimensions: element by element
        for k, dst, src in plan_sliced(shape, want, start, end, entries):
            runs += _runs_of(k, dst, src, torch.ones_like(dst))
        return runs
    rshape, seg = red

    def rspec(s: Spec) -> Spec:
        return None if s is None else (1, s[1], s[2], s[3])

    segs = torch.arange(start // seg, (end + seg - 1) // seg, dtype=torch.int64)
    full = local_to_full(rshape, rspec(want), segs)
    ws = segs * seg  # each segment's first element, counted in the wanted slice
    filled = torch.zeros(end - start, dtype=torch.bool)
    for k, (spec, lo, hi) in enumerate(entries):
        mask, local = full_to_local(rshape, rspec(spec), full)
        es = local * seg  # the same, counted in the entry's slice
        a = torch.clamp(torch.maximum(start - ws, lo - es), min=0)
        b = torch.clamp(torch.minimum(end - ws, hi - es), max=seg)
        ok = mask & (b > a)
        if not bool(ok.any()):
            continue
        for run in _runs_of(k, (ws + a - start)[ok], (es + a - lo)[ok], (b - a)[ok]):
            piece = filled[run[1] : run[1] + run[3]]
            if bool(piece.any()):
                raise CheckpointError(f"elements from {start + run[1]} of this slice are in two checkpoint entries")
            piece.fill_(True)
            runs.append(run)
    if not bool(filled.all()):
        first = int((~filled).nonzero()[0])
        raise CheckpointError(f"element {start + first} of this slice (of {end - start} wanted from {start}) is in "
                              f"no checkpoint file")
    return runs
