"""DeepSpeed's (Megatron's) model-parallel RNG tracker: named RNG states of the device generator.

``get_cuda_rng_tracker().fork()`` runs a region (dropout inside tensor-parallel layers, typically) on a
named state and advances only that state; ``model_parallel_cuda_manual_seed(seed)`` seeds the default
generator with ``seed`` (the same on the ranks of a model group) and adds the "model-parallel-rng" state
seeded ``seed + 2718 + tensor-parallel rank`` (different within a model group), as DeepSpeed does. The
"device" is CUDA when available, else the CPU generator (as DeepSpeed's CPU accelerator). A checkpoint
restores the tracker's states for its recompute, so dropout inside a fork replays exactly. The tracker
``get_cuda_rng_tracker()`` returns belongs to the current engine's activation checkpointing
(:func:`shardspeed.checkpointing.core.current`; one engine hands it to the next); this module holds none.
"""
from __future__ import annotations

import contextlib
import copy
import logging
from typing import Dict, Iterator

import torch

logger = logging.getLogger("shardspeed.checkpointing")

MODEL_PARALLEL_RNG = "model-parallel-rng"  # DeepSpeed's _MODEL_PARALLEL_RNG_TRACKER_NAME


def _generator() -> torch.Generator:
    if torch.cuda.is_available():
        return torch.cuda.default_generators[torch.cuda.current_device()]
    return torch.default_generator


def device_rng_state() -> torch.Tensor:
    return _generator().get_state()


def set_device_rng_state(state: torch.Tensor) -> None:
    _generator().set_state(state)


class RNGStatesTracker:
    """Named RNG states (DeepSpeed's ``CudaRNGStatesTracker``: the same methods)."""

    def __init__(self) -> None:
        self.states_: Dict[str, torch.Tensor] = {}
        self.seeds_: set = set()
        self._seed_of: Dict[str, int] = {}

    def reset(self) -> None:
        self.states_ = {}
        self.seeds_ = set()
        self._seed_of = {}

    def get_states(self) -> Dict[str, torch.Tensor]:
        """A copy of the name -> state map (the states themselves are replaced, never mutated, by fork)."""
        return copy.copy(self.states_)

    def set_states(self, states: Dict[str, torch.Tensor]) -> None:
        self.states_ = states

    def add(self, name: str, seed: int) -> None:
        if seed in self.seeds_:
            raise ValueError(f"seed {seed} already exists in the RNG tracker")
        if name in self.states_:
            raise ValueError(f"RNG state {name!r} already exists in the tracker")
        self.seeds_.add(seed)
        self._seed_of[name] = seed
        original = device_rng_state()
        _generator().manual_seed(seed)
        self.states_[name] = device_rng_state()
        set_device_rng_state(original)

    def reseed(self, name: str, seed: int) -> None:
        """Add the state ``name`` seeded ``seed``, replacing one of that name (a new engine starts its stream
        afresh, as the engine before it did)."""
        if name in self.states_:
            del self.states_[name]
            self.seeds_.discard(self._seed_of.pop(name, None))
        self.add(name, seed)

    @contextlib.contextmanager
    def fork(self, name: str = MODEL_PARALLEL_RNG) -> Iterator[None]:
        """Run the block on the state ``name``; leave the default state as it was."""
        if name not in self.states_:
            raise ValueError(f"RNG state {name!r} was not added to the tracker (call "
                             f"model_parallel_cuda_manual_seed(seed) or get_cuda_rng_tracker().add(name, seed))")
        original = device_rng_state()
        set_device_rng_state(self.states_[name])
        try:
            yield
        finally:
            self.states_[name] = device_rng_state()
            set_device_rng_state(original)


# DeepSpeed's name for the class, kept for scripts that import it.
CudaRNGStatesTracker = RNGStatesTracker

def seed_tracker(tracker: RNGStatesTracker, seed: int, tp_rank: int) -> None:
    """``model_parallel_cuda_manual_seed`` on ``tracker`` for a known tensor-parallel rank."""
    tracker.reset()
    _generator().manual_seed(seed)
    tracker.add(MODEL_PARALLEL_RNG, seed + 2718 + tp_rank)
    logger.debug("model-parallel seeds: default %d, %s %d", seed, MODEL_PARALLEL_RNG, seed + 2718 + tp_rank)
