"""DeepSpeed's ``deepspeed.moe.utils``: telling expert parameters apart, and optimizer groups for them."""
from __future__ import annotations

from collections import defaultdict
from typing import Any, Dict, List, Set, Tuple, Union

import torch
import torch.nn as nn


def is_moe_param(param: torch.Tensor) -> bool:
    """An expert parameter: tagged ``allreduce = False`` (reduced over its expert-data group only)."""
    return hasattr(param, "allreduce") and not param.allreduce


def has_moe_layers(m: nn.Module) -> Tuple[bool, int]:
    """(whether ``m`` has an MoE layer, the first one's ``num_experts``)."""
    from .layer import MoE

    for module in m.modules():
        if isinstance(module, MoE):
            return True, module.num_experts
    return False, 0


def largest_ep_size(m: nn.Module) -> int:
    """The largest ``ep_size`` among ``m``'s MoE layers (1: none): the plan's expert dimension."""
    from .layer import MoE

    return max((mod.ep_size for mod in m.modules() if isinstance(mod, MoE)), default=1)


def split_params_into_shared_and_expert_params(
        params: List[nn.Parameter]) -> Tuple[List[nn.Parameter], List[nn.Parameter]]:
    shared = [p for p in params if not is_moe_param(p)]
    return shared, [p for p in params if is_moe_param(p)]


def split_params_grads_into_shared_and_expert_params(
        group: List[nn.Parameter]) -> Tuple[List[torch.Tensor], List[torch.Tensor]]:
    shared = [p.grad.to(p.dtype) for p in group if p.grad is not None and not is_moe_param(p)]
    return shared, [p.grad.to(p.dtype) for p in group if p.grad is not None and is_moe_param(p)]


def split_params_into_different_moe_groups_for_optimizer(
        param_groups: Union[Dict[str, Any], Tuple[Dict[str, Any], ...], List[Dict[str, Any]]],
        max_group_size: Union[int, float, None] = 178956971) -> List[Dict[str, Any]]:
    """DeepSpeed's split: each group's expert parameters move to new groups, one per expert group name
    (``moe: True``, ``name``: the group name, the other hyper-parameters copied), cut at ``max_group_size``
    elements; the original groups keep the rest. Returns the list of groups (the given list, extended)."""
    if isinstance(param_groups, tuple):
        param_groups = list(param_groups)
    elif isinstance(param_groups, dict):
        param_groups = [param_groups]
    elif not isinstance(param_groups, list):
        raise ValueError(f"Unknown param group type of {type(param_groups)}")
    names: Set[str] = {p.group_name for g in param_groups for p in g["params"] if is_moe_param(p)}
    moe: Dict[Any, Dict[str, Dict[str, Any]]] = defaultdict(dict)
    for g in param_groups:
        for key in sorted(names):
            moe[g.get("name")][key] = {**g, "name": key, "moe": True, "params": []}
    for g in param_groups:
        kept = []
        for p in g["params"]:
            if is_moe_param(p):
                moe[g.get("name")][p.group_name]["params"].append(p)
            else:
                kept.append(p)
        g["params"] = kept
    for by_name in moe.values():
        for group in by_name.values():
            if max_group_size is None:
                param_groups.append(group)
                continue
            cur: List[nn.Parameter] = []
            size = 0
            for p in group["params"]:
                if cur and size + p.numel() > max_group_size:
                    param_groups.append({**group, "params": cur})
                    cur, size = [], 0
                cur.append(p)
                size += p.numel()
            if cur:
                param_groups.append({**group, "params": cur})
    return param_groups


def is_moe_param_group(param_group: Dict[str, Any]) -> bool:
    return bool(param_group.get("moe", False))
