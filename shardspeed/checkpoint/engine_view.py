"""What a checkpoint needs from a running engine, in one place, from the typed parts the engine hands over
(``engine.checkpoint_parts()``, see :mod:`.stateful`).

A trainable parameter lives in a :class:`~shardspeed.zero.unit.FlatParamUnit`; this rank owns the
:class:`~shardspeed.zero.layout.Piece` of it that falls in its chunk, whose fp32 master slice is also the
tensor the optimizer keys its state on. Everything else in the module (frozen parameters, persistent
buffers) is held whole by every rank and saved by rank 0.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Tuple

import torch
import torch.nn as nn

from ..errors import CheckpointError
from ..offload.master import OffloadedMasterWeights
from .slices import Spec, spec_of
from .stateful import CheckpointParts


def raise_agreed(errors: List[Optional[str]]) -> None:
    """Raise one CheckpointError from every rank's error (None: that rank succeeded), if any rank failed:
    called with an all-gather's result, every rank raises the same."""
    bad = [(r, e) for r, e in enumerate(errors) if e]
    if bad:
        if len(bad) == 1 or all(e == bad[0][1] for _, e in bad):
            raise CheckpointError(bad[0][1])
        raise CheckpointError("; ".join(f"rank {r}: {e}" for r, e in bad))


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
    """The checkpoint's view of one engine, built from ``engine.checkpoint_parts()`` (typed parts, no private
    attributes): names of parameters, pieces this rank owns, and the coordination collectives."""

    def __init__(self, engine, op="save_checkpoint/load_checkpoint"):  # (untyped: as before, body unchecked)
        #: what a failed coordination collective most likely means during ``op`` (for its error message)
        self.CAUSE = f"not every rank called {op}: every rank must call {op}, with the same arguments"
        parts: CheckpointParts = engine.checkpoint_parts()
        self.engine = engine
        self.parts = parts
        self.module: nn.Module = parts.module
        self.master = parts.master
        self.units = list(parts.master.units)
        self.optimizer = parts.master.optimizer
        self.comm = parts.collectives  # the data-parallel group: gathers of sharded units
        self.coord = parts.coordination or parts.collectives  # coordination: the group that writes one checkpoint
        self.rank = parts.rank
        self.world = parts.world
        self.data_rank = parts.data_rank
        self.zero_stage = parts.zero_stage
        self.train_dtype = parts.train_dtype
        #: the dtype of the master weights (bf16 with bf16_master_weights_and_grads, else fp32)
        self.master_dtype: torch.dtype = parts.master.master_dtype
        #: the dtype of Adam's moments in the offload stores (fp32 beside bf16 masters without bf16_optimizer_states)
        self.state_dtype: torch.dtype = parts.master.state_dtype
        # the offload stores (offload_optimizer with Adam/AdamW: the tiled path), else None
        self.tiled: Optional[OffloadedMasterWeights] = (
            parts.master if isinstance(parts.master, OffloadedMasterWeights) and parts.master.is_tiled else None)
        self.names: Dict[int, str] = {}
        self.aliases: Dict[str, str] = {}
        for name, prm in self.module.named_parameters(remove_duplicate=False):
            first = self.names.setdefault(id(prm), name)
            if first != name:
                self.aliases[name] = first
        self._in_units = {id(prm) for u in self.units for prm in u.params}
        from ..mesh.replicas import counts_in_norm

        # copies of parameters another rank saves (a tied layer on a later pipeline stage)
        self._replicas = {id(prm) for prm in self.module.parameters() if not counts_in_norm(prm, 0)}
        #: every rank's parameter and buffer names (a pipeline stage holds only its own layers)
        self.model_names: Optional[set] = None
        if parts.coordination is not None:
            mine = [n for n, _ in self.module.named_parameters()] + [n for n, _ in self.buffers()]
            self.model_names = set().union(*map(set, self.all_gather_object(mine)))
        self._tensor_parallel()

    # ---- tensor parallelism: slices are saved by their place in the full tensor ----------------------
    def _tensor_parallel(self) -> None:
        """Which parameters are tensor-parallel slices (``tp_slice``, see :mod:`shardspeed.parallel.tp.slicing`)
        and which copies this rank leaves to another (a replicated parameter is saved by model rank 0)."""
        self.model_rank = self.comm.topology.model_rank
        self.slices: Dict[str, Any] = {}  # name -> TPSlice
        for prm in self.module.parameters():
            sl = getattr(prm, "tp_slice", None)
            if sl is not None and id(prm) in self.names:
                self.slices[self.names[id(prm)]] = sl

    def spec(self, name: str) -> Spec:
        """The tensor-parallel slice ``name`` is on this rank (``Entry.tp``), None for a whole tensor."""
        return spec_of(self.slices.get(name))

    def full_shape(self, name: str, shape: Tuple[int, ...]) -> Tuple[int, ...]:
        sl = self.slices.get(name)
        return tuple(sl.full_shape) if sl is not None else tuple(shape)

    def writes_param(self, name: str) -> bool:
        """Whether this rank's copy of ``name`` goes into the checkpoint: a slice always, a replicated
        parameter only on model rank 0 (saved once)."""
        return name in self.slices or self.model_rank == 0

    # ---- offloaded optimizer state (offload_optimizer with Adam/AdamW: the tiled path) -----------------
    @property
    def offloaded(self) -> bool:
        """Masters and Adam moments live in the offload store (host memory or NVMe files), by tile, not in
        ``optimizer.state``; checkpoints then go through :meth:`offloaded_pieces` and the store."""
        return self.tiled is not None

    def tiled_master(self) -> OffloadedMasterWeights:
        if self.tiled is None:
            raise CheckpointError("internal error: offloaded state asked of an engine without an offload store")
        return self.tiled

    def offloaded_pieces(self) -> List[OffloadedPiece]:
        """Every (trainable piece ∩ tile) of this rank, in tile order (offloaded engines only)."""
        out = []
        for seg in self.tiled_master().state_segments():
            u = self.units[seg.tile.unit]
            out.append(OffloadedPiece(self.names[id(u.params[seg.piece.param_index])], seg.param_start,
                                      seg.param_end, seg))
        return out

    @property
    def optimizer_steps(self) -> int:
        """Adam's step count of the offloaded state (one for every piece)."""
        return int(self.tiled_master().step_count)

    @optimizer_steps.setter
    def optimizer_steps(self, n: int) -> None:
        self.tiled_master().step_count = int(n)

    # ---- coordination (small object collectives through Collectives: logged, errors named) -----------
    def barrier(self) -> None:
        self.coord.barrier(cause=self.CAUSE)

    def all_gather_object(self, obj: Any) -> List[Any]:
        return self.coord.all_gather_object(obj, cause=self.CAUSE)

    def broadcast_object(self, obj: Any) -> Any:
        return self.coord.broadcast_object(obj, 0, cause=self.CAUSE)

    def agree(self, error: Optional[str]) -> None:
        """Raise the same CheckpointError on every rank if any rank failed (so none waits in a collective)."""
        raise_agreed(self.all_gather_object(error))

    # ---- what the model holds ---------------------------------------------------------------------
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
                for pc, v in zip(self.master.owned_pieces(ui), views)
            ])
        return out

    def frozen_pieces(self) -> List[List[Tuple[str, int, int, torch.Tensor]]]:
        """Per unit, (name, start, end, view of the low-precision shard) of pieces of frozen parameters that
        live in units (stage 3 shards every parameter; stages 0-2 put only trainable ones in units)."""
        out: List[List[Tuple[str, int, int, torch.Tensor]]] = []
        for ui, u in enumerate(self.units):
            trainable = {(pc.param_index, pc.param_start) for pc in self.master.owned_pieces(ui)}
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
        """Whether this rank saves the unit's pieces: every rank its own chunk when sharded, else data rank 0;
        never a unit of replicas (another stage saves those parameters)."""
        if all(id(p) in self._replicas for p in unit.params):
            return False
        if unit.comm is not None:  # an expert unit: its expert-data group's first rank (entries keyed by expert id)
            return unit.layout.world > 1 or unit.comm.topology.shard_rank == 0
        return unit.layout.world > 1 or self.data_rank == 0

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

        (On gloo :class:`~shardspeed.comm.collectives.Collectives` gathers large pieces by broadcasts, so a load does not
        hold a second copy of the model.)"""
        self.master.sync_params_from_masters()
        manager = self.parts.param_manager
        if manager is not None:  # stage 3: drop gathered copies (persistent ones too); they are stale now
            manager.after_step()

    # ---- the rest of the training state: Stateful parts -------------------------------------------------
    def common_state(self) -> Dict[str, Any]:
        """The small state rank 0 saves in ``common.pt`` (the client's state is added by the caller)."""
        p = self.parts
        return {
            "lr_scheduler": p.lr_scheduler.state_dict() if p.lr_scheduler is not None else None,
            "loss_scaler": p.loss_scaler.state_dict() if p.loss_scaler is not None else None,
            "counters": p.counters.state_dict(),
            "dataloader": p.dataloader.state_dict(),
        }

    def load_common_state(self, common: Dict[str, Any], lr_scheduler: bool = True) -> None:
        p = self.parts
        if lr_scheduler and p.lr_scheduler is not None and common.get("lr_scheduler") is not None:
            p.lr_scheduler.load_state_dict(common["lr_scheduler"])
        if p.loss_scaler is not None and common.get("loss_scaler") is not None:
            p.loss_scaler.load_state_dict(common["loss_scaler"])
        p.counters.load_state_dict(common.get("counters", {}))
        p.dataloader.load_state_dict(common.get("dataloader", {}))
