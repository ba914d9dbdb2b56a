"""fp32 master weights of this rank's chunks and the optimizer step over them.

The optimizer never sees model parameters: it sees one tensor per :class:`~.layout.Piece` (the part of a
parameter inside this rank's chunk), a view into the unit's fp32 master chunk. Elementwise optimizers
(Adam, SGD, Lion, ...) therefore behave exactly as on whole parameters; optimizer state is per piece, so
checkpoints can say which parameter elements each state covers.

One step (:meth:`MasterWeights.step`): gradients to fp32 → global norm (one all-reduce of squared
norms, which also carries the fp16 overflow flag) → on overflow skip → unscale and clip in one multiply
→ optimizer step → write the updated chunk back into the low-precision unit → all-gather the units
(stages 1-2; stage 3 keeps shards).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Protocol, Sequence, Tuple

import torch

from ..comm.collectives import Collectives
from ..mesh.replicas import counts_in_norm
from .layout import Piece
from .root import ZeroRoot
from .unit import FlatParamUnit


def trainable_pieces(units: Sequence[FlatParamUnit], group_of_param: Dict[int, int]) -> List[List[Piece]]:
    """Per unit, the pieces the optimizer owns: parameters it was not given (frozen, or left out of
    ``model_parameters``) stay as they are."""
    return [[pc for pc in u.pieces if u.params[pc.param_index].requires_grad
             and id(u.params[pc.param_index]) in group_of_param] for u in units]


def device_master(unit: FlatParamUnit, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The master (fp32, or bf16 with ``bf16_master_weights_and_grads``) of a unit on its device: the shard
    itself when that is device memory of the master's dtype (fp32 training, or bf16 training with bf16 masters:
    updated in place, no copy), else a copy in ``dtype``."""
    if unit.dtype == dtype and unit.placement.on_device:
        return unit.shard
    return unit.shard.detach().to(device=unit.device, dtype=dtype, copy=True)


def _counted_ranges(numel: int, skipped: List[Tuple[int, int]]) -> Optional[List[Tuple[int, int]]]:
    """The [start, end) ranges of a chunk of ``numel`` elements outside the ``skipped`` (start, numel)
    pieces; None when nothing is skipped (the whole chunk counts)."""
    if not skipped:
        return None
    out, at = [], 0
    for start, n in sorted(skipped):
        if start > at:
            out.append((at, start))
        at = max(at, start + n)
    if at < numel:
        out.append((at, numel))
    return out


def clip_factor(norm: float, clip: float, sharded: bool) -> float:
    """The factor (<= 1) that clips gradients of global norm ``norm`` to ``clip``, rounded as DeepSpeed rounds
    it, in fp32 arithmetic: ZeRO 0 ``clip / (norm + 1e-6)``; ZeRO 1-3 the reciprocal of ``(norm + 1e-6) / clip``.
    The same factor computed in double differs by an ulp, and so do the clipped gradients."""
    shifted = torch.tensor(norm, dtype=torch.float32) + 1e-6
    if not sharded:
        return min(1.0, float(torch.tensor(clip, dtype=torch.float32) / shifted))
    return float(1.0 / torch.clamp(shifted / clip, min=1.0))


def _full(unit: FlatParamUnit) -> torch.Tensor:
    """The full buffer of a stage 1-2 unit (always held there)."""
    assert unit.full is not None, f"unit {unit.index} has no full buffer"
    return unit.full


class UpdateClipping(Protocol):
    """An optimizer stepped once over every unit that takes the gradient norm over its own updates and clips
    them (Muon at ZeRO 1-3, as DeepSpeed does it: :class:`~shardspeed.optim.muon.MuonWithAuxAdam`)."""

    update_norm: float

    def clip_updates_to(self, clip: float) -> None: ...


@dataclass
class StepResult:
    overflow: bool
    grad_norm: float  # global norm of the unscaled gradients, before clipping (nan/inf on overflow)


