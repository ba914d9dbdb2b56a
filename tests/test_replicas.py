"""Which copy of a parameter counts in the global gradient norm (shardspeed.parallel.replicas)."""
import torch

from shardspeed.parallel import counts_in_norm, is_tensor_parallel, mark_replica, mark_tensor_parallel


def test_plain_parameter_counts_on_model_rank_0_only():
    p = torch.nn.Parameter(torch.zeros(2))
    assert counts_in_norm(p, 0) and not counts_in_norm(p, 1)


def test_tensor_parallel_slice_counts_everywhere_megatron_attribute_too():
    p, q = torch.nn.Parameter(torch.zeros(2)), torch.nn.Parameter(torch.zeros(2))
    mark_tensor_parallel(p)
    q.tensor_model_parallel = True  # what a Megatron-style model sets itself
    assert is_tensor_parallel(p) and all(counts_in_norm(t, r) for t in (p, q) for r in (0, 1, 3))


def test_replica_never_counts():
    p = torch.nn.Parameter(torch.zeros(2))
    mark_tensor_parallel(p)
    mark_replica(p)
    assert not counts_in_norm(p, 0) and not counts_in_norm(p, 1)


def test_counted_ranges_leave_out_the_skipped_pieces():
    from shardspeed.zero.master import _counted_ranges

    assert _counted_ranges(10, []) is None  # nothing skipped: the whole chunk, no slicing
    assert _counted_ranges(10, [(7, 1), (2, 3)]) == [(0, 2), (5, 7), (8, 10)]
    assert _counted_ranges(10, [(0, 10)]) == []
