"""Megatron's RNG tracker: dropout in tensor-parallel regions draws from a per-rank stream.

Where activations are split across the model group (attention heads, sequence shards) each rank must
drop different elements, so those dropouts run inside :meth:`TPRNGTracker.fork`, which swaps the default
generator to this rank's stream (seed ``base + 2718 + model_rank``, Megatron's offset) and back. Where
activations are replicated (outside tensor-parallel regions without sequence parallelism) dropout uses the
default generator, which every rank of the group seeds alike, so the ranks drop the same elements.
"""
from __future__ import annotations

from typing import ContextManager

import torch
import torch.nn as nn

from ...checkpointing.core import get_cuda_rng_tracker
from ...checkpointing.rng import MODEL_PARALLEL_RNG

#: Megatron's offset of the tensor-parallel seed from the base seed.
TP_SEED_OFFSET = 2718


class TPRNGTracker:
    """This rank's tensor-parallel stream: the "model-parallel-rng" state of the process's RNG tracker
    (:func:`shardspeed.checkpointing.get_cuda_rng_tracker`, DeepSpeed's and Megatron's), so activation
    checkpointing restores it for a recompute and dropout in split regions replays exactly. Building one
    seeds that state afresh with ``base_seed + 2718 + model_rank``; the default generator is untouched."""

    def __init__(self, base_seed: int, model_rank: int):
        self.seed = int(base_seed) + TP_SEED_OFFSET + int(model_rank)
        get_cuda_rng_tracker().reseed(MODEL_PARALLEL_RNG, self.seed)

    def fork(self) -> ContextManager[None]:
        """Run the block on this rank's stream; the default generator is restored (untouched) after."""
        return get_cuda_rng_tracker().fork(MODEL_PARALLEL_RNG)


class ForkedDropout(nn.Dropout):
    """``nn.Dropout`` drawing its mask from the tracker's per-rank stream (for split activations)."""

    def __init__(self, p: float, tracker: TPRNGTracker):
        super().__init__(p)
        self.tracker = tracker

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training or self.p == 0.0:
            return x
        with self.tracker.fork():
            return super().forward(x)
