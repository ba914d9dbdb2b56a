"""Muon's Newton-Schulz step over ZeRO's flat shards: each matrix orthogonalised once in the job, by its owner.

A ZeRO 1-3 rank holds, of each parameter, the piece that falls inside its chunk of the unit's flat buffer
(:class:`~.layout.Piece`). Muon's momentum and Nesterov blend are elementwise and run on the pieces; the
Newton-Schulz iteration needs the whole matrix. Each Muon matrix is dealt whole to one *owner*: the rank that
already holds most of it (fewest bytes moved), ties to the rank with the fewest matrix elements dealt so far
(largest matrices dealt first). One step:

1. every rank sends the pieces it holds of matrices that others own to their owners (one ``all_to_all``);
2. each owner assembles its matrices, orthogonalises each once;
3. the owners send each piece of the result back to the rank holding it (a second ``all_to_all``).

Extra bytes per step over AdamW at the same stage: twice the fp32 elements of Muon matrices that lie outside
their owner's chunk (:attr:`MatrixExchange.moved_elements`, summed over the job); zero at stage 0, where every
rank holds every matrix whole and orthogonalises it itself (as DeepSpeed does there), and zero for a matrix
that lies inside one chunk. The time of step 2 on this rank is kept in :attr:`MatrixExchange.ns_seconds`.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, Dict, FrozenSet, List, Mapping, Optional, Sequence, Tuple

import torch

from ..comm.collectives import Collectives
from ..errors import DistributedError
from ..mesh.replicas import counts_in_norm
from .layout import Piece
from .master import clip_factor
from .muon_tp import SliceExchange, TPMatrix, deal_over_model
from .unit import FlatParamUnit

__all__ = ["Matrix", "MatrixExchange", "deal_matrices"]


@dataclass(frozen=True)
class Matrix:
    """One Muon matrix of the job: its optimizer group position, shape, owner rank and, per rank holding part
    of it, ``(rank, start, end)`` of the flattened matrix."""

    group: int
    shape: torch.Size
    owner: int
    spans: Tuple[Tuple[int, int, int], ...]

    @property
    def numel(self) -> int:
        return self.spans[-1][2] if self.spans else 0


def _spans(unit: FlatParamUnit, pi: int) -> Tuple[Tuple[int, int, int], ...]:
    lay = unit.layout
    off, n = lay.offsets[pi], lay.numels[pi]
    out = []
    for r in lay.owner_ranks(pi):
        lo, hi = lay.chunk_range(r)
        out.append((r, max(off, lo) - off, min(off + n, hi) - off))
    return tuple(out)


def deal_matrices(candidates: Sequence[Tuple[int, torch.Size, Tuple[Tuple[int, int, int], ...]]],
                  world: int) -> List[Matrix]:
    """Owners for ``(group, shape, spans)`` in the given order: most-held rank, ties to the least loaded."""
    load = [0] * world
    owners: Dict[int, int] = {}
    order = sorted(range(len(candidates)), key=lambda i: -candidates[i][2][-1][2])
    for i in order:
        spans = candidates[i][2]
        held = {r: b - a for r, a, b in spans}
        best = max(held.values())
        owner = min((r for r, h in held.items() if h == best), key=lambda r: (load[r], r))
        owners[i] = owner
        load[owner] += spans[-1][2]
    return [Matrix(g, s, owners[i], sp) for i, (g, s, sp) in enumerate(candidates)]


class MatrixExchange:
    """The router :class:`~shardspeed.optim.muon.MuonWithAuxAdam` is bound to: this rank's pieces of each Muon
    matrix, and the two exchanges that bring each whole matrix to its owner and its pieces back."""

    def __init__(self, matrices: Sequence[Matrix], local: Dict[int, Tuple[int, int, int]],
                 comm: Optional[Collectives], rank: int, world: int, device: torch.device, *,
                 norm: Optional[Collectives] = None, tp: Optional[SliceExchange] = None,
                 uncounted: FrozenSet[int] = frozenset()):
        """``local``: ``{id(piece tensor): (matrix index, start, end)}``; ``comm`` None at stage 0 (every rank
        holds every matrix whole); ``norm``: the data group's collectives the update norm is summed over (then
        over pipe x model); ``tp``: the model-group half under tensor parallelism; ``uncounted``: the ids of the
        optimizer's tensors another model-parallel rank counts in the norm (replicas)."""
        self.matrices = list(matrices)
        self.local = dict(local)
        self.comm = comm if comm is not None and world > 1 else None
        self.norm_comm = norm
        self.tp = tp
        self.uncounted = uncounted
        self.rank, self.world = rank, world
        self.empty = torch.empty(0, dtype=torch.float32, device=device)
        self.ns_seconds = 0.0  # Newton-Schulz time on this rank, summed over steps
        self.steps = 0
        self.moved_elements = sum(b - a for m in self.matrices for r, a, b in m.spans if r != m.owner)

    def orthogonalised_here(self) -> int:
        """The matrices this rank runs Newton-Schulz on each step."""
        return sum(1 for mi, m in enumerate(self.matrices)
                   if m.owner == self.rank and (self.tp is None or self.tp.runs_here(mi)))

    def tp_sent_elements(self) -> int:
        """fp32 elements this rank sends per step over the model group (0 without tensor parallelism)."""
        if self.tp is None:
            return 0
        return self.tp.sent_elements({mi: m.numel for mi, m in enumerate(self.matrices) if m.owner == self.rank})

    def sent_elements(self, rank: int) -> int:
        """fp32 elements ``rank`` sends per step (both exchanges)."""
        out = 0
        for m in self.matrices:
            for r, a, b in m.spans:
                if r != m.owner and rank in (r, m.owner):
                    out += b - a
        return out

    def update_norm(self, tensors: Mapping[int, torch.Tensor]) -> float:
        """The global L2 norm of the orthogonalised updates and AdamW gradients, ``tensors`` this rank's
        (``{id(optimizer tensor): tensor}``): summed over the data group, then over pipe x model, each replica
        counted once. A sync point."""
        sq = torch.zeros((), dtype=torch.float32, device=self.empty.device)
        for key, t in tensors.items():
            if key not in self.uncounted:
                sq += t.float().pow(2).sum().to(sq.device)
        if self.norm_comm is not None:
            self.norm_comm.all_reduce(sq)
            self.norm_comm.all_reduce_model_parallel(sq)
        return float(sq.sqrt())

    def clip_coefficient(self, norm: float, clip: float) -> float:
        """DeepSpeed's ZeRO 1-3 clip factor for updates of global norm ``norm``."""
        return clip_factor(norm, clip, sharded=True)

    def _piece_of(self) -> Dict[int, int]:
        return {mi: pid for pid, (mi, _, _) in self.local.items()}

    def orthogonalize(self, updates: Dict[int, torch.Tensor],
                      fn: Callable[[int, torch.Size, torch.Tensor], torch.Tensor]) -> Dict[int, torch.Tensor]:
        mine = self._piece_of()
        whole = self._gather(updates, mine)
        seconds = [0.0]

        def timed(mi: int, shape: torch.Size, u: torch.Tensor) -> torch.Tensor:
            t0 = time.perf_counter()
            out = fn(self.matrices[mi].group, shape, u)
            seconds[0] += time.perf_counter() - t0
            return out

        if self.tp is not None:
            done = self.tp.orthogonalize(whole, [m.shape for m in self.matrices], timed)
        else:
            done = {mi: timed(mi, self.matrices[mi].shape, u).reshape(-1) for mi, u in whole.items()}
        self.ns_seconds += seconds[0]
        self.steps += 1
        return self._scatter(done, mine)

    def _exchange(self, send: List[List[torch.Tensor]], recv_sizes: List[int], like: torch.Tensor) -> List[torch.Tensor]:
        """``send[r]``: the tensors for rank ``r``; returns what each rank sent here, split by ``recv_sizes``."""
        # pieces of host masters (an offloaded optimizer) travel through the device the exchange runs on
        flat = [torch.cat(s).to(like.device) if s else like.new_empty(0) for s in send]
        out = like.new_empty(sum(recv_sizes))
        assert self.comm is not None
        self.comm.all_to_all_single(out, torch.cat(flat), output_split_sizes=recv_sizes,
                                    input_split_sizes=[t.numel() for t in flat])
        return list(out.split(recv_sizes))

    def _gather(self, updates: Dict[int, torch.Tensor], mine: Dict[int, int]) -> Dict[int, torch.Tensor]:
        """The whole update of each matrix this rank owns."""
        like = self.empty
        send: List[List[torch.Tensor]] = [[] for _ in range(self.world)]
        recv_sizes = [0] * self.world
        for mi, m in enumerate(self.matrices):
            for r, a, b in m.spans:
                if r == self.rank and m.owner != self.rank:
                    send[m.owner].append(updates[mine[mi]])
                elif m.owner == self.rank and r != self.rank:
                    recv_sizes[r] += b - a
        got = self._exchange(send, recv_sizes, like) if self.comm is not None and self.moved_elements else []
        at = [0] * self.world
        whole: Dict[int, torch.Tensor] = {}
        for mi, m in enumerate(self.matrices):
            if m.owner != self.rank:
                continue
            full = like.new_empty(m.numel)
            for r, a, b in m.spans:
                if r == self.rank:
                    full[a:b] = updates[mine[mi]]
                else:
                    full[a:b] = got[r][at[r]:at[r] + b - a]
                    at[r] += b - a
            whole[mi] = full
        return whole

    def _scatter(self, done: Dict[int, torch.Tensor], mine: Dict[int, int]) -> Dict[int, torch.Tensor]:
        """This rank's pieces of the orthogonalised matrices, keyed by piece tensor id."""
        out: Dict[int, torch.Tensor] = {}
        send: List[List[torch.Tensor]] = [[] for _ in range(self.world)]
        recv_sizes = [0] * self.world
        for mi, m in enumerate(self.matrices):
            for r, a, b in m.spans:
                if m.owner == self.rank and r != self.rank:
                    send[r].append(done[mi][a:b])
                elif r == self.rank and m.owner != self.rank:
                    recv_sizes[m.owner] += b - a
                elif r == self.rank:
                    out[mine[mi]] = done[mi][a:b]
        like = self.empty
        got = self._exchange(send, recv_sizes, like) if self.comm is not None and self.moved_elements else []
        at = [0] * self.world
        for mi, m in enumerate(self.matrices):
            for r, a, b in m.spans:
                if r == self.rank and m.owner != self.rank:
                    out[mine[mi]] = got[m.owner][at[m.owner]:at[m.owner] + b - a]
                    at[m.owner] += b - a
        return out


