"""The state protocol the checkpoint talks to, and the typed set of parts an engine hands it.

Each part a checkpoint saves exposes :class:`Stateful` (torchtitan's and ``torch.distributed.checkpoint``'s
protocol: ``state_dict()`` / ``load_state_dict(sd)``), or, for the sharded model state, the typed methods of
:class:`~shardspeed.zero.master.MasterWeights`. The engine gives them to the checkpoint code as one
:class:`CheckpointParts` (``engine.checkpoint_parts()``); nothing in :mod:`shardspeed.checkpoint` reads the
engine's private attributes or probes objects with ``getattr``.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Dict, Optional, Protocol, runtime_checkable

import torch
import torch.nn as nn

from ..comm.collectives import Collectives
from . import rng

if TYPE_CHECKING:  # pragma: no cover
    from ..zero.master import MasterWeights
    from .async_save import AsyncSaves


@runtime_checkable
class Stateful(Protocol):
    """A part whose state a checkpoint saves and restores (``torch.distributed.checkpoint.stateful.Stateful``)."""

    def state_dict(self) -> Dict[str, Any]: ...

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None: ...


@runtime_checkable
class EpochSampler(Protocol):
    """A sampler that reshuffles per epoch (torch's ``DistributedSampler``): only its epoch is saved."""

    epoch: int

    def set_epoch(self, epoch: int) -> None: ...


class TrainingCounters:
    """The engine's step counters as a :class:`Stateful` (reads and writes the engine's attributes)."""

    KEYS = ("global_steps", "global_samples", "micro_steps", "skipped_steps")

    def __init__(self, owner: Any):
        self._owner = owner

    def state_dict(self) -> Dict[str, Any]:
        return {k: int(getattr(self._owner, k)) for k in self.KEYS}

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        for k in self.KEYS:
            setattr(self._owner, k, int(state_dict.get(k, 0)))


class LoaderPosition:
    """Where the training data loader is, as a :class:`Stateful`.

    A :class:`Stateful` loader (the resumable one ``initialize(training_data=...)`` builds) saves its own
    state (epoch and global sample position); a plain DataLoader over an :class:`EpochSampler` saves the
    sampler's epoch; anything else only the ``global_samples`` count, which is always included."""

    def __init__(self, loader: Any, counters: TrainingCounters):
        self._loader = loader
        self._counters = counters

    def _sampler(self) -> Optional[EpochSampler]:
        sampler = self._loader.sampler if isinstance(self._loader, torch.utils.data.DataLoader) else None
        return sampler if isinstance(sampler, EpochSampler) else None

    def state_dict(self) -> Dict[str, Any]:
        state: Dict[str, Any] = {"global_samples": self._counters.state_dict()["global_samples"]}
        if isinstance(self._loader, Stateful):
            state.update(self._loader.state_dict())
            return state
        sampler = self._sampler()
        if sampler is not None:
            state["epoch"] = int(sampler.epoch)
        return state

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        if "epoch" not in state_dict:
            return
        if isinstance(self._loader, Stateful):
            self._loader.load_state_dict(state_dict)  # an older checkpoint without "position" starts its epoch
            return
        sampler = self._sampler()
        if sampler is not None:
            sampler.set_epoch(int(state_dict["epoch"]))


class RNGState:
    """Every RNG of this process (see :mod:`.rng`) as a :class:`Stateful`: ``{"tensors": {key: byte tensor},
    "py": {...}}``; the checkpoint puts the tensors in the rank's file and the rest in ``metadata.json``."""

    def state_dict(self) -> Dict[str, Any]:
        tensors, py = rng.capture()
        return {"tensors": dict(tensors), "py": py}

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        rng.restore(state_dict.get("tensors", {}), state_dict.get("py", {}))


@dataclass
class CheckpointParts:
    """What a checkpoint reads from and writes into a running engine (``engine.checkpoint_parts()``)."""

    module: nn.Module
    master: MasterWeights  # the sharded state: masters, optimizer, units (typed methods, not a state dict)
    collectives: Collectives  # of the data-parallel group: coordination and gathers
    zero_stage: int
    train_dtype: torch.dtype
    counters: Stateful
    lr_scheduler: Optional[Stateful]
    loss_scaler: Optional[Stateful]
    dataloader: Stateful
    rng: Stateful
    param_manager: Any = None  # stage 3: its after_step() drops gathered copies made stale by a load
    gather_16bit_weights_on_save: bool = False  # stage 3: save_16bit_model may gather the units
    #: a pipeline engine's whole world (every stage writes its own layers into one checkpoint): coordination
    #: and file numbering; None: the data-parallel group's ``collectives`` (the whole model on every rank)
    coordination: Optional[Collectives] = None
    #: the engine's asynchronous saves (:class:`~shardspeed.checkpoint.async_save.AsyncSaves`): one in flight
    #: at most, waited for by the next save, load and ``engine.destroy()``; None: saves are synchronous only
    async_saves: Optional[AsyncSaves] = None
    #: ``checkpoint.tag_validation``: what a save does when ranks pass different tags ("WARN", "IGNORE", "FAIL")
    tag_validation: str = "WARN"

    @property
    def rank(self) -> int:
        comm = self.coordination or self.collectives
        return comm.topology.shard_rank

    @property
    def world(self) -> int:
        comm = self.coordination or self.collectives
        return comm.topology.shard_size

    @property
    def data_rank(self) -> int:
        """This rank's place in its data-parallel group: rank 0 of each group writes what is not sharded."""
        return self.collectives.topology.shard_rank


def as_stateful(obj: Any) -> Optional[Stateful]:
    """``obj`` when it has ``state_dict``/``load_state_dict`` (an LR schedule, a loss scaler), else None (a
    user's scheduler without them is not saved)."""
    return obj if isinstance(obj, Stateful) else None
