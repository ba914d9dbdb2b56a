"""Where a checkpoint's saved inputs live until the recompute: split over the tensor-parallel group,
in host memory, in preallocated contiguous buffers.

torch's non-reentrant checkpoint saves the inputs of the checkpointed function as ordinary saved tensors
(everything inside the function is recomputed), so the saved-tensor hooks of :class:`SavedInputs`,
active around the checkpoint call, decide where they are kept: :meth:`SavedInputs.pack` runs when the
forward saves an input, :meth:`SavedInputs.unpack` when the backward's recompute needs it.
"""
from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass
from typing import Any, ContextManager, Dict, List, Optional, Tuple

import torch
import torch.nn as nn

from ..comm.collectives import Collectives
from ..errors import ConfigError
from .settings import CheckpointSettings

logger = logging.getLogger("shardspeed.checkpointing")


def partition_span(numel: int, world: int, rank: int) -> Tuple[int, int, int]:
    """``(start, length, chunk)``: rank ``rank``'s part of a flat tensor of ``numel`` elements split over
    ``world`` ranks in equal chunks of ``chunk = ceil(numel / world)`` (the last ones shorter or empty:
    each rank stores ``chunk`` elements, zero-padded, so one all-gather rebuilds ``world × chunk``)."""
    if world < 1 or not 0 <= rank < world:
        raise ValueError(f"rank {rank} of world {world}")
    chunk = -(-numel // world)
    start = min(rank * chunk, numel)
    return start, max(0, min(chunk, numel - start)), chunk


@dataclass
class _Packed:
    """A saved input while the forward is done: this rank's piece (on the device or the host) and what it
    takes to rebuild the whole tensor."""

    piece: torch.Tensor
    shape: torch.Size
    device: torch.device
    partitioned: bool


class ContiguousBuffers:
    """``contiguous_memory_optimization``: each input position of the checkpoints of one forward gets one
    preallocated buffer of ``slots`` partitions (``number_checkpoints``); the k-th checkpoint's partition
    is copied into slot k instead of being allocated on its own. The buffers are dropped when the
    backward starts (views still saved keep them alive until their recompute) and by ``reset()``."""

    def __init__(self, slots: int):
        self.slots = int(slots)
        self._buffers: Dict[tuple, List[Any]] = {}  # key -> [buffer, slots used]
        self._position = 0

    def begin_checkpoint(self) -> None:
        self._position = 0

    def store(self, piece: torch.Tensor) -> torch.Tensor:
        key = (self._position, piece.dtype, piece.numel(), piece.device)
        self._position += 1
        entry = self._buffers.get(key)
        if entry is None:
            entry = self._buffers[key] = [torch.empty((self.slots, piece.numel()), dtype=piece.dtype,
                                                      device=piece.device, pin_memory=_pin(piece.device)), 0]
        buf, used = entry
        if used >= self.slots:
            raise ConfigError(
                f"activation checkpointing: more than number_checkpoints={self.slots} checkpoints in one forward "
                f"(contiguous_memory_optimization has one slot per checkpoint); set "
                f"activation_checkpointing.number_checkpoints to the number of checkpointed blocks, or call "
                f"shardspeed.checkpointing.reset() between forwards that have no backward")
        entry[1] = used + 1
        slot = buf[used]
        slot.copy_(piece.reshape(-1), non_blocking=True)
        return slot

    def release(self) -> None:
        self._buffers.clear()

    def allocated_bytes(self) -> int:
        return sum(b.numel() * b.element_size() for b, _ in self._buffers.values())


def _pin(device: torch.device) -> bool:
    return device.type == "cpu" and torch.cuda.is_available()


def _eligible(t: torch.Tensor, world: int) -> bool:
    """DeepSpeed's ``is_activation_to_checkpoint``: floating-point activations (not parameters), at least one
    element per rank, not marked ``no_checkpointing``."""
    return (t.is_floating_point() and not isinstance(t, nn.Parameter) and t.numel() >= world
            and not getattr(t, "no_checkpointing", False))


class SavedInputs:
    """The saved-tensor hooks of the checkpoints under one `CheckpointSettings` (see the module doc).

    ``comm``: the collectives of the tensor-parallel group (None or a group of one: nothing is split)."""

    def __init__(self, settings: CheckpointSettings, comm: Optional[Collectives] = None):
        self.settings = settings
        self.comm = comm if comm is not None and comm.world > 1 else None
        self.world = self.comm.world if self.comm is not None else 1
        self.rank = self.comm.topology.shard_rank if self.comm is not None else 0
        self.partition = settings.partition_activations and self.comm is not None
        self.to_host = settings.cpu_checkpointing
        self.contiguous = (ContiguousBuffers(int(settings.number_checkpoints or 1))
                           if settings.contiguous_memory_optimization else None)
        self._told_host = False

    @property
    def active(self) -> bool:
        """Whether the hooks change anything (else the checkpoint runs without them)."""
        return self.partition or self.to_host or self.contiguous is not None

    def hooks(self) -> ContextManager:
        if not self.active:
            return contextlib.nullcontext()
        if self.contiguous is not None:
            self.contiguous.begin_checkpoint()
        return torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack)

    def pack(self, t: torch.Tensor) -> Any:
        if not _eligible(t, self.world):
            return t
        flat = t.detach().reshape(-1)
        if self.partition:
            start, length, chunk = partition_span(flat.numel(), self.world, self.rank)
            piece = flat.new_zeros(chunk)
            piece[:length].copy_(flat[start:start + length])
        else:
            piece = flat
        if self.contiguous is not None:
            piece = self.contiguous.store(piece if not self.to_host else self._host(piece))
        elif self.to_host:
            piece = self._host(piece)
        return _Packed(piece, t.shape, t.device, self.partition)

    def _host(self, piece: torch.Tensor) -> torch.Tensor:
        if piece.device.type == "cpu":
            if not self._told_host:
                self._told_host = True
                logger.info("cpu_checkpointing: the device is the CPU, so checkpointed activations are in host "
                            "memory already; nothing is copied")
            return piece
        host = torch.empty(piece.shape, dtype=piece.dtype, pin_memory=torch.cuda.is_available())
        host.copy_(piece, non_blocking=True)  # the stream keeps its order: the recompute copies it back after
        return host

    def unpack(self, packed: Any) -> torch.Tensor:
        if not isinstance(packed, _Packed):
            return packed
        if self.contiguous is not None:
            self.contiguous.release()  # the backward has started: the next forward takes fresh buffers
        piece = packed.piece.to(packed.device, non_blocking=True)
        numel = packed.shape.numel()
        if not packed.partitioned:
            return piece.view(packed.shape)
        assert self.comm is not None
        full = torch.empty(piece.numel() * self.world, dtype=piece.dtype, device=packed.device)
        self.comm.all_gather(full, piece.contiguous())  # every rank of the group recomputes the same block
        return full[:numel].view(packed.shape)