class MasterWeights:
    """Master chunks, the optimizer over their pieces, and the step that keeps units in sync."""

    def __init__(
        self,
        units: Sequence[FlatParamUnit],
        reducer: ZeroRoot,
        collectives: Collectives,
        group_of_param: Dict[int, int],
        make_optimizer: Callable[[List[dict]], torch.optim.Optimizer],
        *,
        sharded: bool,
        gather_after_step: bool,
        check_overflow: bool,
        make_master: Optional[Callable[[int, FlatParamUnit], Optional[torch.Tensor]]] = None,
        master_dtype: torch.dtype = torch.float32,
    ):
        """``make_master(unit_index, unit)``: the master chunk of a unit with trainable pieces, or None
        where it is kept elsewhere (then the optimizer gets placeholder pieces); default
        :func:`device_master` in ``master_dtype`` (fp32, or bf16: the optimizer's states follow its dtype)."""
        self.units = list(units)
        self.reducer = reducer
        self.comm = collectives
        self.sharded = sharded  # gradients are partitioned: norms need an all-reduce
        self.gather_after_step = gather_after_step
        self.check_overflow = check_overflow
        self.master_dtype = master_dtype
        #: the dtype of Adam's moments where this object keeps them itself (the offload stores); on the device the
        #: optimizer's own states follow the master's dtype
        self.state_dtype = master_dtype
        make_master = make_master or (lambda ui, unit: device_master(unit, master_dtype))
        self.masters: List[Optional[torch.Tensor]] = []
        self.piece_tensors: List[List[torch.Tensor]] = []
        groups: Dict[int, List[torch.Tensor]] = {}
        self.trainable_pieces = trainable_pieces(self.units, group_of_param)
        for ui, (unit, pieces) in enumerate(zip(self.units, self.trainable_pieces)):
            if not pieces:  # e.g. a stage-3 unit of frozen parameters: nothing to optimise
                self.masters.append(None)
                self.piece_tensors.append([])
                continue
            master = make_master(ui, unit)
            self.masters.append(master)
            views = []
            for piece in pieces:
                view = (master[piece.chunk_start : piece.chunk_start + piece.numel] if master is not None
                        else torch.empty(piece.numel, dtype=master_dtype, device="meta"))
                views.append(view)
                groups.setdefault(group_of_param[id(unit.params[piece.param_index])], []).append(view)
            self.piece_tensors.append(views)
        model_rank = collectives.topology.model_rank
        #: per unit, the [start, end) ranges of this rank's chunk that count in the global norm, or None for the
        #: whole chunk: pieces whose parameter another model-parallel rank counts are left out
        #: (:mod:`shardspeed.mesh.replicas`)
        self.norm_ranges: List[Optional[List[Tuple[int, int]]]] = [
            _counted_ranges(u.layout.chunk_size, [(pc.chunk_start, pc.numel) for pc in u.pieces
                                              if not counts_in_norm(u.params[pc.param_index], model_rank)])
            for u in self.units
        ]
        # every rank's optimizer has every group, so that its groups line up with the other ranks' (LR schedules,
        # checkpoints): a group of which this rank owns no element (a LoRA adapter smaller than the world, or
        # a rank with no trainable element at all) holds one empty placeholder tensor, which never has a grad
        for gi in {group_of_param[id(u.params[pi])] for u in self.units for pi in u.grad_params
                   if id(u.params[pi]) in group_of_param} - set(groups):
            groups[gi] = [torch.zeros(0, dtype=master_dtype, device=self.units[0].device)]
        self.group_indices = sorted(groups)
        self.optimizer = make_optimizer([{"params": groups[i], "_group": i} for i in self.group_indices])
        #: set by the builder (:meth:`step_over_updates`): the optimizer steps every unit in one call and, when
        #: sharded, clips its own updates
        self.update_clipping: Optional[UpdateClipping] = None

    def step_over_updates(self, optimizer: UpdateClipping) -> None:
        """The builder's decision: ``optimizer`` (this object's own) exchanges across units in its step, so it
        is stepped once over all of them; at ZeRO 1-3 the gradient norm and clipping are over its updates."""
        self.update_clipping = optimizer

    # ---- what a checkpoint needs (typed; see shardspeed.checkpoint.engine_view) -------------------
    @property
    def is_tiled(self) -> bool:
        """Whether masters and optimizer moments live in an offload store by tile rather than in the
        masters and ``optimizer.state`` (:class:`~shardspeed.offload.master.OffloadedMasterWeights` with
        Adam); a checkpoint then reads and writes them through that class's segment methods."""
        return False

    def owned_pieces(self, unit_index: int) -> List[Piece]:
        """The pieces of unit ``unit_index`` the optimizer owns on this rank, in the order of
        ``piece_tensors[unit_index]`` (pieces of frozen parameters, or of parameters the optimizer was not
        given, are left out)."""
        return list(self.trainable_pieces[unit_index])

    # ------------------------------------------------------------------------------------------
    def _fp32_grads(self) -> List[Optional[torch.Tensor]]:
        out: List[Optional[torch.Tensor]] = []
        for ui, master in enumerate(self.masters):
            if master is None:
                out.append(None)
                continue
            g = self.reducer.grad_shard(ui)
            if g is not None and (g.dtype != master.dtype or g.device != master.device):
                g = g.to(device=master.device, dtype=master.dtype)  # transient copy in the master's dtype
            out.append(g)
        return out

    def global_grad_norm(self, grads: List[Optional[torch.Tensor]]) -> torch.Tensor:
        """L2 norm over the whole model, each parameter once: this rank's chunks (padding is zero) less the
        pieces another model-parallel rank counts, summed in fp32 over the data group when sharded, then over
        the model-parallel group (pipe × model) when there is one. A sync point."""
        sq = torch.zeros((), dtype=torch.float32, device=self.units[0].device if self.units else "cpu")
        # expert units whole on every rank (stage 0): their sum over the data group counts each expert once per
        # rank of its expert-data group; sharded, each rank holds distinct chunks and the sum counts them once
        sq_expert, expert_world = torch.zeros_like(sq), 1
        for u, g, ranges in zip(self.units, grads, self.norm_ranges):
            if g is None:
                continue
            acc = sq
            if u.comm is not None and not self.sharded:
                acc, expert_world = sq_expert, u.comm.world
            g = g if g.dtype == torch.float32 else g.float()
            if ranges is None:
                acc += torch.dot(g, g).to(sq.device) if g.dim() == 1 else g.pow(2).sum().to(sq.device)
                continue
            flat = g.reshape(-1)
            for start, end in ranges:  # views, no copy of the chunk
                acc += torch.dot(flat[start:end], flat[start:end]).to(sq.device)
        if self.sharded:
            self.comm.all_reduce(sq)
        elif any(u.comm is not None for u in self.units):
            self.comm.all_reduce(sq_expert)
            sq += sq_expert / expert_world
        self.comm.all_reduce_model_parallel(sq)
        return sq.sqrt()

    def grad_coefficient(self, grads: List[Optional[torch.Tensor]], loss_scale: float,
                         clip: float) -> Tuple[float, Optional[float]]:
        """(global norm of the unscaled gradients, the one factor that unscales and clips them), the factor
        None on an fp16 overflow (the step is skipped)."""
        norm = float(self.global_grad_norm(grads)) / loss_scale
        if self.check_overflow and not math.isfinite(norm):
            return norm, None
        coef = 1.0 / loss_scale
        if clip > 0:
            coef *= clip_factor(norm, clip, self.sharded)
        return norm, coef

    def step(self, loss_scale: float, clip: float) -> StepResult:
        grads = self._fp32_grads()
        # DeepSpeed's ZeRO 1-3 Muon clips the orthogonalised updates, not the gradients (optim.muon does it)
        over_updates = self.update_clipping if self.sharded else None
        norm, coef = self.grad_coefficient(grads, loss_scale, 0.0 if over_updates is not None else clip)
        if coef is None:
            return StepResult(True, norm)
        if over_updates is not None:
            over_updates.clip_updates_to(clip)
        if self.gather_after_step and len(self.units) > 1 and self.update_clipping is None:
            # unit by unit: the all-gather of one unit runs while the optimizer steps the next (the
            # optimizer skips pieces without .grad, so each call updates exactly one unit's pieces); not for an
            # optimizer that exchanges across units in its step (Muon's whole matrices)
            handles = []
            for ui in range(len(self.units)):
                self._attach_grads(ui, grads[ui], coef)
                self.optimizer.step()
                self._detach_grads(ui)
                self._write_back(ui)
                handles.append(self._comm_of(ui).all_gather(_full(self.units[ui]), self.units[ui].shard,
                                                            async_op=True))
            for h in handles:
                h.wait()
        else:
            for ui in range(len(self.units)):
                self._attach_grads(ui, grads[ui], coef)
            self.optimizer.step()
            for ui in range(len(self.units)):
                self._detach_grads(ui)
            self.sync_params_from_masters()
        return StepResult(False, over_updates.update_norm if over_updates is not None else norm)

    def _comm_of(self, ui: int) -> Collectives:
        """The collectives unit ``ui`` is sharded over (an expert unit's expert-data group, else the data group)."""
        own = self.units[ui].comm
        return own if own is not None else self.comm

    def _attach_grads(self, ui: int, g: Optional[torch.Tensor], coef: float) -> None:
        views = self.piece_tensors[ui]
        if not views:
            return
        if g is None:
            master = self.masters[ui]
            assert master is not None  # a unit with pieces has a master
            g = torch.zeros_like(master)
        if coef != 1.0:
            g.mul_(coef)
        for piece, view in zip(self.trainable_pieces[ui], views):
            view.grad = g[piece.chunk_start : piece.chunk_start + piece.numel]

    def _detach_grads(self, ui: int) -> None:
        for view in self.piece_tensors[ui]:
            view.grad = None

    def _write_back(self, ui: int) -> None:
        """Copy unit ``ui``'s updated master into its low-precision chunk (frozen elements untouched)."""
        unit, master, pieces = self.units[ui], self.masters[ui], self.trainable_pieces[ui]
        if master is None or unit.placement.aliases(master):
            return
        if len(pieces) == len(unit.pieces):
            unit.write_shard(master)
        else:
            for pc in pieces:
                unit.write_shard(master[pc.chunk_start : pc.chunk_start + pc.numel], pc.chunk_start)

    def sync_params_from_masters(self) -> None:
        """Copy updated masters into the low-precision chunks and re-assemble full units."""
        for ui in range(len(self.units)):
            self._write_back(ui)
        self._gather_units()

    def _gather_units(self) -> None:
        """Stages 1-2: all-gather every unit's full buffer from the updated chunks."""
        if self.gather_after_step:
            handles = [self._comm_of(i).all_gather(_full(u), u.shard, async_op=True) for i, u in enumerate(self.units)]
            for h in handles:
                h.wait()

    def refresh_from_shard(self, unit_index: int) -> None:
        """The low-precision chunk was edited from outside (GatheredParameters): copy it into the master."""
        master = self.masters[unit_index]
        unit = self.units[unit_index]
        if master is not None and not unit.placement.aliases(master):
            master.copy_(unit.shard)  # a file placement: read from the file

    def move_masters(self, move: Callable[[torch.Tensor], Optional[torch.Tensor]]) -> None:
        """Re-home each fp32 master that is not its unit's own shard into ``move(master)`` (None: leave it),
        keeping the tensor objects (the optimizer's pieces stay views of it): ``engine.offload_states()``."""
        for ui, (master, unit) in enumerate(zip(self.masters, self.units)):
            if master is None or unit.placement.aliases(master):
                continue
            moved = move(master)
            if moved is None:
                continue
            master.data = moved
            for piece, view in zip(self.trainable_pieces[ui], self.piece_tensors[ui]):
                view.data = master.data[piece.chunk_start : piece.chunk_start + piece.numel]

    def close(self) -> None:
        """Free the units' shard storage that outlives garbage collection (offload_param nvme: delete the
        file) now rather than at exit."""
        for u in self.units:
            u.placement.close()

    def held_bytes(self) -> Dict[str, int]:
        """Bytes of master weights and optimizer state this rank holds (not counting aliases of params)."""
        master = sum(
            m.numel() * m.element_size()
            for m, u in zip(self.masters, self.units)
            if m is not None and not u.placement.aliases(m)
        )
        state = 0
        for st in self.optimizer.state.values():
            for v in st.values():
                if torch.is_tensor(v) and v.dim() > 0:
                    state += v.numel() * v.element_size()
        return {"master": master, "optimizer": state}
