"""Where DeepSpeed's ZeRO puts each parameter (shardspeed.checkpoint.deepspeed_layout.layout): pure
arithmetic, checked against a flat buffer built by hand the way stage_1_and_2.py / stage3.py build theirs
(no DeepSpeed, no process group)."""
from __future__ import annotations

import math

import pytest
import torch

from shardspeed.checkpoint.deepspeed_layout.layout import zero3_frozen_spans, zero3_spans, zero12_spans
from shardspeed.errors import CheckpointError


def _zero12_partitions(params, pads, world):
    """The ranks' saved partitions of one group, as DeepSpeed saves them: parameters end to end with their
    paddings, padded to 2 × world, cut into equal partitions, the tail padding cut off."""
    pieces = []
    for (_, t), p in zip(params, pads):
        pieces += [t.reshape(-1), torch.full((p,), float("nan"))]
    flat = torch.cat(pieces)
    used = flat.numel()
    align = 2 * world
    flat = torch.cat([flat, torch.full((math.ceil(used / align) * align - used,), float("nan"))])
    size = flat.numel() // world
    return [flat[r * size : min((r + 1) * size, used)] for r in range(world)], size


@pytest.mark.parametrize("world", [1, 2, 3, 4, 7])
def test_zero12_spans_rebuild_every_parameter(world):
    g = torch.Generator().manual_seed(world)
    groups = [[("a", torch.randn(5, 3, generator=g)), ("b", torch.randn(7, generator=g)),
               ("c", torch.randn(2, 2, generator=g))],
              [("d", torch.randn(11, generator=g))]]
    pads = [[1, 3, 0], [0]]
    parts, sizes = zip(*(_zero12_partitions(grp, p, world) for grp, p in zip(groups, pads)))
    spans = zero12_spans([[(n, t.numel()) for n, t in grp] for grp in groups], pads,
                         [[(int(x.numel()), size) for x in ps] for ps, size in zip(parts, sizes)])
    for gi, grp in enumerate(groups):
        for name, t in grp:
            got = torch.full((t.numel(),), float("nan"))
            for s in (s for s in spans if s.name == name):
                assert s.slot == gi
                got[s.start : s.end] = parts[gi][s.rank][s.offset : s.offset + s.end - s.start]
            assert torch.equal(got, t.reshape(-1)), (world, name)


def test_zero12_spans_refuse_a_layout_that_does_not_add_up():
    with pytest.raises(CheckpointError, match="do not match the flat partitions"):
        zero12_spans([[("a", 10)]], None, [[(4, 6), (4, 6)]])
    with pytest.raises(CheckpointError, match="partitions differ in size"):
        zero12_spans([[("a", 10)]], None, [[(6, 6), (4, 5)]])


@pytest.mark.parametrize("world,slots", [(2, None), (3, [5, 9]), (4, [1, 2, 100])])
def test_zero3_spans_rebuild_every_parameter(world, slots):
    g = torch.Generator().manual_seed(world)
    params = [("a", torch.randn(5, 3, generator=g)), ("b", torch.randn(7, generator=g)), ("c", torch.randn(1))]
    ranks = []
    for r in range(world):  # each rank: piece r of every parameter (padded), end to end
        pieces = []
        for _, t in params:
            k = math.ceil(t.numel() / world)
            piece = torch.full((k,), float("nan"))
            chunk = t.reshape(-1)[r * k : (r + 1) * k]
            piece[: chunk.numel()] = chunk
            pieces.append(piece)
        ranks.append(torch.cat(pieces))
    total = ranks[0].numel()
    sizes = [total] if slots is None else [min(s, total - sum(slots[:i])) for i, s in enumerate(slots)]
    sizes = [s for s in sizes if s > 0]
    sizes[-1] = total - sum(sizes[:-1])
    bounds = [0] + [sum(sizes[: i + 1]) for i in range(len(sizes))]
    spans = zero3_spans([(n, t.numel()) for n, t in params], world, sizes)
    for name, t in params:
        got = torch.full((t.numel(),), float("nan"))
        for s in (s for s in spans if s.name == name):
            lo = bounds[s.slot] + s.offset
            assert s.offset + s.end - s.start <= sizes[s.slot]
            got[s.start : s.end] = ranks[s.rank][lo : lo + s.end - s.start]
        assert torch.equal(got, t.reshape(-1)), (world, slots, name)
    with pytest.raises(CheckpointError, match="do not match the flat partitions"):
        zero3_spans([(n, t.numel()) for n, t in params], world, [total + 1])


def test_zero3_frozen_spans_skip_empty_pieces():
    spans = zero3_frozen_spans([("w", 3)], 4)  # pieces of 1: rank 3 holds only padding
    assert [(s.rank, s.start, s.end) for s in spans] == [(0, 0, 1), (1, 1, 2), (2, 2, 3)]
