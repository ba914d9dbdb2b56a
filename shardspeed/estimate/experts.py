"""Mixtures of experts priced on a plan: model states per rank by expert parallelism, and all-to-all bytes.

An MoE model of Ψ_d dense and Ψ_e expert parameters at expert size EP: every rank holds the dense ones
(sharded by ZeRO over the data × expert × sequence ranks, ``mesh.shard_size``) and 1/EP of the experts
(sharded over the expert-data group, data × sequence, ``mesh.expert_shard_size``). At stage 0 with fp32
and Adam, for example, a rank holds 16 (Ψ_d + Ψ_e / EP) bytes; at stage 3, 16 Ψ_d / (D·EP) + 16 Ψ_e / (EP·D).

Each MoE layer exchanges tokens twice in forward (dispatch, combine) and twice in backward, each an
``all_to_all_single`` in which a rank keeps 1/EP of its buffer and sends the rest. DeepSpeed's layer (and
:class:`shardspeed.moe.layer.MoE`) sends its whole capacity buffer, ``experts × capacity × hidden``
elements, padded or not; AutoEP sends the routed rows only (tokens × k), whose split depends on the
routing (the formula assumes balanced routing).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

import torch.nn as nn

from ..errors import ConfigError
from ..moe.gating import capacity_of
from ..moe.utils import is_moe_param
from ..plan import ModelFacts, Plan, decide
from .planning import precision_keys
from .states import ModelStateMemory, model_states


def split_params(model: nn.Module) -> Tuple[int, int]:
    """(dense, expert) parameter counts of ``model`` as built for ``ep``: its expert parameters (DeepSpeed's
    tag) count this rank's experts, i.e. Ψ_e / EP."""
    dense = expert = 0
    for p in dict.fromkeys(model.parameters()):
        if is_moe_param(p):
            expert += p.numel()
        else:
            dense += p.numel()
    return dense, expert


def moe_model_states(plan: Plan, dense_params: float, expert_params: float) -> ModelStateMemory:
    """Bytes of model states per rank: ``dense_params`` partitioned over the plan's dense shard group,
    ``expert_params`` (all experts of the model) divided by the expert size, partitioned over the
    expert-data group."""
    ep = plan.mesh.expert
    d = model_states(plan, dense_params)
    e = model_states(dataclasses.replace(plan, mesh=dataclasses.replace(plan.mesh, expert=1)),
                     float(expert_params) / ep)
    return ModelStateMemory(*(a + b for a, b in zip(dataclasses.astuple(d), dataclasses.astuple(e))))


@dataclass(frozen=True)
class AllToAllBytes:
    """Bytes one rank sends per step in its MoE layers' all-to-alls (forward and backward)."""

    per_layer: float
    layers: int

    @property
    def per_step(self) -> float:
        return self.per_layer * self.layers


def capacity_all_to_all(tokens: int, hidden: int, num_experts: int, ep: int, k: int = 1,
                        capacity_factor: float = 1.0, min_capacity: int = 4, dtype_bytes: int = 4, layers: int = 1,
                        backward: bool = True) -> AllToAllBytes:
    """DeepSpeed's layer with ``drop_tokens``: two all-to-alls of ``experts × capacity × hidden`` each way
    (four with backward), of which (EP - 1) / EP leaves the rank; ``tokens``: one rank's tokens per layer call."""
    cap = capacity_of(tokens, num_experts, capacity_factor * k, min_capacity)
    buffer = num_experts * cap * hidden * dtype_bytes
    return AllToAllBytes((4 if backward else 2) * buffer * (ep - 1) / ep, layers)


def routed_all_to_all(tokens: int, hidden: int, ep: int, k: int, dtype_bytes: int = 4, layers: int = 1,
                      backward: bool = True) -> AllToAllBytes:
    """AutoEP (no dropping): each of ``tokens × k`` routed rows crosses twice each way; with balanced routing
    (EP - 1) / EP of them leave the rank (plus the counts, one int64 per expert, not counted)."""
    rows = tokens * k * hidden * dtype_bytes
    return AllToAllBytes((4 if backward else 2) * rows * (ep - 1) / ep, layers)


def moe_estimate(total_params: int, expert_params: int, world: int, ep: int, dtype: str, stages=(0, 1, 2, 3),
                 a2a: Optional[Dict[str, float]] = None) -> List[Dict[str, float]]:
    """``shardspeed estimate --expert-params``: per ZeRO stage, one rank's bytes of model states for a model of
    ``total_params`` of which ``expert_params`` are experts (all of them), at expert size ``ep`` over ``world``
    ranks in ``dtype`` with Adam; with ``a2a`` (:func:`capacity_all_to_all`'s keywords but ``ep``) the
    all-to-all bytes one rank sends per step too."""
    if not 0 <= expert_params <= total_params:
        raise ConfigError(f"--expert-params ({expert_params:,}) must be between 0 and --params ({total_params:,})")
    sent = capacity_all_to_all(ep=ep, **a2a).per_step if a2a else None  # type: ignore[arg-type]
    rows = []
    for stage in stages:
        config = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": stage},
                  **precision_keys(dtype)}
        plan = decide(config, world, ModelFacts(ep_size=ep))
        m = moe_model_states(plan, total_params - expert_params, expert_params)
        row = {"stage": stage, "ep": ep, "expert_data": plan.mesh.expert_shard_size, "params": m.params_device,
               "grads": m.grads_device, "optimizer": m.optimizer_device, "total": m.device}
        if sent is not None:
            row["all_to_all_bytes_per_step"] = sent
        rows.append(row)
    return rows
