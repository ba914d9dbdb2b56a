"""Which copy of a parameter counts once in the global gradient norm.

Across the model-parallel ranks (pipe × model) a parameter is either a distinct part of the model (a
tensor-parallel slice; a layer of this pipeline stage) or a copy of one that another rank also holds (a
norm's weight replicated over the tensor-parallel group; a tied embedding on the last pipeline stage). The
global norm sums squared gradients over the whole model-parallel group, so each copy must count once:

- a tensor-parallel slice counts on every rank (:func:`mark_tensor_parallel`, Megatron's
  ``tensor_model_parallel`` attribute, which Megatron-style models set themselves);
- any other parameter counts on model rank 0 only (its tensor-parallel peers hold the same values);
- a copy marked with :func:`mark_replica` never counts (the owner's copy does).
"""
from __future__ import annotations

import torch

#: Megatron's attribute for a parameter split over the tensor-parallel group.
TENSOR_PARALLEL_ATTR = "tensor_model_parallel"
_REPLICA_ATTR = "_shardspeed_norm_replica"


def mark_tensor_parallel(param: torch.Tensor) -> None:
    """This rank holds a distinct slice of ``param`` (it counts in the norm on every tensor-parallel rank)."""
    setattr(param, TENSOR_PARALLEL_ATTR, True)


def is_tensor_parallel(param: torch.Tensor) -> bool:
    return bool(getattr(param, TENSOR_PARALLEL_ATTR, False))


def mark_replica(param: torch.Tensor) -> None:
    """This copy duplicates one counted on another model-parallel rank (e.g. a tied weight on the last
    pipeline stage); its gradient is left out of the global norm here."""
    setattr(param, _REPLICA_ATTR, True)


def counts_in_norm(param: torch.Tensor, model_rank: int) -> bool:
    """Whether this rank's copy of ``param`` counts in the global gradient norm (see the module doc)."""
    if getattr(param, _REPLICA_ATTR, False):
        return False
    return model_rank == 0 or is_tensor_parallel(param)
