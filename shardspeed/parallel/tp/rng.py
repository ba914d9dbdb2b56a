"""Megatron's RNG tracker: dropout in tensor-parallel regions draws from a per-rank stream.

Where activations are split across the model group (attention heads, sequence shards) each rank must
drop different elements, so those dropouts run inside :meth:`TPRNGTracker.fork`, which swaps the default
generator to this rank's stream (seed ``base + 2718 + model_rank``, Megatron's offset) and back. Where
activations are replicated (outside tensor-parallel regions without sequence parallelism) dropout uses the
default generator, which every rank of the group seeds alike, so the ranks drop the same elements.
"""
from __future__ import annotations

import contextlib
from typing import Iterator, Optional

import torch
import torch.nn as nn

#: Megatron's offset of the tensor-parallel seed from the base seed.
TP_SEED_OFFSET = 2718


class TPRNGTracker:
    """This rank's tensor-parallel stream (CPU generator, plus the device's when it is CUDA)."""

    def __init__(self, base_seed: int, model_rank: int, device: Optional[torch.device] = None):
        self.seed = int(base_seed) + TP_SEED_OFFSET + int(model_rank)
        self.cuda = device is not None and device.type == "cuda"
        saved = self._get()
        torch.manual_seed(self.seed)
        self._state = self._get()
        self._set(saved)

    def _get(self):
        return (torch.get_rng_state(), torch.cuda.get_rng_state() if self.cuda else None)

    def _set(self, state) -> None:
        torch.set_rng_state(state[0])
        if self.cuda and state[1] is not None:
            torch.cuda.set_rng_state(state[1])

    @contextlib.contextmanager
    def fork(self) -> Iterator[None]:
        """Run the block on this rank's stream; the default generator is restored (untouched) after."""
        saved = self._get()
        self._set(self._state)
        try:
            yield
        finally:
            self._state = self._get()
            self._set(saved)

    def state_dict(self) -> dict:
        return {"seed": self.seed, "cpu": self._state[0], "cuda": self._state[1]}

    def load_state_dict(self, sd: dict) -> None:
        self.seed = int(sd["seed"])
        self._state = (sd["cpu"], sd["cuda"])


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
