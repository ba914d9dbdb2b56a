"""Tied layers across pipeline stages (an embedding on the first stage, the LM head on the last).

For each tie key used on more than one pipe rank, the ranks holding a use at the same (data, model)
coordinate form a group. At build time the lowest pipe rank's values are broadcast over it; before every
optimizer step the reduced gradient chunks of the tied parameters are summed over it. Summing chunks
needs each copy's unit to split the parameter identically, which is checked once at build time.
The copies on the higher pipe ranks are marked replicas: the global gradient norm counts each tied
parameter once.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import List, Sequence, Tuple

import torch
import torch.distributed as dist
import torch.nn as nn

from ..comm.collectives import Collectives, CommsLogger
from ..errors import ConfigError
from ..mesh.init import new_group
from ..mesh.topology import Topology, mesh_ranks
from .module import PipelineModule
from .partition import rank_of_stage


@dataclass
class TieGroup:
    """One tie key on this rank: its local parameters and the group of copies."""

    key: str
    params: List[nn.Parameter]
    comm: Collectives
    owner: bool  # this rank holds the copy that counts (the lowest pipe rank)


def build_tie_groups(module: PipelineModule, topo: Topology, schedule: str, virtual_stages: int,
                     log: CommsLogger) -> List[TieGroup]:
    """Create the tie groups (every rank creates every group, in the same order), broadcast each tied
    parameter from its owner and mark the other copies replicas. Collective over the world."""
    from ..mesh.replicas import mark_replica

    out: List[TieGroup] = []
    ranks = mesh_ranks(topo.pipe_size, topo.shard_size, topo.model_size)
    me = dist.get_rank()
    for key, stages in sorted(module.tied_keys_by_stage().items()):
        pipes = sorted({rank_of_stage(s, topo.pipe_size, virtual_stages, schedule) for s in stages})
        if len(pipes) < 2:
            continue  # every use on one rank: one module, autograd sums the uses
        mine = None
        for d in range(topo.shard_size):
            for m in range(topo.model_size):
                members = [ranks[p][d][m] for p in pipes]
                group = new_group(members, desc=f"tie_{key}")  # the world group's timeout
                if me in members:
                    mine = group
        if mine is None:
            continue
        params = module.tied_parameters(key)
        comm = Collectives.over(mine, log)
        with torch.no_grad():
            for p in params:
                comm.broadcast(p.data, 0)
        owner = comm.topology.shard_rank == 0
        if not owner:
            for p in params:
                mark_replica(p)
        out.append(TieGroup(key, params, comm, owner))
    return out


def _unit_pieces(units: Sequence, param: nn.Parameter) -> Tuple[int, List[Tuple[int, int, int]]]:
    """(unit index, [(chunk_start, param_start, param_end)]) of ``param`` in this rank's chunk."""
    for ui, u in enumerate(units):
        for pi, p in enumerate(u.params):
            if p is param:
                return ui, [(pc.chunk_start, pc.param_start, pc.param_end) for pc in u.pieces if pc.param_index == pi]
    raise ConfigError("a tied parameter is not trainable by the engine (requires_grad=False or left out of "
                      "model_parameters); tied parameters must be trained on every stage")


class TiedGradients:
    """Sums the reduced gradient chunks of tied parameters over their tie groups, before the step."""

    def __init__(self, ties: List[TieGroup], units: Sequence, accum_dtype: torch.dtype):
        self.ties = ties
        self.dtype = accum_dtype
        self.places = [[_unit_pieces(units, p) for p in t.params] for t in ties]
        self.units = list(units)
        for tie, places in zip(ties, self.places):  # each copy must split its parameters alike
            layout = [(units[ui].layout.padded_numel, pieces) for ui, pieces in places]
            seen = tie.comm.all_gather_object(layout, cause="every rank must build the pipeline engine")
            if any(s != seen[0] for s in seen):
                raise ConfigError(
                    f"tied layer '{tie.key}': its copies on different stages are sharded differently ({seen}); "
                    f"give the tied module the same parameters on every stage (the same class and arguments)")

    def all_reduce(self, grad_shard) -> None:
        """``grad_shard(unit_index)`` -> this rank's reduced chunk (None when no gradient reached it)."""
        for tie, places in zip(self.ties, self.places):
            for ui, pieces in places:
                g = grad_shard(ui)
                for chunk_start, start, end in pieces:
                    n = end - start
                    if g is None:  # no gradient here: contribute zeros so the group still meets
                        tie.comm.all_reduce(torch.zeros(n, dtype=self.dtype, device=self.units[ui].device))
                        continue
                    view = g[chunk_start : chunk_start + n]
                    tie.comm.all_reduce(view)  # a contiguous slice: in place
