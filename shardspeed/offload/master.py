"""Master weights and optimizer state off the device: the offloaded optimizer step.

:class:`OffloadedMasterWeights` is a :class:`~shardspeed.zero.master.MasterWeights` whose master chunks
and optimizer state live in host memory (``device: cpu``) or in files (``device: nvme``); units beyond
``ratio`` keep theirs on the device. One step:

1. global gradient norm on the device from the reduced gradient chunks (one all-reduce; it carries the
   fp16 overflow flag: on overflow nothing leaves the device and the step is skipped);
2. for each tile (:mod:`.tiles`) in order: the gradient tile is copied to a host buffer (the copy of tile
   k+1 is issued before tile k steps), unscaled and clipped in one multiply, the state is taken from the
   store (NVMe: already read by the reader thread), the fused Adam kernel steps, the updated tile is
   copied back into the unit's low-precision shard, and the state is released (NVMe: written back by the
   writer thread);
3. all-gather the units (stages 1-2), as without offload.

Adam/AdamW (without amsgrad) use this tiled path; any other optimizer with ``device: cpu`` takes the
generic path of the base class (torch's optimizer over host views of the masters, whole step at once).
NVMe needs Adam/AdamW. The engine's ``optimizer`` is a real torch optimizer over the host master pieces
(placeholders for NVMe) that holds the param groups the LR schedule changes; in the tiled path its
``state`` stays empty: the moments live in the store.
"""
from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Sequence

import torch

from ..dist.comms import Collectives
from ..errors import ConfigError
from ..zero.layout import Piece
from ..zero.master import MasterWeights, StepResult, trainable_pieces
from ..zero.reducer import GradientReducer
from ..zero.unit import FlatParamUnit
from .cpu_adam import adam_step, hyper_of, is_adam_family
from .store import MemoryStateStore, NvmeStateStore, TileState
from .tiles import Tile, plan_tiles, split_by_ratio
from .transfer import HostCopier

logger = logging.getLogger("shardspeed")


@dataclass(frozen=True)
class StateSegment:
    """The part of one trainable piece that lies in one tile: the unit of an offloaded state in a
    checkpoint (an entry never spans two tiles, so saving and loading touch one tile at a time)."""

    tile: Tile
    on_host: bool  # the tile's store: host/NVMe (True) or the device (units kept there by ``ratio``)
    piece: Piece
    lo: int  # range inside the unit's chunk
    hi: int

    @property
    def param_start(self) -> int:
        return self.piece.param_start + self.lo - self.piece.chunk_start

    @property
    def param_end(self) -> int:
        return self.param_start + self.hi - self.lo


@dataclass(frozen=True)
class OffloadPlan:
    """What the builder decided from ``offload_optimizer`` (and ``sub_group_size``)."""

    device: str  # "cpu" | "nvme"
    nvme_path: Optional[str] = None
    buffer_count: int = 4
    pin_memory: bool = True
    ratio: float = 1.0
    tile_elems: int = 100_000_000  # elements per tile (sub_group_size)
    threads: int = 1  # chunks stepped in parallel per tile (1: the kernel's own threading)


