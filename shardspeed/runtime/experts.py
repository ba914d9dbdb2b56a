"""What the builder does for mixtures of experts (docs/moe.md): give the MoE layers their expert-parallel
group, convert Hugging Face MoE blocks (AutoEP), and tell ZeRO which parameters are experts.

Dense parameters are the same on every rank of the data × expert (× sequence) group, ZeRO's ``dp`` group;
an expert parameter is the same only on the ranks with this rank's expert coordinate, the expert-data
group, so its units are sharded and reduced there (``unit.comm``), its initial values broadcast there, and
the global gradient norm counts it once (:meth:`shardspeed.zero.master.MasterWeights.global_grad_norm`).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, List, Optional, Sequence

import torch
import torch.nn as nn

from ..comm.collectives import Collectives, CommsLogger
from ..errors import ConfigError
from ..mesh.topology import Topology
from ..moe.autoep import convert_model
from ..moe.layer import MoE
from ..moe.utils import is_moe_param
from ..plan import Plan
from ..zero.layout import group_by_size
from ..zero.unit import FlatParamUnit


@dataclass(frozen=True)
class ExpertParts:
    """``comm``: the expert-data group's collectives (None: no expert dimension, every parameter is dense);
    ``group_name``: DeepSpeed's name of the expert parameters ZeRO treats apart (``ep_size_N``)."""

    comm: Optional[Collectives] = None
    group_name: str = ""

    def is_expert(self, p: torch.Tensor) -> bool:
        """Whether ``p`` is an expert parameter of the mesh's expert size (sharded over the expert-data group);
        experts of a layer with ``ep_size`` 1 are on every rank and stay dense."""
        return self.comm is not None and is_moe_param(p) and getattr(p, "group_name", None) == self.group_name


def prepare_experts(model: nn.Module, plan: Plan, topo: Topology, log: CommsLogger) -> ExpertParts:
    """Collective when the mesh has an expert dimension: AutoEP's conversion (``plan.experts.convert``),
    every ``MoE`` layer given the expert group and the experts it holds."""
    ep = plan.mesh.expert
    if plan.experts.convert:
        convert_model(model, plan.experts, topo.expert_group, topo.expert_rank, ep)
    for m in model.modules():
        if isinstance(m, MoE):
            if m.ep_size not in (1, ep):
                raise ConfigError(f"MoE(ep_size={m.ep_size}) in a model whose expert dimension is {ep} (its largest "
                                  f"ep_size, or expert_parallel.autoep_size): every layer's ep_size must be 1 or {ep}")
            m.set_expert_parallel(topo.expert_group, topo.expert_rank)
    if ep == 1:
        return ExpertParts()
    return ExpertParts(Collectives.over(topo.expert_shard_group, log), f"ep_size_{ep}")


def build_flat_units(params: List[nn.Parameter], build: Callable[..., List[FlatParamUnit]], bucket: int,
                     world: int, rank: int, alone: Sequence[nn.Parameter], experts: ExpertParts
                     ) -> List[FlatParamUnit]:
    """Stages 0-2: the builder's units of the dense parameters (``build(params, bucket, world, rank, alone)``),
    then the expert parameters' units over the expert-data group (sharded there when ``world`` > 1)."""
    dense = [p for p in params if not experts.is_expert(p)]
    units = build(dense, bucket, world, rank, alone)
    comm = experts.comm
    if comm is None:
        return units
    expert = [p for p in params if experts.is_expert(p)]
    sharded = world > 1
    for idx in group_by_size([p.numel() for p in expert], bucket):
        unit = FlatParamUnit([expert[i] for i in idx], world=comm.world if sharded else 1,
                             rank=comm.topology.shard_rank if sharded else 0, index=len(units))
        unit.comm = comm
        units.append(unit)
    return units


@torch.no_grad()
def broadcast_module_state(model: nn.Module, collectives: Collectives, experts: ExpertParts) -> None:
    """Every rank starts from its group's first rank's parameters and buffers (as DeepSpeed does): dense ones
    from the data group's, expert parameters from the expert-data group's."""
    seen = set()
    for t in list(model.parameters()) + list(model.buffers()):
        if id(t) in seen or t.numel() == 0:
            continue
        seen.add(id(t))
        comm = experts.comm if experts.comm is not None and experts.is_expert(t) else collectives
        if comm.world > 1:
            comm.broadcast(t.data, 0)
