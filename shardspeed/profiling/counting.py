"""Counting: FLOPs per op at the dispatcher (``FlopCounterMode`` with the formulas its table lacks), and the
per-op counts of each module turned into inclusive per-module profiles (FLOPs, MACs, parameters, latency).

Two additions to torch's formula table: the CPU attention kernel (``_scaled_dot_product_flash_attention_for_cpu``
and its backward, absent from torch's table) and DeepSpeed's estimates for the element-wise functions it
counts (layer norm 5 FLOPs per element, 4 without affine; GELU/ReLU/SiLU and softmax 1), forward only, so
that the forward totals are DeepSpeed's. MACs are the matmul-type FLOPs halved (element-wise ops carry no
MACs, as in DeepSpeed).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Collection, Dict, List, Optional, Tuple

import torch
import torch.nn as nn
from torch.utils.flop_counter import FlopCounterMode, sdpa_backward_flop_count, sdpa_flop_count

aten = torch.ops.aten


# ---- formulas torch's table lacks ---------------------------------------------------------------------
def _cpu_sdpa_flop(query_shape, key_shape, value_shape, *args, out_shape=None, **kwargs) -> int:
    return sdpa_flop_count(query_shape, key_shape, value_shape)


def _cpu_sdpa_backward_flop(grad_out_shape, query_shape, key_shape, value_shape, *args, out_shape=None,
                            **kwargs) -> int:
    return sdpa_backward_flop_count(grad_out_shape, query_shape, key_shape, value_shape)


def _numel(shape) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def _layer_norm_flop(input_shape, normalized_shape, weight_shape=None, *args, out_shape=None, **kwargs) -> int:
    return _numel(input_shape) * (5 if weight_shape is not None else 4)


def _unary_flop(input_shape, *args, out_shape=None, **kwargs) -> int:
    return _numel(input_shape)


def _optional_ops(*names: str) -> List[Any]:
    return [getattr(aten, n) for n in names if hasattr(aten, n)]


def _extra_formulas() -> Dict[Any, Callable]:
    table: Dict[Any, Callable] = {}
    for op in _optional_ops("_scaled_dot_product_flash_attention_for_cpu"):
        table[op] = _cpu_sdpa_flop
    for op in _optional_ops("_scaled_dot_product_flash_attention_for_cpu_backward"):
        table[op] = _cpu_sdpa_backward_flop
    for op in _optional_ops("native_layer_norm"):
        table[op] = _layer_norm_flop
    for op in _optional_ops("gelu", "relu", "silu", "_softmax", "leaky_relu", "elu", "hardtanh"):
        table[op] = _unary_flop
    return table


#: Ops counted with FLOPs but no MACs (DeepSpeed's element-wise estimates).
_ELEMENTWISE = frozenset({str(op) for op in _optional_ops("native_layer_norm", "gelu", "relu", "silu", "_softmax",
                                                 "leaky_relu", "elu", "hardtanh")})


def flop_counter() -> FlopCounterMode:
    """A counter with the formulas above (display off: the report is ours)."""
    return FlopCounterMode(display=False, custom_mapping=_extra_formulas())


def flops_and_macs(per_op: Dict[Any, int]) -> Tuple[int, int]:
    """(FLOPs, MACs) of one module's per-op counts."""
    flops = sum(per_op.values())
    macs = sum(v for k, v in per_op.items() if str(k) not in _ELEMENTWISE) // 2
    return flops, macs


@dataclass
class ModuleProfile:
    """One module's forward profile (inclusive of its submodules, as DeepSpeed reports)."""

    params: int
    flops: int
    macs: int
    duration: float


def module_profiles(model: nn.Module, counts: Dict[str, Dict[Any, int]], ignored: Collection[type],
                    param_numel: Callable[[nn.Parameter], int], duration: Callable[[nn.Module], float]
                    ) -> Dict[int, ModuleProfile]:
    """Every module's inclusive profile (by ``id``) from a counter's per-name counts (names are ``Root.fqn``).
    ``ignored``: module types whose own counts go to their parent; ``duration``: a module's forward latency."""
    incl = _inclusive(model, counts)
    own = _own(model, incl, counts, ignored)

    def profile(m: nn.Module) -> ModuleProfile:
        subs = list(m.modules())  # de-duplicated, as DeepSpeed's sums over module.modules()
        flops = sum(own.get(id(s), [0, 0])[0] for s in subs)
        macs = sum(own.get(id(s), [0, 0])[1] for s in subs)
        params = sum(param_numel(p) for p in m.parameters())
        return ModuleProfile(params, flops, macs, duration(m))

    return {id(m): profile(m) for m in model.modules()}


def _inclusive(model: nn.Module, counts: Dict[str, Dict[Any, int]]) -> Dict[int, Tuple[int, int]]:
    """(FLOPs, MACs) of each module with its submodules: the counter's, or its children's sum for a module
    that never ran (ModuleList) or ran without counted ops."""
    root = type(model).__name__
    names: Dict[int, str] = {}
    for fqn, m in model.named_modules():
        names.setdefault(id(m), f"{root}.{fqn}" if fqn else root)
    incl: Dict[int, Tuple[int, int]] = {}

    def inclusive(m: nn.Module) -> Tuple[int, int]:
        if id(m) not in incl:
            kids = [inclusive(c) for c in m.children()]
            name = names.get(id(m))
            if name in counts:
                incl[id(m)] = flops_and_macs(counts[name])
            else:
                incl[id(m)] = (sum(k[0] for k in kids), sum(k[1] for k in kids))
        return incl[id(m)]

    inclusive(model)
    return incl


def _own(model: nn.Module, incl: Dict[int, Tuple[int, int]], counts: Dict[str, Dict[Any, int]],
         ignored: Collection[type]) -> Dict[int, List[int]]:
    """[FLOPs, MACs] of each module alone: inclusive less its children's. An ignored module's own counts go to
    its parent (as in DeepSpeed, whose ignored modules get no hooks, so their functionals land in the
    enclosing module); what was counted outside the model's forward (e.g. a loss on its output) to the root."""
    own: Dict[int, List[int]] = {}
    if "Global" in counts:
        gf, gm = flops_and_macs(counts["Global"])
        tf, tm = incl[id(model)]
        extra = (gf - tf, gm - tm)
    else:
        extra = (0, 0)

    def assign(m: nn.Module, parent: Optional[int]) -> None:
        f, c = incl[id(m)]
        for child in m.children():
            cf, cc = incl[id(child)]
            f, c = f - cf, c - cc
        target = parent if (type(m) in ignored and parent is not None) else id(m)
        slot = own.setdefault(target, [0, 0])
        slot[0] += f
        slot[1] += c
        own.setdefault(id(m), [0, 0])
        for child in m.children():
            assign(child, target)

    assign(model, None)
    own[id(model)][0] += max(extra[0], 0)
    own[id(model)][1] += max(extra[1], 0)
    return own
