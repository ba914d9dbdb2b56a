"""Where DeepSpeed's ZeRO puts each parameter in its flat partitions: pure arithmetic, no files.

Stages 1 and 2 (``deepspeed/runtime/zero/stage_1_and_2.py``): per parameter group, the trainable
parameters are laid end to end in ``param_shapes`` order (DeepSpeed's round-robin reordering, when on, is
already that order), each followed by its ``param_alignment_paddings`` entry; the group is padded to a
multiple of ``2 × world`` and cut into ``world`` equal partitions. Rank ``r`` saves partition ``r`` with
its tail padding cut off (``group_paddings``), so the saved lengths add up to the group without its final
padding. The optimizer's moments of a group are one flat tensor laid out like the fp32 partition.

Stage 3 (``stage3.py``): every parameter is cut on its own into ``world`` pieces of ``ceil(numel / world)``
elements (the last padded); rank ``r`` holds piece ``r`` of every parameter, in ``param_shapes`` order,
spread over its sub-groups' flat tensors (``fp32_flat_groups``) end to end.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, List, Optional, Sequence, Tuple

import torch

from ...errors import CheckpointError
from ...utils.safe_files import replacing


@dataclass(frozen=True)
class Span:
    """Elements ``[start, end)`` of the flattened parameter ``name``, held by ``rank`` in its flat tensor
    number ``slot`` (a parameter group at stages 1-2, a sub-group at stage 3) from element ``offset``."""

    name: str
    start: int
    end: int
    rank: int
    slot: int
    offset: int


def zero12_spans(groups: Sequence[Sequence[Tuple[str, int]]], paddings: Optional[Sequence[Sequence[int]]],
                 partitions: Sequence[Sequence[Tuple[int, int]]]) -> List[Span]:
    """Spans of stages 1-2. ``groups[g]``: (name, numel) in flat order; ``paddings[g][k]``: elements after
    parameter ``k`` (None: none); ``partitions[g][r]``: (elements rank ``r`` saved, its partition size)."""
    out: List[Span] = []
    for g, params in enumerate(groups):
        parts = partitions[g]
        sizes = {size for _, size in parts}
        if len(sizes) != 1:
            raise CheckpointError(f"parameter group {g}: the ranks' partitions differ in size ({sorted(sizes)})")
        size = sizes.pop()
        pads = list(paddings[g]) if paddings is not None else [0] * len(params)
        if len(pads) != len(params):
            raise CheckpointError(f"parameter group {g}: {len(pads)} alignment paddings for {len(params)} parameters")
        total = sum(n + p for (_, n), p in zip(params, pads))
        saved = sum(n for n, _ in parts)
        if saved != total or total > size * len(parts):
            raise CheckpointError(f"parameter group {g}: its parameters hold {total} elements but the ranks saved "
                                  f"{saved} (partitions of {size}): the shapes do not match the flat partitions")
        flat = 0
        for (name, n), pad in zip(params, pads):
            pos = flat
            while pos < flat + n:
                r = pos // size
                hi = min(flat + n, (r + 1) * size)
                out.append(Span(name, pos - flat, hi - flat, r, g, pos - r * size))
                pos = hi
            flat += n + pad
    return out


def zero3_piece(numel: int, world: int) -> int:
    """Elements of one rank's piece of a parameter at stage 3."""
    return math.ceil(numel / world)


def zero3_spans(params: Sequence[Tuple[str, int]], world: int, slot_sizes: Sequence[int]) -> List[Span]:
    """Spans of stage 3 (the same on every rank). ``params``: (name, numel) in ``param_shapes`` order;
    ``slot_sizes``: the elements of each of a rank's flat sub-group tensors."""
    need = sum(zero3_piece(n, world) for _, n in params)
    if need != sum(slot_sizes):
        raise CheckpointError(f"the parameters' stage-3 pieces hold {need} elements per rank but the flat groups "
                              f"hold {sum(slot_sizes)}: the shapes do not match the flat partitions")
    bounds = [0]
    for s in slot_sizes:
        bounds.append(bounds[-1] + int(s))
    out: List[Span] = []
    at = 0
    for name, n in params:
        piece = zero3_piece(n, world)
        for r in range(world):
            lo, hi = r * piece, min((r + 1) * piece, n)
            pos = at
            while lo < hi:  # a piece that runs across two sub-groups is two spans
                slot = max(i for i in range(len(slot_sizes)) if bounds[i] <= pos)
                take = min(hi - lo, bounds[slot + 1] - pos)
                out.append(Span(name, lo, lo + take, r, slot, pos - bounds[slot]))
                lo += take
                pos += take
        at += piece
    return out


def zero3_frozen_spans(params: Sequence[Tuple[str, int]], world: int) -> List[Span]:
    """Frozen parameters at stage 3: rank ``r``'s ``frozen_param_fragments[name]`` is piece ``r`` (slot and
    offset: 0 within that tensor)."""
    out = []
    for name, n in params:
        piece = zero3_piece(n, world)
        for r in range(world):
            lo, hi = r * piece, min((r + 1) * piece, n)
            if lo < hi:
                out.append(Span(name, lo, hi, r, 0, 0))
    return out


def save_pt(obj: Any, path: str) -> None:
    """``torch.save(obj, path)`` in a private folder beside ``path``, then moved onto it (never through a
    link planted at ``path``; the archive keeps the file's own name inside, as DeepSpeed's files do)."""
    with replacing(path, sync=False) as staged:
        torch.save(obj, staged)
