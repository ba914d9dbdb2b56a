"""DeepSpeed's checkpoints of models with native MoE layers (``deepspeed.moe.layer.MoE``) at ZeRO 1-2.

DeepSpeed keeps each rank's *local* experts as separate modules (``...deepspeed_experts.<i>.<name>``, ``i``
the local id) and puts them in parameter groups of their own (``split_params_into_different_moe_groups_for_
optimizer``), which ZeRO partitions over the expert-data group, not over all data ranks: such a group's
``partition_count`` is ``world / ep_size``. With DeepSpeed's default group layout, rank ``r`` holds the experts
of expert-parallel rank ``q = r % ep_size`` (global ids ``q × local ... (q + 1) × local - 1``) and, among the
ranks holding them, is number ``r // ep_size``. So rank ``r``'s optimizer file holds, for an expert group,
part ``r // ep_size`` of the flat tensor of expert-parallel rank ``q``'s local experts, in ``param_shapes``
order (which names the local experts of rank 0).

Ours stacks a layer's experts in one parameter per expert parameter (``...deepspeed_experts.<name>``,
``[num_experts, ...]`` in the checkpoint, keyed by global expert id): local expert ``i`` of expert rank ``q``
is row ``q × local + i`` of it. :func:`moe_spans` maps every saved piece there. The per-expert model files
(``layer_<l>_expert_<e>_mp_rank_00_model_states.pt``) hold the same weights in the training dtype; the fp32
masters of the optimizer files are read instead, as for every other parameter.
"""
from __future__ import annotations

import glob
import os
import re
from typing import Any, Dict, List, Optional, Sequence, Tuple

from ...errors import CheckpointError
from .layout import Span, zero12_spans

#: DeepSpeed's name of a local expert's parameter: (the experts' holder, local id, the expert's parameter name)
_LOCAL = re.compile(r"^(.*\.deepspeed_experts)\.(\d+)\.(.+)$")
Shapes = List[List[Tuple[str, List[int]]]]


def is_moe_checkpoint(ms: Dict[str, Any]) -> bool:
    """Whether DeepSpeed's model states come from an engine with MoE layers (it adds ``num_experts``)."""
    return "num_experts" in ms


def refuse_unsupported(path: str, ms: Dict[str, Any], file: str) -> None:
    """The MoE checkpoints this reader does not map: without ZeRO (optimizer per expert rank), the layout
    before per-layer expert files, AutoEP layers, and data ranks placed before expert ranks."""
    if glob.glob(os.path.join(glob.escape(path), "expp_rank_*_optim_states.pt")):
        raise CheckpointError(f"DeepSpeed checkpoint {path}: an MoE checkpoint without ZeRO (expp_rank_* optimizer "
                              f"files) is not read by this shardspeed; save it from a run at ZeRO stage 1 or 2")
    if not isinstance(ms.get("num_experts"), list) or ms.get("ds_autoep_layers"):
        raise CheckpointError(f"DeepSpeed checkpoint file {file}: field 'num_experts' is {ms.get('num_experts')!r} "
                              f"and 'ds_autoep_layers' {'set' if ms.get('ds_autoep_layers') else 'empty'}; only "
                              f"native MoE layers saved per layer (DeepSpeed 0.6 and later) are read")
    if (ms.get("ds_config") or {}).get("use_data_before_expert_parallelism"):
        raise CheckpointError(f"DeepSpeed checkpoint file {file}: field 'ds_config' sets "
                              f"use_data_before_expert_parallelism; only DeepSpeed's default expert group layout "
                              f"is read")


def _parse(name: str, file: str) -> Tuple[str, int, str]:
    m = _LOCAL.match(name)
    if m is None:
        raise CheckpointError(f"DeepSpeed checkpoint file {file}: field 'param_shapes' puts {name!r} in an expert "
                              f"parameter group, but it is no parameter of a native MoE layer's experts")
    return m[1], int(m[2]), m[3]


