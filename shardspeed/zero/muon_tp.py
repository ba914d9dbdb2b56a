"""Muon's Newton-Schulz step under tensor parallelism: each matrix whole on one rank of the model group.

After the data-level exchange (:mod:`.muon_exchange`) the rank that owns a matrix over the data group holds
its whole *local* matrix: under tensor parallelism a slice of the full one (:class:`~shardspeed.parallel.tp.
slicing.TPSlice`). The data-level deal is the same on every rank of a model group (their layouts are equal), so
the model group's ranks at that data rank hold the matrix's slices together. One of them is dealt the full
matrix (balanced by size over the matrices the data rank owns):

1. every other model rank sends its slice to that owner (one ``all_to_all`` over the model group);
2. the owner assembles the full matrix, orthogonalises it once, and cuts it into the ranks' slices;
3. each slice goes back to its rank (a second ``all_to_all``).

A Muon matrix the tensor-parallel plan leaves whole (replicated over the model group: the same gradient on
every model rank) is orthogonalised by its owner alone and the result sent to the other model ranks (step 3
only). Extra elements per step over the tensor-parallel group, per matrix of ``n`` full elements at model size
``T``: ``2 (T - 1) n / T`` for a sliced matrix, ``(T - 1) n`` for a replicated one.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch

from ..comm.collectives import Collectives
from ..parallel.tp.slicing import TPSlice, assemble, take

__all__ = ["TPMatrix", "SliceExchange", "deal_over_model"]


@dataclass(frozen=True)
class TPMatrix:
    """One Muon matrix's place over the model group: the model rank that orthogonalises it, and this rank's
    slice of it (None: every model rank holds it whole)."""

    owner: int
    slice: Optional[TPSlice]


def deal_over_model(data_owners: Sequence[int], numels: Sequence[int], size: int) -> List[int]:
    """The model rank that orthogonalises each matrix (``data_owners[i]``: its owner over the data group,
    ``numels[i]``: its full elements): largest first, each to the model rank with the fewest elements dealt so
    far at that data rank, ties to the lowest rank."""
    load: Dict[Tuple[int, int], int] = {}
    out = [0] * len(numels)
    for i in sorted(range(len(numels)), key=lambda i: -numels[i]):
        owner = min(range(size), key=lambda t: (load.get((data_owners[i], t), 0), t))
        out[i] = owner
        load[(data_owners[i], owner)] = load.get((data_owners[i], owner), 0) + numels[i]
    return out


class SliceExchange:
    """The model-group half of the exchange: whole local matrices in, this rank's slices of the orthogonalised
    full matrices out."""

    def __init__(self, entries: Sequence[TPMatrix], comm: Collectives, rank: int, size: int):
        self.entries = list(entries)
        self.comm = comm
        self.rank, self.size = rank, size

    def runs_here(self, mi: int) -> bool:
        return self.entries[mi].owner == self.rank

    def sent_elements(self, held: Dict[int, int]) -> int:
        """Elements this rank sends per step for the matrices ``held`` (``{matrix index: local numel}``: those
        it owns over the data group)."""
        out = 0
        for mi, n in held.items():
            e = self.entries[mi]
            if e.slice is not None:
                out += n * (self.size - 1) if e.owner == self.rank else n
            elif e.owner == self.rank:
                out += n * (self.size - 1)
        return out

    def orthogonalize(self, whole: Dict[int, torch.Tensor], shapes: Sequence[torch.Size],
                      fn: Callable[[int, torch.Size, torch.Tensor], torch.Tensor]) -> Dict[int, torch.Tensor]:
        """``whole``: ``{matrix index: flat local update}`` for the matrices this rank owns over the data group
        (the same indexes on every model rank); ``shapes[mi]``: the local shape; ``fn(mi, full shape, full
        update)``: the orthogonalised full update (any layout of that many elements). Returns this rank's flat
        local slices of the results."""
        order = sorted(whole)
        like = next(iter(whole.values())) if whole else torch.empty(0)
        gathered = self._to_owners(whole, order, like)
        done: Dict[int, torch.Tensor] = {}
        back: List[List[torch.Tensor]] = [[] for _ in range(self.size)]
        for mi in order:
            e = self.entries[mi]
            if e.owner != self.rank:
                continue
            if e.slice is None:
                result = fn(mi, shapes[mi], whole[mi]).reshape(-1)
                parts = [result] * self.size
            else:
                sl = e.slice
                local = [gathered[mi][r].reshape(sl.local_shape) for r in range(self.size)]
                shape = torch.Size(sl.full_shape)
                full = fn(mi, shape, assemble(local, sl, like.device)).reshape(shape)
                parts = [take(full, TPSlice(sl.full_shape, sl.dim, sl.blocks, r, sl.size)).reshape(-1)
                         for r in range(self.size)]
            done[mi] = parts[self.rank]
            for r in range(self.size):
                if r != self.rank:
                    back[r].append(parts[r])
        recv = [0] * self.size
        for mi in order:
            if self.entries[mi].owner != self.rank:
                recv[self.entries[mi].owner] += whole[mi].numel()
        got = self._exchange(back, recv, like) if order else []
        at = [0] * self.size
        for mi in order:
            owner = self.entries[mi].owner
            if owner != self.rank:
                n = whole[mi].numel()
                done[mi] = got[owner][at[owner]:at[owner] + n]
                at[owner] += n
        return done

    def _to_owners(self, whole: Dict[int, torch.Tensor], order: Sequence[int],
                   like: torch.Tensor) -> Dict[int, Dict[int, torch.Tensor]]:
        """Step 1: ``{matrix index: {model rank: its flat slice}}`` of the sliced matrices this rank owns."""
        send: List[List[torch.Tensor]] = [[] for _ in range(self.size)]
        recv = [0] * self.size
        for mi in order:
            e = self.entries[mi]
            if e.slice is None:
                continue
            if e.owner != self.rank:
                send[e.owner].append(whole[mi])
            else:
                for r in range(self.size):
                    if r != self.rank:
                        recv[r] += whole[mi].numel()
        # the same matrices on every model rank: all call the collective, or none
        sliced = any(self.entries[mi].slice is not None for mi in order)
        got = self._exchange(send, recv, like) if sliced else []
        at = [0] * self.size
        out: Dict[int, Dict[int, torch.Tensor]] = {}
        for mi in order:
            e = self.entries[mi]
            if e.slice is None or e.owner != self.rank:
                continue
            n = whole[mi].numel()
            out[mi] = {self.rank: whole[mi]}
            for r in range(self.size):
                if r != self.rank:
                    out[mi][r] = got[r][at[r]:at[r] + n]
                    at[r] += n
        return out

    def _exchange(self, send: List[List[torch.Tensor]], recv: List[int], like: torch.Tensor) -> List[torch.Tensor]:
        flat = [torch.cat(s) if s else like.new_empty(0) for s in send]
        out = like.new_empty(sum(recv))
        self.comm.all_to_all_single(out, torch.cat(flat), output_split_sizes=recv,
                                    input_split_sizes=[t.numel() for t in flat])
        return list(out.split(recv))
