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
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Sequence, Tuple, Union

import torch

from ..comm.collectives import Collectives
from ..errors import ConfigError
from ..optim.muon import MuonWithAuxAdam
from ..zero.layout import Piece
from ..zero.master import MasterWeights, StepResult, device_master
from ..zero.root import ZeroRoot
from ..zero.unit import FlatParamUnit
from .cpu_adam import adam_step, hyper_of, is_adam_family, step_pool
from .muon_step import MuonTiles, step_muon_tiles
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
        reducer: ZeroRoot,
        collectives: Collectives,
        group_of_param: Dict[int, int],
        make_optimizer: Callable[[List[dict]], torch.optim.Optimizer],
        *,
        sharded: bool,
        gather_after_step: bool,
        check_overflow: bool,
        plan: OffloadPlan,
        master_dtype: torch.dtype = torch.float32,
        state_dtype: Optional[torch.dtype] = None,
    ):
        """``state_dtype``: Adam's moments (None: the master's dtype; fp32 beside bf16 masters, as
        DeepSpeedCPUAdam keeps them without ``bf16_optimizer_states``)."""
        if plan.device not in ("cpu", "nvme"):
            raise ConfigError(f"offload device must be 'cpu' or 'nvme', got {plan.device!r}")
        self.plan = plan
        self.step_count = 0
        # units whose masters and state leave the device (by ``ratio``), and the rest
        self.host_units, self.device_units = split_by_ratio([u.layout.chunk_size for u in units], plan.ratio)
        on_host = set(self.host_units)
        pin = plan.pin_memory and torch.cuda.is_available()

        def make_master(ui: int, unit: FlatParamUnit) -> Optional[torch.Tensor]:
            """Host units: a (pinned) host copy, or none with NVMe (the master is in the state files);
            the others: as without offload."""
            if ui not in on_host:
                return device_master(unit)
            if plan.device == "nvme":
                return None
            m = torch.empty(unit.layout.chunk_size, dtype=master_dtype, pin_memory=pin)
            m.copy_(unit.shard)
            return m

        super().__init__(units, reducer, collectives, group_of_param, make_optimizer, sharded=sharded,
                         gather_after_step=gather_after_step, check_overflow=check_overflow,
                         make_master=make_master, master_dtype=master_dtype)
        nvme = plan.device == "nvme"
        muon = isinstance(self.optimizer, MuonWithAuxAdam)
        #: Muon's two-pass step over the stores (:mod:`.muon_step`; with NVMe), else None
        self.muon_tiles: Optional[MuonTiles] = None
        self.state_dtype = state_dtype or master_dtype
        self.tiled = is_adam_family(self.optimizer) or (muon and nvme)
        if self.state_dtype != master_dtype and not is_adam_family(self.optimizer):
            raise ConfigError(f"{master_dtype} master weights with {self.state_dtype} optimizer states offloaded "
                              f"need Adam or AdamW (DeepSpeed's DeepSpeedCPUAdam); the optimizer is "
                              f"{type(self.optimizer).__name__}: use an Adam optimizer"
                              + (" or set bf16.bf16_optimizer_states true" if master_dtype == torch.bfloat16 else ""))
        if not self.tiled and nvme:
            raise ConfigError(f"offload_optimizer device 'nvme' supports Adam, AdamW (without amsgrad) and Muon; the "
                              f"optimizer is {type(self.optimizer).__name__}: use device 'cpu' or an Adam optimizer")
        self.host_tiles: List[Tile] = []
        self.device_tiles: List[Tile] = []
        self.host_store: Optional[Union[NvmeStateStore, MemoryStateStore]] = None  # both set when tiled
        self.device_store: Optional[MemoryStateStore] = None
        self.copier: Optional[HostCopier] = None
        self._step_pool = step_pool(plan.threads if self.tiled else 1)  # the host tiles' chunk threads (ours)
        if not self.tiled:
            logger.info("offload: %s is stepped by torch on the host (generic path)", type(self.optimizer).__name__)
            return
        self._build_stores(group_of_param, nvme)
        if muon:
            assert self.device_store is not None and self.host_store is not None  # built just now
            tensor_of = {(ui, pc.chunk_start): id(view) for ui, (pieces, views) in
                         enumerate(zip(self.trainable_pieces, self.piece_tensors)) for pc, view in zip(pieces, views)}
            self.muon_tiles = MuonTiles([(self.device_store, self.device_tiles), (self.host_store, self.host_tiles)],
                                        self.units, self.state_segments(), tensor_of)

    def _build_stores(self, group_of_param: Dict[int, int], nvme: bool) -> None:
        """The tiled path's tiles, stores (host memory or NVMe files; the device for units kept there by
        ``ratio``), copier and step counters."""
        plan, master_dtype = self.plan, self.master_dtype
        # per unit, (chunk start, numel, position of the param group) of each trainable piece
        pos = {g: i for i, g in enumerate(self.group_indices)}
        unit_pieces = [[(pc.chunk_start, pc.numel, pos[group_of_param[id(u.params[pc.param_index])]])
                        for pc in tp] for u, tp in zip(self.units, self.trainable_pieces)]
        self.host_tiles = plan_tiles(unit_pieces, plan.tile_elems, self.host_units)
        self.device_tiles = plan_tiles(unit_pieces, plan.tile_elems, self.device_units)
        if nvme:
            rank = self.units[0].rank if self.units else 0
            assert plan.nvme_path is not None  # the config requires it for device nvme
            self.host_store = NvmeStateStore(plan.nvme_path, self.host_tiles, plan.buffer_count, plan.pin_memory,
                                             rank, dtypes=(master_dtype, self.state_dtype, self.state_dtype))
            shard, shard_unit = None, None  # read each unit's shard once (offload_param nvme: from its file)
            for t in self.host_tiles:
                if t.unit != shard_unit:
                    shard, shard_unit = self.units[t.unit].shard, t.unit
                assert shard is not None
                self.host_store.initialize(t, shard[t.lo : t.hi])
        else:
            self.host_store = MemoryStateStore({u: m for u in self.host_units
                                                if (m := self.masters[u]) is not None}, state_dtype=self.state_dtype)
        self.device_store = MemoryStateStore({u: m for u in self.device_units
                                              if (m := self.masters[u]) is not None}, state_dtype=self.state_dtype)
        dev = self.units[0].device if self.units else torch.device("cpu")
        max_tile = max((t.numel for t in self.host_tiles), default=0)
        self.copier = HostCopier(dev, self.units[0].dtype if self.units else torch.float32, max_tile,
                                 plan.pin_memory)
        self._host_step = torch.zeros((), dtype=torch.float32)
        self._device_step = torch.zeros((), dtype=torch.float32, device=dev)

    # ---- the step ------------------------------------------------------------------------------------
    def step(self, loss_scale: float, clip: float) -> StepResult:
        if not self.tiled:
            return super().step(loss_scale, clip)
        muon = self.muon_tiles is not None  # Muon clips its updates, not the gradients (muon_step.py)
        grads = [self.reducer.grad_shard(i) for i in range(len(self.units))]
        # on the device, from the chunks as they are
        norm, coef = self.grad_coefficient(grads, loss_scale, 0.0 if muon else clip)
        if coef is None:
            return StepResult(True, norm)  # nothing was copied; the host step is skipped
        self.step_count += 1
        self._host_step.fill_(self.step_count)
        self._device_step.fill_(self.step_count)
        if muon:
            norm = self._step_muon(grads, coef, clip)
        else:
            hyper = [hyper_of(self.optimizer, g) for g in self.optimizer.param_groups]
            self._step_device_tiles(grads, coef, hyper)
            self._step_host_tiles(grads, coef, hyper)
        self._gather_units()
        return StepResult(False, norm)

    def _step_muon(self, grads: List[Optional[torch.Tensor]], coef: float, clip: float) -> float:
        """Muon with its state in the stores (:mod:`.muon_step`): the gradient shards unscaled in place, then
        DeepSpeed's norm over the updates (returned), clipped there."""
        assert self.muon_tiles is not None and isinstance(self.optimizer, MuonWithAuxAdam)
        if coef != 1.0:
            for g in grads:
                if g is not None:
                    g.mul_(coef)
        return step_muon_tiles(self.muon_tiles, self.optimizer, grads, clip, self._host_step)

    def _step_device_tiles(self, grads, coef: float, hyper) -> None:
        assert self.device_store is not None  # tiled
        for t, st in self.device_store.stream(self.device_tiles):
            g = grads[t.unit]
            g = torch.zeros_like(st.master) if g is None else g[t.lo : t.hi].to(st.master.dtype)
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
        assert store is not None and cp is not None  # tiled

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
                if g.dtype != st.master.dtype:  # bf16 masters: the unscaled, clipped fp32 tile rounded once
                    g = g.to(st.master.dtype)
                adam_step(st.master, g, st.exp_avg, st.exp_avg_sq, self._host_step, hyper[t.group],
                          self.plan.threads, self._step_pool)
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
        """The low-precision chunk was edited from outside (GatheredParameters): copy it into the master,
        through the store that holds it (NVMe: into the files, a sync point with the disk)."""
        tiles = [t for t in self.host_tiles if t.unit == unit_index]
        if not tiles:
            super().refresh_from_shard(unit_index)
            return
        shard = self.units[unit_index].shard
        assert self.host_store is not None  # host tiles exist
        for t in tiles:
            self.host_store.write_master(t, shard[t.lo : t.hi])

    def sync_params_from_masters(self) -> None:
        """Masters → low-precision chunks (host tiles through their store), then gather as the base."""
        host = set(t.unit for t in self.host_tiles)
        for t in self.host_tiles:
            assert self.host_store is not None  # host tiles exist
            self.units[t.unit].write_shard(self.host_store.read_state(t, "master", t.lo, t.hi), t.lo)
        for ui in range(len(self.units)):
            if ui not in host:
                self._write_back(ui)
        self._gather_units()

    # ---- checkpoints (tiled path): state by tile, through the store -----------------------------------
    @property
    def is_tiled(self) -> bool:
        """Adam/AdamW: masters and moments live in the stores by tile (see the base class)."""
        return self.tiled

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

    def saved_states(self, seg: StateSegment) -> Tuple[Tuple[str, str], ...]:
        """(name in a checkpoint, name in the store) of a segment's optimizer states: Adam's two moments, or a
        Muon piece's momentum (kept in the store's first slot), named as ``optimizer.state`` names them."""
        if self._muon_segment(seg):
            return (("momentum_buffer", "exp_avg"),)
        return (("exp_avg", "exp_avg"), ("exp_avg_sq", "exp_avg_sq"))

    def _muon_segment(self, seg: StateSegment) -> bool:
        """Whether a segment belongs to a Muon group of Muon's tiled step (its momentum in the first slot)."""
        return self.muon_tiles is not None and bool(self.optimizer.param_groups[seg.tile.group]["use_muon"])

    def saved_step(self, seg: StateSegment) -> Optional[Union[torch.Tensor, int]]:
        """A segment's step count as ``optimizer.state`` holds it: torch Adam's 0-dim float tensor, the count
        itself for Muon's auxiliary AdamW, none for a Muon piece."""
        if self.muon_tiles is None:
            return torch.tensor(float(self.step_count), dtype=torch.float32)
        return None if self._muon_segment(seg) else int(self.step_count)

    def read_segment(self, seg: StateSegment, name: str) -> torch.Tensor:
        """One state (``master``, ``exp_avg``, ``exp_avg_sq``) over a segment: a view of memory, or a copy
        read from the NVMe files (a sync point with the disk; one segment in memory)."""
        store = self.host_store if seg.on_host else self.device_store
        assert store is not None  # tiled
        return store.read_state(seg.tile, name, seg.lo, seg.hi)

    def load_tiles(self, fill: Callable[[Tile, bool, TileState], None]) -> None:
        """For each tile: read its state, let ``fill(tile, on_host, state)`` overwrite parts of it, store it
        back (NVMe: one tile in memory at a time). The shards are not touched: call
        :meth:`sync_params_from_masters` after."""
        for on_host, store, tiles in ((False, self.device_store, self.device_tiles),
                                      (True, self.host_store, self.host_tiles)):
            for t in tiles:
                assert store is not None  # tiles exist only when tiled
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
        assert self.device_store is not None and self.host_store is not None  # tiled
        dev = self.device_store.held_bytes()
        master_dev = sum(m.numel() * m.element_size() for u, m in self.device_store.masters.items()
                         if not self.units[u].placement.aliases(m))
        out = {"master": master_dev, "optimizer": dev["optimizer"]}
        host = self.host_store.held_bytes()
        out["offloaded_master"] = host["master"]
        out["offloaded_optimizer"] = host["optimizer"]
        out["host_buffers"] = host.get("host_buffers", 0) + (self.copier.buffer_bytes if self.copier else 0)
        out["nvme_files"] = host.get("nvme_files", 0)
        return out

    def tile_state(self, tile: Tile) -> TileState:
        """One host tile's state (tests, checkpoints): views of host memory, or a copy read from NVMe."""
        assert self.host_store is not None  # tiled
        return self.host_store.read_tile(tile)

    def close(self) -> None:
        for s in (self.host_store, self.device_store):
            if s is not None:
                s.close()
        if self._step_pool is not None:
            self._step_pool.shutdown()
            self._step_pool = None
        super().close()