def _expert_group(params: Sequence[Tuple[str, List[int]]], pads: Optional[Sequence[int]],
                  parts: Sequence[Tuple[int, int]], count: int, world: int, g: int, local: Dict[str, int],
                  file: str) -> Tuple[List[Span], List[Tuple[str, List[int]]]]:
    """Spans (in our stacked tensors' coordinates) and the stacked tensors of expert group ``g``; ``local``:
    the local experts of each layer (its holder's name)."""
    if count < 1 or world % count:
        raise CheckpointError(f"DeepSpeed checkpoint file {file}: field 'partition_count' of group {g} is {count}, "
                              f"which does not divide the {world} data ranks")
    ep = world // count
    parsed = [_parse(n, file) for n, _ in params]
    shapes: Dict[str, List[int]] = {}
    for (holder, _i, pname), (_, shape) in zip(parsed, params):
        key = f"{holder}.{pname}"
        if shapes.setdefault(key, list(shape)) != list(shape):
            raise CheckpointError(f"DeepSpeed checkpoint file {file}: field 'param_shapes' gives the local experts "
                                  f"of {holder!r} different shapes for {pname!r}")
    numels = [(n, _numel(s)) for n, s in params]
    spans: List[Span] = []
    for q in range(ep):
        ranks = [q + j * ep for j in range(count)]
        for s in zero12_spans([numels], None if pads is None else [pads], [[parts[r] for r in ranks]]):
            holder, i, pname = parsed[[n for n, _ in numels].index(s.name)]
            base = (q * local[holder] + i) * _numel(shapes[f"{holder}.{pname}"])
            spans.append(Span(f"{holder}.{pname}", base + s.start, base + s.end, ranks[s.rank], g, s.offset))
    table = [(key, [ep * local[_holder(key)]] + shape) for key, shape in shapes.items()]
    return spans, table


def _holder(stacked: str) -> str:
    return stacked.rsplit(".deepspeed_experts.", 1)[0] + ".deepspeed_experts"


def _numel(shape: Sequence[int]) -> int:
    n = 1
    for d in shape:
        n *= int(d)
    return n


def moe_spans(shapes: Shapes, paddings: Optional[Sequence[Sequence[int]]], parts: Sequence[Sequence[Tuple[int, int]]],
              counts: Sequence[int], world: int, num_experts: Sequence[int], file: str) -> Tuple[List[Span], Shapes]:
    """Spans of a ZeRO 1-2 MoE checkpoint and the trained tensors per group as ours names them (expert
    parameters stacked over every expert). ``counts[g]``: group ``g``'s ``partition_count``; ``parts[g][r]``:
    (elements rank ``r`` saved, its partition size)."""
    spans: List[Span] = []
    table: Shapes = []
    experts_of: Dict[str, int] = {}
    local: Dict[str, int] = {}  # a layer's local experts, counted over all expert groups (a group may be cut)
    # expert groups by their names (at EP 1 their partition_count is the world's, as a dense group's)
    experts = [bool(params) and all(_LOCAL.match(n) for n, _ in params) for params in shapes]
    for g, params in enumerate(shapes):
        for n, _ in params if experts[g] else ():
            holder, i, _ = _parse(n, file)
            local[holder] = max(local.get(holder, 0), i + 1)
    for g, params in enumerate(shapes):
        pads = list(paddings[g]) if paddings is not None else None
        if not experts[g]:
            for s in zero12_spans([[(n, _numel(sh)) for n, sh in params]], None if pads is None else [pads],
                                  [parts[g]]):
                spans.append(Span(s.name, s.start, s.end, s.rank, g, s.offset))
            table.append([(n, list(sh)) for n, sh in params])
            continue
        got, tensors = _expert_group(params, pads, parts[g], counts[g], world, g, local, file)
        spans += got
        table.append(tensors)
        for name, shape in tensors:
            experts_of.setdefault(_holder(name), shape[0])
    if sorted(experts_of.values()) != sorted(int(n) for n in num_experts):
        raise CheckpointError(f"DeepSpeed checkpoint file {file}: field 'num_experts' is {list(num_experts)}, but "
                              f"its expert parameter groups hold layers of {sorted(experts_of.values())} experts")
    return spans, table