def _check_same_deal(model_comm: Collectives, deal: List[Tuple[int, int]]) -> None:
    """The model group's ranks must hold the same matrices, dealt alike over the data group (equal layouts): one
    object all-gather at build time, so that a mismatch is one error here, not a hang in the step."""
    every = model_comm.all_gather_object(deal, cause="a rank of the model group did not build Muon's exchange")
    if any(d != deal for d in every):
        raise DistributedError("Muon under tensor parallelism: the ranks of a model group hold different Muon matrices "
                               "(their ZeRO layouts differ), so a full matrix cannot be assembled from their slices")


def build_exchange(units: Sequence[FlatParamUnit], pieces: Sequence[Sequence[Piece]],
                   tensors: Sequence[Sequence[torch.Tensor]], group_pos: Callable[[torch.nn.Parameter], Optional[int]],
                   comm: Collectives) -> MatrixExchange:
    """The exchange over the Muon matrices of ``units`` (``group_pos(param)``: its Muon group's position in the
    optimizer, None for a parameter Adam steps); ``pieces`` / ``tensors``: this rank's trainable pieces of each
    unit and the optimizer's tensors for them; ``comm``: the data group's collectives (its topology names the
    model group a tensor-parallel matrix is sliced over)."""
    candidates, keys = [], []
    for ui, u in enumerate(units):
        for pi, p in enumerate(u.params):
            gp = group_pos(p) if p.requires_grad else None
            if gp is not None and u.layout.numels[pi] > 0:
                candidates.append((gp, u.shapes[pi], _spans(u, pi)))
                keys.append((ui, pi))
    world = units[0].layout.world if units else 1
    index = {k: i for i, k in enumerate(keys)}
    topo = comm.topology
    local, uncounted = {}, set()
    for ui, (unit_pieces, unit_tensors) in enumerate(zip(pieces, tensors)):
        for pc, t in zip(unit_pieces, unit_tensors):
            if not counts_in_norm(units[ui].params[pc.param_index], topo.model_rank):
                uncounted.add(id(t))
            mi = index.get((ui, pc.param_index))
            if mi is not None:
                local[id(t)] = (mi, pc.param_start, pc.param_end)
    rank = units[0].rank if units and world > 1 else 0
    device = units[0].device if units else torch.device("cpu")
    matrices = deal_matrices(candidates, world)
    tp = None
    if topo.model_size > 1:
        slices = [getattr(units[ui].params[pi], "tp_slice", None) for ui, pi in keys]
        numels = [m.numel * (sl.size if sl is not None else 1) for m, sl in zip(matrices, slices)]
        owners = deal_over_model([m.owner for m in matrices], numels, topo.model_size)
        model_comm = Collectives.over(topo.model_group, comm.log)
        _check_same_deal(model_comm, [(m.owner, m.numel) for m in matrices])
        tp = SliceExchange([TPMatrix(o, sl) for o, sl in zip(owners, slices)], model_comm, topo.model_rank,
                           topo.model_size)
    return MatrixExchange(matrices, local, comm if world > 1 else None, rank, world, device, norm=comm, tp=tp,
                          uncounted=frozenset(uncounted))
