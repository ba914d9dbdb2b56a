"""Muon's offloaded step by tile: its state in the offload store (NVMe files), two passes over the tiles.

The store keeps, per tile, the master and two state arrays. A tile of a Muon group keeps Muon's momentum in
the first (``exp_avg``; the second stays zero); a tile of the auxiliary AdamW keeps Adam's two moments. One step
(:func:`step_muon_tiles`), the gradients already unscaled (loss scale) in place:

1. the Muon tiles are streamed: the momentum takes the gradient, the Nesterov blend of each piece is kept in
   memory (4 bytes per Muon element of this rank), the momentum is written back;
2. the blends go through the optimizer's router: each whole matrix orthogonalised once in the job
   (:mod:`shardspeed.zero.muon_exchange`); DeepSpeed's norm over the results and the AdamW gradients is taken
   and both are clipped by it;
3. every tile is streamed again: a Muon tile takes its decoupled weight decay and its orthogonalised update,
   an AdamW tile its Adam step (the offload's fused kernel); each updated master goes into its unit's shard.

So the files are read twice and written twice per step for Muon tiles (once each for AdamW tiles).
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Dict, Iterator, List, Optional, Sequence, Tuple, Union

import torch

from ..optim.muon import MuonWithAuxAdam
from ..zero.layout import Piece
from ..zero.unit import FlatParamUnit
from .cpu_adam import AdamHyper, adam_step
from .store import MemoryStateStore, NvmeStateStore, TileState
from .tiles import Tile

if TYPE_CHECKING:  # offload/master.py imports this module
    from .master import StateSegment

__all__ = ["MuonTiles", "step_muon_tiles"]

Store = Union[MemoryStateStore, NvmeStateStore]
#: a tile's pieces: (the optimizer tensor's id, the piece, start and end inside the unit's chunk)
Segments = List[Tuple[int, Piece, int, int]]


class MuonTiles:
    """What the two passes need of an offloaded master: the stores with their tiles, the units, and per tile
    the pieces it holds with their optimizer tensors (ids)."""

    def __init__(self, stores: Sequence[Tuple[Store, Sequence[Tile]]], units: Sequence[FlatParamUnit],
                 segments: Sequence[StateSegment], tensor_of: Dict[Tuple[int, int], int]):
        """``segments``: every (trainable piece ∩ tile), as the offloaded master cuts them; ``tensor_of``:
        ``{(unit, piece's chunk start): id(optimizer tensor)}``."""
        self.stores = list(stores)
        self.units = list(units)
        self.segments: Dict[Tuple[int, int], Segments] = {}
        for seg in segments:
            t = seg.tile
            self.segments.setdefault((t.unit, t.index), []).append(
                (tensor_of[(t.unit, seg.piece.chunk_start)], seg.piece, seg.lo, seg.hi))

    def tiles_of(self, tiles: Sequence[Tile], opt: MuonWithAuxAdam, muon: bool) -> List[Tile]:
        return [t for t in tiles if bool(opt.param_groups[t.group]["use_muon"]) is muon]


def _streamed(store: Store, tiles: Sequence[Tile]) -> Iterator[Tuple[Tile, TileState]]:
    """The store's stream of ``tiles``, each released after the caller's body; flushed at the end, abandoned
    on an error (NVMe: the reader and writer threads stop)."""
    try:
        for t, st in store.stream(tiles):
            yield t, st
            store.release(t, st, None)
        store.flush()
    except BaseException:
        store.abandon()
        raise


def _grad_tile(grads: Sequence[Optional[torch.Tensor]], t: Tile, like: torch.Tensor) -> torch.Tensor:
    g = grads[t.unit]
    if g is None:
        return torch.zeros_like(like)
    return g[t.lo:t.hi].to(device=like.device, dtype=like.dtype)


def _blends(mt: MuonTiles, opt: MuonWithAuxAdam, grads) -> Dict[int, torch.Tensor]:
    """Pass 1: momentum and Nesterov blend of every Muon piece this rank holds (``{id(tensor): blend}``)."""
    out: Dict[int, torch.Tensor] = {}
    for store, tiles in mt.stores:
        for t, st in _streamed(store, mt.tiles_of(tiles, opt, True)):
            blend = opt.nesterov_update(_grad_tile(grads, t, st.master), st.exp_avg,
                                        opt.param_groups[t.group]["momentum"])
            for key, pc, lo, hi in mt.segments.get((t.unit, t.index), []):
                dst = out.setdefault(key, torch.zeros(pc.numel, dtype=blend.dtype, device=blend.device))
                dst[lo - pc.chunk_start:hi - pc.chunk_start] = blend[lo - t.lo:hi - t.lo]
    return out


def _adam_grads(mt: MuonTiles, opt: MuonWithAuxAdam, grads) -> Dict[int, torch.Tensor]:
    """This rank's AdamW gradient pieces (views of the reduced gradient shards), by optimizer tensor id."""
    out: Dict[int, torch.Tensor] = {}
    for _, tiles in mt.stores:
        for t in mt.tiles_of(tiles, opt, False):
            g = grads[t.unit]
            if g is None:
                continue
            for key, pc, _, _ in mt.segments.get((t.unit, t.index), []):
                out.setdefault(key, g[pc.chunk_start:pc.chunk_start + pc.numel])
    return out


def _apply(mt: MuonTiles, opt: MuonWithAuxAdam, grads, done: Dict[int, torch.Tensor],
           step: torch.Tensor) -> None:
    """Pass 2: each tile's update into its master and its unit's shard."""
    for store, tiles in mt.stores:
        for t, st in _streamed(store, tiles):
            group = opt.param_groups[t.group]
            lr, wd = float(group["lr"]), float(group["weight_decay"])
            if group["use_muon"]:
                upd = torch.empty_like(st.master)
                for key, pc, lo, hi in mt.segments.get((t.unit, t.index), []):
                    upd[lo - t.lo:hi - t.lo] = done[key][lo - pc.chunk_start:hi - pc.chunk_start]
                st.master.mul_(1 - lr * wd).add_(upd, alpha=-lr)
            else:
                b1, b2 = group["betas"]
                hyper = AdamHyper(lr, float(b1), float(b2), float(group["eps"]), wd, opt.adam_w_mode)
                adam_step(st.master, _grad_tile(grads, t, st.master), st.exp_avg, st.exp_avg_sq,
                          step.to(st.master.device), hyper)
            mt.units[t.unit].write_shard(st.master, t.lo)


def step_muon_tiles(mt: MuonTiles, opt: MuonWithAuxAdam, grads: Sequence[Optional[torch.Tensor]], clip: float,
                    step: torch.Tensor) -> float:
    """One Muon step over the stores (``grads``: the reduced gradient shards, unscaled; ``step``: Adam's count,
    this step included). Returns DeepSpeed's gradient norm: the norm over the updates."""
    done = opt.orthogonalized(_blends(mt, opt, grads))
    opt.clip_together({**done, **_adam_grads(mt, opt, grads)}, clip)
    _apply(mt, opt, grads, done, step)
    return opt.update_norm