class OffloadedMasterWeights(MasterWeights):
    def __init__(
        self,
        units: Sequence[FlatParamUnit],
        reducer: GradientReducer,
        collectives: Collectives,
        group_of_param: Dict[int, int],
        make_optimizer: Callable[[List[dict]], torch.optim.Optimizer],
        *,
        sharded: bool,
        gather_after_step: bool,
        check_overflow: bool,
        plan: OffloadPlan,
    ):
        if plan.device not in ("cpu", "nvme"):
            raise ConfigError(f"offload device must be 'cpu' or 'nvme', got {plan.device!r}")
        self._bind(units, reducer, collectives, sharded, gather_after_step, check_overflow)
        self.plan = plan
        self.step_count = 0

        # the pieces the optimizer owns (a stage-3 unit may hold frozen ones: never stepped)
        self.trainable_pieces = trainable_pieces(self.units, group_of_param)
        # the param groups with elements in this rank's chunks, as the base class builds them
        group_ids = sorted({group_of_param[id(u.params[pc.param_index])]
                            for u, tp in zip(self.units, self.trainable_pieces) for pc in tp})
        pos = {g: i for i, g in enumerate(group_ids)}
        unit_pieces = [[(pc.chunk_start, pc.numel, pos[group_of_param[id(u.params[pc.param_index])]])
                        for pc in tp] for u, tp in zip(self.units, self.trainable_pieces)]
        chunk = [u.layout.chunk_size for u in self.units]
        self.host_units, self.device_units = split_by_ratio(chunk, plan.ratio)
        on_host = set(self.host_units)
        nvme = plan.device == "nvme"
        pin = plan.pin_memory and torch.cuda.is_available()

        # masters: host (cpu), none (nvme: in files), device (units kept there by ratio)
        self.masters: List[Optional[torch.Tensor]] = []
        for ui, unit in enumerate(self.units):
            if not self.trainable_pieces[ui]:
                m = None  # nothing to optimise in this unit
            elif ui in on_host:
                m = None if nvme else torch.empty(unit.shard.numel(), dtype=torch.float32, pin_memory=pin)
                if m is not None:
                    m.copy_(unit.shard)
            elif unit.dtype == torch.float32 and unit.placement.on_device:
                m = unit.shard  # as without offload: fp32 training updates the shard in place
            else:
                m = unit.shard.detach().to(device=unit.device, dtype=torch.float32, copy=True)
            self.masters.append(m)

        # the engine's optimizer: param groups over the master pieces (placeholders where none in memory)
        self.piece_tensors: List[List[torch.Tensor]] = []
        groups: Dict[int, List[torch.Tensor]] = {}
        for unit, master, pieces in zip(self.units, self.masters, self.trainable_pieces):
            views = []
            for pc in pieces:
                v = (master[pc.chunk_start : pc.chunk_start + pc.numel] if master is not None
                     else torch.empty(pc.numel, dtype=torch.float32, device="meta"))
                views.append(v)
                groups.setdefault(group_of_param[id(unit.params[pc.param_index])], []).append(v)
            self.piece_tensors.append(views)
        self.group_indices = group_ids
        self.optimizer = make_optimizer([{"params": groups[i], "_group": i} for i in group_ids])

        self.tiled = is_adam_family(self.optimizer)
        if not self.tiled and nvme:
            raise ConfigError(f"offload_optimizer device 'nvme' supports Adam and AdamW (without amsgrad); the "
                              f"optimizer is {type(self.optimizer).__name__}: use device 'cpu' or an Adam optimizer")
        self.host_tiles: List[Tile] = []
        self.device_tiles: List[Tile] = []
        self.host_store = None
        self.device_store = None
        self.copier: Optional[HostCopier] = None
        if not self.tiled:
            logger.info("offload: %s is stepped by torch on the host (generic path)", type(self.optimizer).__name__)
            return
        self.host_tiles = plan_tiles(unit_pieces, plan.tile_elems, self.host_units)
        self.device_tiles = plan_tiles(unit_pieces, plan.tile_elems, self.device_units)
        if nvme:
            rank = self.units[0].rank if self.units else 0
            self.host_store = NvmeStateStore(plan.nvme_path, self.host_tiles, plan.buffer_count, plan.pin_memory,
                                             rank)
            shard, shard_unit = None, None  # read each unit's shard once (offload_param nvme: from its file)
            for t in self.host_tiles:
                if t.unit != shard_unit:
                    shard, shard_unit = self.units[t.unit].shard, t.unit
                self.host_store.initialize(t, shard[t.lo : t.hi])
        else:
            self.host_store = MemoryStateStore({u: self.masters[u] for u in self.host_units
                                                if self.masters[u] is not None})
        self.device_store = MemoryStateStore({u: self.masters[u] for u in self.device_units
                                              if self.masters[u] is not None})
        dev = self.units[0].device if self.units else torch.device("cpu")
        max_tile = max((t.numel for t in self.host_tiles), default=0)
        self.copier = HostCopier(dev, self.units[0].dtype if self.units else torch.float32, max_tile,
                                 plan.pin_memory)
        self._host_step = torch.zeros((), dtype=torch.float32)
        self._device_step = torch.zeros((), dtype=torch.float32, device=dev)

    # ---- the step ------------------------------------------------------------------------------------
    def _device_grad_norm(self, grads: List[Optional[torch.Tensor]]) -> torch.Tensor:
        """Global L2 norm from the device gradient chunks (as the base computes it); a sync point."""
        sq = torch.zeros((), dtype=torch.float32, device=self.units[0].device if self.units else "cpu")
        for g in grads:
            if g is not None:
                gf = g if g.dtype == torch.float32 else g.float()
                sq += torch.dot(gf, gf).to(sq.device)
        if self.sharded:
            self.comm.all_reduce(sq)
        return sq.sqrt()

    def step(self, loss_scale: float, clip: float) -> StepResult:
        if not self.tiled:
            return super().step(loss_scale, clip)
        grads = [self.reducer.grad_shard(i) for i in range(len(self.units))]
        norm = float(self._device_grad_norm(grads)) / loss_scale
        if self.check_overflow and not math.isfinite(norm):
            return StepResult(True, norm)  # nothing was copied; the host step is skipped
        coef = 1.0 / loss_scale
        if clip > 0:
            coef *= min(1.0, clip / (norm + 1e-6))
        self.step_count += 1
        self._host_step.fill_(self.step_count)
        self._device_step.fill_(self.step_count)
        hyper = [hyper_of(self.optimizer, g) for g in self.optimizer.param_groups]
        self._step_device_tiles(grads, coef, hyper)
        self._step_host_tiles(grads, coef, hyper)
        if self.gather_after_step:
            handles = [self.comm.all_gather(u.full, u.shard, async_op=True) for u in self.units]
            for h in handles:
                h.wait()
        return StepResult(False, norm)

    def _step_device_tiles(self, grads, coef: float, hyper) -> None:
        for t, st in self.device_store.stream(self.device_tiles):
            g = grads[t.unit]
            g = torch.zeros_like(st.master) if g is None else g[t.lo : t.hi].to(torch.float32)
            if coef != 1.0:
                g.mul_(coef)
            adam_step(st.master, g, st.exp_avg, st.exp_avg_sq, self._device_step, hyper[t.group])
            unit = self.units[t.unit]
            if not unit.placement.aliases(st.master):  # fp32 on the device: the master is the shard
                unit.write_shard(st.master, t.lo)

    def _step_host_tiles(self, grads, coef: float, hyper) -> None:
        tiles, store, cp = self.host_tiles, self.host_store, self.copier
        if not tiles:
            return

        def fetch(k: int):
            t = tiles[k]
            g = grads[t.unit]
            return cp.grad_to_host(k % 2, None if g is None else g[t.lo : t.hi], t.numel)

        cp.begin()
        try:
            nxt = fetch(0)
            for k, (t, st) in enumerate(store.stream(tiles)):
                g, ev = nxt
                if ev is not None:
                    ev.synchronize()  # host waits for this tile's gradient (its copy overlapped tile k-1)
                if k + 1 < len(tiles):
                    nxt = fetch(k + 1)
                if coef != 1.0:
                    g.mul_(coef)
                adam_step(st.master, g, st.exp_avg, st.exp_avg_sq, self._host_step, hyper[t.group],
                          self.plan.threads)
                unit = self.units[t.unit]
                if unit.placement.in_file:  # offload_param nvme: the tile, cast, goes into the parameter file
                    unit.write_shard(st.master, t.lo)
                    done = None
                else:  # into the shard's memory (device or host), asynchronously where a copy stream exists
                    done = cp.to_device(k % 2, unit.shard[t.lo : t.hi], st.master)
                store.release(t, st, done)
            store.flush()
        except BaseException:
            store.abandon()
            raise
        finally:
            cp.end()

    def refresh_from_shard(self, unit_index: int) -> None:
        """The low-precision chunk was edited from outside (GatheredParameters): copy it into the master
        (into the files with NVMe; a sync point with the disk)."""
        if isinstance(self.host_store, NvmeStateStore) and unit_index in set(self.host_units):
            shard = self.units[unit_index].shard
            for t in self.host_tiles:
                if t.unit == unit_index:
                    self.host_store.write_master(t, shard[t.lo : t.hi])
            return
        super().refresh_from_shard(unit_index)

    def sync_params_from_masters(self) -> None:
        """As the base, and with NVMe the master tiles are read from the files into the shards."""
        if isinstance(self.host_store, NvmeStateStore):
            for t in self.host_tiles:
                self.units[t.unit].write_shard(self.host_store.read_state(t, "master", t.lo, t.hi), t.lo)
        super().sync_params_from_masters()

    # ---- checkpoints (tiled path): state by tile, through the store -----------------------------------
    def state_segments(self) -> List[StateSegment]:
        """Every (trainable piece ∩ tile), device tiles first, then host tiles, in tile order."""
        out: List[StateSegment] = []
        for on_host, tiles in ((False, self.device_tiles), (True, self.host_tiles)):
            for t in tiles:
                for pc in self.trainable_pieces[t.unit]:
                    lo, hi = max(pc.chunk_start, t.lo), min(pc.chunk_start + pc.numel, t.hi)
                    if lo < hi:
                        out.append(StateSegment(t, on_host, pc, lo, hi))
        return out

    def read_segment(self, seg: StateSegment, name: str) -> torch.Tensor:
        """One state (``master``, ``exp_avg``, ``exp_avg_sq``) over a segment: a view of memory, or a copy
        read from the NVMe files (a sync point with the disk; one segment in memory)."""
        store = self.host_store if seg.on_host else self.device_store
        return store.read_state(seg.tile, name, seg.lo, seg.hi)

    def load_tiles(self, fill: Callable[[Tile, bool, TileState], None]) -> None:
        """For each tile: read its state, let ``fill(tile, on_host, state)`` overwrite parts of it, store it
        back (NVMe: one tile in memory at a time). The shards are not touched: call
        :meth:`sync_params_from_masters` after."""
        for on_host, store, tiles in ((False, self.device_store, self.device_tiles),
                                      (True, self.host_store, self.host_tiles)):
            for t in tiles:
                st = store.read_tile(t)
                fill(t, on_host, st)
                store.write_tile(t, st)

    # ---- introspection ---------------------------------------------------------------------------------
    def held_bytes(self) -> Dict[str, int]:
        """Device-resident master/state bytes under the base keys; offloaded bytes under their own."""
        if not self.tiled:
            host = super().held_bytes()
            return {"master": 0, "optimizer": 0, "offloaded_master": host["master"],
                    "offloaded_optimizer": host["optimizer"]}
        dev = self.device_store.held_bytes()
        master_dev = sum(m.numel() * 4 for u, m in self.device_store.masters.items()
                         if not self.units[u].placement.aliases(m))
        out = {"master": master_dev, "optimizer": dev["optimizer"]}
        host = self.host_store.held_bytes()
        out["offloaded_master"] = host["master"]
        out["offloaded_optimizer"] = host["optimizer"]
        out["host_buffers"] = host.get("host_buffers", 0) + (self.copier.buffer_bytes if self.copier else 0)
        out["nvme_files"] = host.get("nvme_files", 0)
        return out

    def tile_state(self, tile: Tile) -> TileState:
        """A copy of one host tile's state (tests, checkpoints)."""
        if isinstance(self.host_store, NvmeStateStore):
            return self.host_store.read_tile(tile)
        return next(iter(self.host_store.stream([tile])))[1]

    def close(self) -> None:
        for s in (self.host_store, self.device_store):
            if s is not None:
                s.close()
        super().close()
