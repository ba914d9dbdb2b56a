"""The distributed DataLoader returned by ``initialize(training_data=...)``: resumable, reshuffled per epoch.

:class:`ResumableDistributedSampler` orders an epoch exactly as torch's ``DistributedSampler`` does (the same
permutation, padding and rank interleaving) and also knows its *position*: how many samples of the epoch's
global order the data-parallel group has consumed. :class:`ResumableDataLoader` counts the micro-batches it
hands to the training loop (not those its workers prefetch), so the position is what the model has seen.

- **Epochs by itself.** When an epoch's iterator is exhausted the loader moves to the next epoch, so a new
  ``iter(loader)`` (a ``for`` loop, DeepSpeed's ``RepeatingLoader``) reshuffles without ``set_epoch``. An
  explicit ``sampler.set_epoch(e)`` (or ``loader.set_epoch(e)``) is still honoured: a *different* epoch
  starts at its beginning; the current epoch keeps its position (so a resumed script that calls
  ``set_epoch`` with the restored epoch continues mid-epoch).
- **Resumable.** ``state_dict()`` is ``{"epoch", "position", "world_size", ...}``; after
  ``load_state_dict`` the next ``iter(loader)`` continues with the next batch the saved run would have read.
  Consumed samples are skipped by index, never loaded. Breaking out of a ``for`` loop mid-epoch and
  iterating again also continues (nothing is re-read).
- **Another world size.** The position is global, so a run resumed at world size M continues at the same
  sample of the same epoch order: the rest of the epoch ``order[position:]`` is dealt round-robin to the M
  ranks (padded by wrapping, or cut with ``drop_last``, so every rank gets as many batches). Which rank reads
  which sample changes, which samples are read does not; the epochs after it are plain M-rank epochs.
"""
from __future__ import annotations

import logging
import math
from typing import Any, Callable, Dict, Iterator, List, Optional, Sized, cast

import torch
from torch.utils.data import DataLoader, Dataset, Sampler

from ..mesh.topology import Topology
from ..utils.repeating import RepeatingLoader

__all__ = ["RepeatingLoader", "ResumableDataLoader", "ResumableDistributedSampler", "build_dataloader"]

logger = logging.getLogger("shardspeed")


