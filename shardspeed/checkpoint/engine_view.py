"""What a checkpoint needs from a running engine, in one place (the only module that reads its internals).

A trainable parameter lives in a :class:`~shardspeed.zero.unit.FlatParamUnit`; this rank owns the
:class:`~shardspeed.zero.layout.Piece` of it that falls in its chunk, whose fp32 master slice is also the
tensor the optimizer keys its state on. Everything else in the module (frozen parameters, persistent
buffers) is held whole by every rank and saved by rank 0.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist
import torch.nn as nn

from ..errors import CheckpointError


@dataclass
class OwnedPiece:
    name: str  # the parameter's fully-qualified name (tied parameters: their first name)
    start: int  # range of the flattened parameter
    end: int
    master: torch.Tensor  # fp32 view into the master chunk; the optimizer's key for this piece
    group: int  # the user's parameter-group index this piece belongs to


@dataclass
class OffloadedPiece:
    name: str  # as OwnedPiece
    start: int
    end: int
    segment: Any  # shardspeed.offload.master.StateSegment: where the state is in the offload store


@dataclass
class UnitParamInfo:
    name: str
    shape: Tuple[int, ...]


class EngineView:
    def __init__(self, engine):
        p = engine._p
        self.engine = engine
        self.parts = p
        self.module: nn.Module = p.module
        self.master = p.master
        self.units = list(p.master.units)
        self.optimizer = p.master.optimizer
        self.rank = p.topology.dp_rank
        self.world = p.topology.dp_size
        self.group = p.topology.dp_group
        self.zero_stage = p.zero_stage
        self.train_dtype = p.train_dtype
        self.names: Dict[int, str] = {}
        self.aliases: Dict[str, str] = {}
        for name, prm in self.module.named_parameters(remove_duplicate=False):
            first = self.names.setdefault(id(prm), name)
            if first != name:
                self.aliases[name] = first
        self._in_units = {id(prm) for u in self.units for prm in u.params}

    # ---- offloaded optimizer state (offload_optimizer with Adam/AdamW: the tiled path) -----------------
    @property
    def offloaded(self) -> bool:
        """Masters and Adam moments live in the offload store (host memory or NVMe files), by tile, not in
        ``optimizer.state``; checkpoints then go through :meth:`offloaded_pieces` and the store."""
        return bool(getattr(self.master, "tiled", False))

    def offloaded_pieces(self) -> List[OffloadedPiece]:
        """Every (trainable piece ∩ tile) of this rank, in tile order (offloaded engines only)."""
        out = []
        for seg in self.master.state_segments():
            u = self.units[seg.tile.unit]
            out.append(OffloadedPiece(self.names[id(u.params[seg.piece.param_index])], seg.param_start,
                                      seg.param_end, seg))
        return out

    @property
    def optimizer_steps(self) -> int:
        """Adam's step count of the offloaded state (one for every piece)."""
        return int(self.master.step_count)

    @optimizer_steps.setter
    def optimizer_steps(self, n: int) -> None:
        self.master.step_count = int(n)

    # ---- collectives on Python objects (small; gloo and NCCL both do these) --------------------------
    @property
    def distributed(self) -> bool:
        return dist.is_available() and dist.is_initialized() and self.world > 1

    def barrier(self) -> None:
        if self.distributed:
            dist.barrier(group=self.group)

    def all_gather_object(self, obj: Any) -> List[Any]:
        if not self.distributed:
            return [obj]
        out: List[Any] = [None] * self.world
        dist.all_gather_object(out, obj, group=self.group)
        return out

    def broadcast_object(self, obj: Any) -> Any:
        if not self.distributed:
            return obj
        box = [obj]
        src = dist.get_global_rank(self.group, 0) if self.group is not None else 0
        dist.broadcast_object_list(box, src=src, group=self.group)
        return box[0]

    def agree(self, error: Optional[str]) -> None:
        """Raise the same CheckpointError on every rank if any rank failed (so none waits in a collective)."""
        errors = self.all_gather_object(error)
        bad = [(r, e) for r, e in enumerate(errors) if e]
        if bad:
            if len(bad) == 1 or all(e == bad[0][1] for _, e in bad):
                raise CheckpointError(bad[0][1])
            raise CheckpointError("; ".join(f"rank {r}: {e}" for r, e in bad))

    # ---- what the model holds ---------------------------------------------------------------------
    def _trainable_pieces(self, ui: int, unit) -> list:
        tp = getattr(self.master, "trainable_pieces", None)
        return list(tp[ui]) if tp is not None else list(unit.pieces)

    def unit_params(self) -> List[Tuple[str, Tuple[int, ...], bool]]:
        """(name, shape, trainable) of every parameter held in flat units (all ranks agree on these)."""
        out = []
        for u in self.units:
            for prm, shape in zip(u.params, u.shapes):
                out.append((self.names[id(prm)], tuple(shape), bool(prm.requires_grad)))
        return out

    def pieces(self) -> List[List[OwnedPiece]]:
        """Per unit, the trainable pieces this rank holds in its master chunk (at stage 0: all of them)."""
        group_of_view = {}
        for gi, g in zip(self.master.group_indices, self.optimizer.param_groups):
            for t in g["params"]:
                group_of_view[id(t)] = gi
        out = []
        for ui, (u, views) in enumerate(zip(self.units, self.master.piece_tensors)):
            out.append([
                OwnedPiece(self.names[id(u.params[pc.param_index])], pc.param_start, pc.param_end, v,
                           group_of_view.get(id(v), 0))
                for pc, v in zip(self._trainable_pieces(ui, u), views)
            ])
        return out

    def frozen_pieces(self) -> List[List[Tuple[str, int, int, torch.Tensor]]]:
        """Per unit, (name, start, end, view of the low-precision shard) of pieces of frozen parameters that
        live in units (stage 3 shards every parameter; stages 0-2 put only trainable ones in units)."""
        out: List[List[Tuple[str, int, int, torch.Tensor]]] = []
        for ui, u in enumerate(self.units):
            trainable = {(pc.param_index, pc.param_start) for pc in self._trainable_pieces(ui, u)}
            frozen = [pc for pc in u.pieces if (pc.param_index, pc.param_start) not in trainable]
            if not frozen:
                out.append([])
                continue
            shard = u.shard  # offload_param nvme: one read; store_frozen writes it back
            out.append([(self.names[id(u.params[pc.param_index])], pc.param_start, pc.param_end,
                         shard[pc.chunk_start : pc.chunk_start + pc.numel]) for pc in frozen])
        return out

    @staticmethod
    def store_frozen(unit, views) -> None:
        """After loading into the views of :meth:`frozen_pieces`: with offload_param nvme they are views of
        a copy read from the file, written back here (elsewhere they are the shard itself: nothing to do)."""
        if unit.placement.in_file and views:
            unit.write_shard(views[0]._base if views[0]._base is not None else views[0])

    def writes_unit(self, unit) -> bool:
        """Whether this rank saves the unit's pieces: every rank its own chunk when sharded, else rank 0."""
        return unit.layout.world > 1 or self.rank == 0

    def other_params(self) -> List[Tuple[str, nn.Parameter]]:
        """Parameters outside the units (frozen, or in no optimizer group), held whole by every rank."""
        seen, out = set(), []
        for name, prm in self.module.named_parameters():
            if id(prm) in self._in_units or id(prm) in seen:
                continue
            seen.add(id(prm))
            out.append((name, prm))
        return out

    def buffers(self) -> List[Tuple[str, torch.Tensor]]:
        """Persistent buffers (those in ``state_dict``)."""
        out = []
        for mname, mod in self.module.named_modules():
            for bname, buf in mod._buffers.items():
                if buf is None or bname in mod._non_persistent_buffers_set:
                    continue
                out.append((f"{mname}.{bname}" if mname else bname, buf))
        return out

    def write_back_masters(self) -> None:
        """Masters → low-precision chunks → all-gather full units (stages 1-2), as after an optimizer step.

        (The gather is sliced on gloo by :class:`~shardspeed.dist.comms.Collectives`, so a load does not
        hold a second copy of the model.)"""
        self.master.sync_params_from_masters()
        manager = self.parts.param_manager
        if manager is not None:  # stage 3: drop gathered copies (persistent ones too); they are stale now
            manager.after_step()

    # ---- the rest of the training state --------------------------------------------------------------
    def counters(self) -> Dict[str, int]:
        e = self.engine
        return {"global_steps": e.global_steps, "global_samples": e.global_samples, "micro_steps": e.micro_steps,
                "skipped_steps": e.skipped_steps}

    def set_counters(self, c: Dict[str, int]) -> None:
        e = self.engine
        e.global_steps = int(c.get("global_steps", 0))
        e.global_samples = int(c.get("global_samples", 0))
        e.micro_steps = int(c.get("micro_steps", 0))
        e.skipped_steps = int(c.get("skipped_steps", 0))

    def dataloader_state(self) -> Dict[str, Any]:
        """The engine's loader: epoch and global sample position when it is resumable (the loader built by
        ``initialize(training_data=...)``), else the sampler's epoch alone."""
        dl = self.engine.training_dataloader
        state: Dict[str, Any] = {"global_samples": self.engine.global_samples}
        if hasattr(dl, "state_dict"):
            state.update(dl.state_dict())
            return state
        sampler = getattr(dl, "sampler", None)
        if sampler is not None and hasattr(sampler, "epoch"):
            state["epoch"] = int(sampler.epoch)
        return state

    def set_dataloader_state(self, state: Dict[str, Any]) -> None:
        dl = self.engine.training_dataloader
        if hasattr(dl, "load_state_dict") and "epoch" in state:
            dl.load_state_dict(state)  # an older checkpoint without "position" starts its epoch
            return
        sampler = getattr(dl, "sampler", None)
        if sampler is not None and "epoch" in state and hasattr(sampler, "set_epoch"):
            sampler.set_epoch(int(state["epoch"]))
