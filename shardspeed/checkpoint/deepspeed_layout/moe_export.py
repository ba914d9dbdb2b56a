"""Ours → DeepSpeed's layout for a model with native MoE layers (ZeRO 1-2): the inverse of :mod:`.moe`.

Our stacked expert tensors (``...deepspeed_experts.<name>``, ``[num_experts, ...]``) become DeepSpeed's
per-expert parameters: expert-parallel rank ``q``'s local expert ``i`` (global id ``q × local + i``) is
``...deepspeed_experts.<i>.<name>`` in its optimizer group, which ZeRO partitions over the ``world / ep``
ranks holding the same experts (rank ``r``: ``q = r % ep``, part ``r // ep``), and
``layer_<l>_expert_<e>_mp_rank_00_model_states.pt`` holds expert ``e``'s weights under its global id.
"""
from __future__ import annotations

import math
import os
import re
from typing import Any, Dict, List, NamedTuple, Optional, Sequence, Tuple

import torch

from ...errors import CheckpointError
from ..metadata import CheckpointMetadata
from .layout import save_pt

_STACKED = re.compile(r"^(.*\.deepspeed_moe\.experts\.deepspeed_experts)\.(.+)$")


class Run(NamedTuple):
    """A parameter in a flat group: DeepSpeed's ``name`` at flat offset ``off`` (``n`` elements, ``shape``),
    read from our tensor ``src`` from element ``src_off``."""

    name: str
    off: int
    n: int
    src: str
    src_off: int
    shape: Tuple[int, ...]


class ExpertPlan(NamedTuple):
    ep: int
    holders: List[str]  # the MoE layers' expert holders, in registration order
    local: Dict[str, int]  # local experts per layer at ``ep``
    experts: List[Tuple[str, Tuple[int, ...]]]  # our stacked tensors and full shapes, in registration order

    def layout(self, q: int) -> List[Run]:
        """Expert-parallel rank ``q``'s flat expert group: each layer, each local expert, each parameter."""
        out, at = [], 0
        for h in self.holders:
            mine = [(n, s) for n, s in self.experts if _holder(n) == h]
            for i in range(self.local[h]):
                for n, s in mine:
                    k = math.prod(s[1:])
                    out.append(Run(f"{h}.{i}.{_pname(n)}", at, k, n, (q * self.local[h] + i) * k, tuple(s[1:])))
                    at += k
        return out


def _holder(stacked: str) -> str:
    m = _STACKED.match(stacked)
    return m[1] if m else ""


def _pname(stacked: str) -> str:
    m = _STACKED.match(stacked)
    return m[2] if m else stacked


def dense_layout(trained: Sequence[Tuple[str, Any]], plan: Optional[ExpertPlan]) -> List[Run]:
    """The flat group of every trained tensor but the experts', in registration order."""
    out, at = [], 0
    for name, shape in trained:
        if plan is not None and _STACKED.match(name):
            continue
        n = math.prod(shape)
        out.append(Run(name, at, n, name, 0, tuple(shape)))
        at += n
    return out


def expert_plan(meta: CheckpointMetadata, trained: Sequence[Tuple[str, Any]], world: int,
                ep_size: Optional[int]) -> Optional[ExpertPlan]:
    """The MoE layers of our checkpoint at ``ep_size`` (default: the expert-parallel size they were saved at),
    or None without MoE layers."""
    experts = [(n, tuple(int(d) for d in s)) for n, s in trained if _STACKED.match(n)]
    if not experts:
        return None
    if ep_size is None:
        specs = [e.tp for e in meta.entries if e.tensor == experts[0][0] and e.tp]
        ep_size = int(specs[0][3]) if specs else 1
    holders: List[str] = []
    local: Dict[str, int] = {}
    for n, s in experts:
        h = _holder(n)
        if ep_size < 1 or world % ep_size or s[0] % ep_size:
            raise CheckpointError(f"export to DeepSpeed: {n!r} holds {s[0]} experts; ep_size {ep_size} must divide "
                                  f"it and the world size {world}")
        if h not in local:
            holders.append(h)
            local[h] = s[0] // ep_size
    return ExpertPlan(ep_size, holders, local, experts)


def write_expert_files(ours: Any, out: str, plan: ExpertPlan, ms: Dict[str, Any], dtype: torch.dtype) -> None:
    """DeepSpeed's per-expert model files, and the model-states dict ``ms`` as its MoE engine saves it (no
    expert weights in ``module``; ``num_experts`` per layer)."""
    stacked = {n: ms["module"].pop(n) for n, _ in plan.experts}
    for layer, h in enumerate(plan.holders):
        mine = [n for n, _ in plan.experts if _holder(n) == h]
        for e in range(plan.local[h] * plan.ep):
            sd = {f"{h}.{e}.{_pname(n)}": stacked[n][e].to(dtype).clone() for n in mine}
            save_pt(sd, os.path.join(out, f"layer_{layer}_expert_{e}_mp_rank_00_model_states.pt"))
    ms["num_experts"] = [plan.local[h] * plan.ep for h in plan.holders]
    ms["ds_autoep_layers"] = None