class ResumableDistributedSampler(Sampler[int]):
    """``DistributedSampler``'s order, plus an epoch and a position in it that can be saved and restored."""

    def __init__(self, dataset: Dataset, num_replicas: int, rank: int, shuffle: bool = True, seed: int = 0,
                 drop_last: bool = False):
        if not 0 <= rank < num_replicas:
            raise ValueError(f"rank {rank} is not in [0, {num_replicas})")
        self.dataset: Sized = dataset  # type: ignore[assignment]  # a map-style dataset has a length
        self.num_replicas = num_replicas
        self.rank = rank
        self.shuffle = shuffle
        self.seed = seed
        self.drop_last = drop_last
        self.epoch = 0
        self._start = 0  # global position at which the current pass over the epoch began
        self._taken = 0  # samples of this rank consumed since then

    # ---- the epoch's global order (pure; DistributedSampler's arithmetic) ----
    @property
    def total_size(self) -> int:
        n, w = len(self.dataset), self.num_replicas
        return (n // w) * w if self.drop_last else math.ceil(n / w) * w

    def epoch_order(self, epoch: int) -> List[int]:
        """Every index of ``epoch`` in global order: rank r reads elements r, r+W, r+2W, ... of it."""
        n = len(self.dataset)
        if self.shuffle:
            g = torch.Generator()
            g.manual_seed(self.seed + epoch)
            order = torch.randperm(n, generator=g).tolist()
        else:
            order = list(range(n))
        size = self.total_size
        if size > n:  # pad by repeating the start, as DistributedSampler does
            pad = size - n
            order += (order * math.ceil(pad / max(n, 1)))[:pad]
        return order[:size]

    def _rest(self) -> List[int]:
        """The global order from the current pass's start, a whole number of rounds of the ranks."""
        rest = self.epoch_order(self.epoch)[self._start :]
        w = self.num_replicas
        if len(rest) % w:  # only after a resume at another world size
            if self.drop_last:
                rest = rest[: len(rest) // w * w]
            else:
                rest += (rest * w)[: w - len(rest) % w]
        return rest

    # ---- Sampler ----
    def __iter__(self) -> Iterator[int]:
        return iter(self._rest()[self.rank :: self.num_replicas])

    def __len__(self) -> int:
        """Samples this rank reads in the pass that the next ``iter`` starts."""
        start = 0 if self.exhausted else self._start
        remaining = max(self.total_size - start, 0)
        w = self.num_replicas
        return remaining // w if self.drop_last else math.ceil(remaining / w)

    # ---- position ----
    @property
    def position(self) -> int:
        """Samples of the epoch's global order consumed by the whole group."""
        return min(self._start + self._taken * self.num_replicas, self.total_size)

    @property
    def exhausted(self) -> bool:
        return self.position >= self.total_size

    def set_epoch(self, epoch: int) -> None:
        """Start ``epoch`` at its beginning, unless it is the current epoch (then its position is kept)."""
        epoch = int(epoch)
        if epoch != self.epoch:
            self.epoch, self._start, self._taken = epoch, 0, 0

    def begin_pass(self) -> None:
        """Called by the loader before iterating: continue at the position; a finished epoch rolls over."""
        if self.exhausted:
            self.epoch, self._start, self._taken = self.epoch + 1, 0, 0
        else:
            self._start, self._taken = self.position, 0

    def advance(self, samples: int) -> None:
        """This rank consumed ``samples`` more samples of the pass."""
        self._taken += samples

    def finish_pass(self) -> None:
        self._start, self._taken = self.total_size, 0

    def state_dict(self) -> Dict[str, Any]:
        return {"epoch": self.epoch, "position": self.position, "world_size": self.num_replicas,
                "dataset_len": len(self.dataset), "seed": self.seed, "shuffle": self.shuffle,
                "drop_last": self.drop_last}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        n = len(self.dataset)
        if state.get("dataset_len", n) != n:
            logger.warning("the data loader's dataset has %d samples, the checkpoint's had %s: continuing epoch %s "
                           "at sample position %s of the new order", n, state["dataset_len"], state.get("epoch"),
                           state.get("position"))
        for key in ("seed", "shuffle"):
            if key in state and state[key] != getattr(self, key):
                logger.warning("the data loader's %s is %r, the checkpoint's was %r: the epoch order differs",
                               key, getattr(self, key), state[key])
        self.epoch = int(state.get("epoch", 0))
        self._start, self._taken = min(int(state.get("position", 0)), self.total_size), 0


class ResumableDataLoader(DataLoader):
    """A DataLoader over a :class:`ResumableDistributedSampler` that counts the batches it yields."""

    def __iter__(self):
        sampler = self.sampler
        if not isinstance(sampler, ResumableDistributedSampler):
            yield from super().__iter__()
            return
        if self.generator is not None:  # worker seeds per epoch, never a draw from the global RNG (which a
            self.generator.manual_seed(sampler.seed * 1_000_003 + sampler.epoch)  # resume restores)
        sampler.begin_pass()
        if sampler.position == 0:  # an epoch's first pass: one int64 from the global RNG, the draw torch's
            # DataLoader (DeepSpeed's loader) makes for its iterator's seed, so later random ops (MoE token
            # selection, dropout) see DeepSpeed's numbers. A pass resumed mid-epoch does not: its run drew it.
            torch.empty((), dtype=torch.int64).random_()
        for batch in super().__iter__():
            # counted before the training loop sees it: a save after this batch's step resumes after it
            sampler.advance(self.batch_size)
            yield batch
        sampler.finish_pass()  # the epoch is consumed (also when drop_last left a partial batch unread)

    def set_epoch(self, epoch: int) -> None:
        cast(Any, self.sampler).set_epoch(epoch)  # duck-typed, as DistributedSampler's

    def state_dict(self) -> Dict[str, Any]:
        return cast(ResumableDistributedSampler, self.sampler).state_dict()

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        cast(ResumableDistributedSampler, self.sampler).load_state_dict(state)


def build_dataloader(dataset, micro_batch_size: int, topo: Topology, collate_fn: Optional[Callable] = None,
                     drop_last: bool = False, shuffle: bool = True, seed: int = 0) -> DataLoader:
    """Each data-parallel rank reads a disjoint 1/N of ``dataset`` in micro-batches (map-style datasets:
    resumable, see the module docstring; an ``IterableDataset`` gets a plain DataLoader, not resumable)."""
    if isinstance(dataset, torch.utils.data.IterableDataset):
        return DataLoader(dataset, batch_size=micro_batch_size, collate_fn=collate_fn, drop_last=drop_last)
    sampler = ResumableDistributedSampler(dataset, num_replicas=topo.batch_world, rank=topo.batch_rank, shuffle=shuffle,
                                          seed=seed, drop_last=drop_last)
    # a generator of its own for the workers' seeds: torch's DataLoader otherwise draws its base seed from the
    # global RNG on every iter(), so a loop resumed mid-epoch (RNG restored, then iter()) would shift dropout by
    # one draw; the global RNG still advances by that draw at each epoch's start (ResumableDataLoader.__iter__)
    return ResumableDataLoader(dataset, batch_size=micro_batch_size, sampler=sampler, collate_fn=collate_fn,
                               drop_last=drop_last, pin_memory=topo.device.type == "cuda",
                               generator=torch.Generator())
