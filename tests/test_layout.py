"""Pure shard arithmetic: no process group, no tensors."""
import pytest

from shardspeed.zero.layout import FlatLayout, group_by_size


def test_offsets_padding_and_chunks():
    lay = FlatLayout.of([5, 3, 4], world=4)
    assert lay.offsets == [0, 5, 8]
    assert lay.numel == 12 and lay.chunk_size == 3 and lay.padded_numel == 12 and lay.padding == 0
    lay = FlatLayout.of([5, 3, 5], world=4)
    assert lay.chunk_size == 4 and lay.padded_numel == 16 and lay.padding == 3
    assert [lay.chunk_range(r) for r in range(4)] == [(0, 4), (4, 8), (8, 12), (12, 16)]


def test_alignment_rounds_chunks_up():
    lay = FlatLayout.of([10], world=2, align=8)
    assert lay.chunk_size == 8 and lay.padded_numel == 16


def test_pieces_cover_every_element_exactly_once():
    numels = [7, 1, 0, 13, 4]
    for world in (1, 2, 3, 4, 8):
        lay = FlatLayout.of(numels, world)
        covered = {i: [] for i in range(len(numels))}
        for r in range(world):
            for pc in lay.pieces(r):
                covered[pc.param_index].append((pc.param_start, pc.param_end))
                lo, hi = lay.chunk_range(r)
                # the piece sits inside the chunk at the right place
                assert lo + pc.chunk_start == lay.offsets[pc.param_index] + pc.param_start
                assert pc.chunk_start + pc.numel <= hi - lo
        for i, n in enumerate(numels):
            spans = sorted(covered[i])
            assert sum(e - s for s, e in spans) == n
            if spans:
                assert spans[0][0] == 0 and spans[-1][1] == n
                assert all(a[1] == b[0] for a, b in zip(spans, spans[1:]))


def test_straddling_parameter_and_owners():
    lay = FlatLayout.of([3, 6, 3], world=3)  # chunks of 4: [0,4) [4,8) [8,12)
    assert lay.owner_ranks(1) == [0, 1, 2]
    assert [(p.param_index, p.param_start, p.param_end, p.chunk_start) for p in lay.pieces(1)] == [(1, 1, 5, 0)]
    assert lay.owner_ranks(0) == [0]


def test_more_ranks_than_elements():
    lay = FlatLayout.of([2], world=4)
    assert lay.chunk_size == 1 and lay.padded_numel == 4
    assert [len(lay.pieces(r)) for r in range(4)] == [1, 1, 0, 0]


def test_bucket_grouping():
    assert group_by_size([4, 4, 4, 4], 8) == [[0, 1], [2, 3]]
    assert group_by_size([10, 1, 1], 8) == [[0], [1, 2]]  # an oversize parameter gets its own bucket
    assert group_by_size([3, 3, 3], 100) == [[0, 1, 2]]
    assert group_by_size([], 8) == []
    with pytest.raises(ValueError):
        group_by_size([1], 0)


def test_invalid_world():
    with pytest.raises(ValueError):
        FlatLayout.of([1], world=0)
