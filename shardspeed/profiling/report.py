"""DeepSpeed's report of a profile: the summary (sizes, FLOPs, latencies and throughputs), the top modules
at each depth, and the module tree with each module's parameters, MACs, latency and FLOPS."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Dict, List, Optional

import torch.nn as nn

from .counting import ModuleProfile
from .strings import (
    DEFAULT_PRECISION,
    duration_to_string,
    flops_to_string,
    macs_to_string,
    number_to_string,
    params_to_string,
)


@dataclass
class RunInfo:
    """What an engine adds to the report: sizes and the step's wall-clock phases (seconds)."""

    world_size: int
    dp_size: int
    mp_size: int
    micro_batch_size: int
    fwd_latency: float
    bwd_latency: Optional[float] = None
    step_latency: Optional[float] = None
    bwd_flops: Optional[int] = None  # measured backward FLOPs (our addition to the report)


def format_report(model: nn.Module, profiles: Dict[int, ModuleProfile], recompute_fwd_factor: float = 0.0,
                  profile_step: int = 1, module_depth: int = -1, top_modules: int = 1, detailed: bool = True,
                  run: Optional[RunInfo] = None) -> str:
    """The report of ``model``'s ``profiles`` (by module ``id``, as :func:`~.counting.module_profiles` makes
    them); ``run`` adds the engine's sizes and backward/step latencies."""
    top = profiles.get(id(model), ModuleProfile(0, 0, 0, 0.0))
    lines: List[str] = []
    out = lines.append
    out("\n-------------------------- DeepSpeed Flops Profiler --------------------------")
    out(f"Profile Summary at step {profile_step}:")
    out("Notations:\n"
        "data parallel size (dp_size), model parallel size(mp_size),\n"
        "number of parameters (params), number of multiply-accumulate operations(MACs),\n"
        "number of floating-point operations (flops), floating-point operations per second (FLOPS),\n"
        "fwd latency (forward propagation latency), bwd latency (backward propagation latency),\n"
        "step (weights update latency), iter latency (sum of fwd, bwd and step latency)\n")
    lines.extend(_summary(top, recompute_fwd_factor, run))
    out("\n----------------------------- Aggregated Profile per GPU -----------------------------")
    lines.extend(_aggregated(model, profiles, module_depth, top_modules))
    if detailed:
        out("\n------------------------------ Detailed Profile per GPU ------------------------------")
        out("Each module profile is listed after its name in the following order: \nparams, percentage of "
            "total params, MACs, percentage of total MACs, fwd latency, percentage of total fwd latency, "
            "fwd FLOPS")
        out("\nNote: 1. A module can have torch.nn.module or torch.nn.functional to compute logits (e.g. "
            "CrossEntropyLoss). They are not counted as submodules, thus not to be printed out. However they "
            "make up the difference between a parent's MACs (or latency) and the sum of its submodules'.\n"
            "2. Number of floating-point operations is a theoretical estimation, thus FLOPS computed using "
            "that could be larger than the maximum system throughput.\n3. The fwd latency listed in the top "
            "module's profile is directly captured at the module forward function in PyTorch, thus it's less "
            "than the fwd latency shown above which is captured in DeepSpeed.\n")
        out(_tree(profiles, model, "", top))
    out("------------------------------------------------------------------------------")
    return "\n".join(lines) + "\n"


def _summary(top: ModuleProfile, recompute_fwd_factor: float, run: Optional[RunInfo]) -> List[str]:
    """The profile summary's lines: sizes, forward FLOPs and latency, and with ``run`` the backward, step and
    iteration latencies and throughputs (backward FLOPs estimated as ``2 + recompute_fwd_factor`` forwards)."""
    lines: List[str] = []
    out = lines.append
    total_flops, total_macs, total_params, total_duration = top.flops, top.macs, top.params, top.duration
    mp = run.mp_size if run is not None else 1
    fmt = "{:<70}  {:<8}".format
    if run is not None:
        out(fmt("world size: ", run.world_size))
        out(fmt("data parallel size: ", run.dp_size))
        out(fmt("model parallel size: ", run.mp_size))
        out(fmt("batch size per GPU: ", run.micro_batch_size))
    out(fmt("params per GPU: ", params_to_string(total_params)))
    out(fmt("params of model = params per GPU * mp_size: ", params_to_string(total_params * mp if run else 0)))
    out(fmt("fwd MACs per GPU: ", macs_to_string(total_macs)))
    out(fmt("fwd flops per GPU: ", number_to_string(total_flops)))
    out(fmt("fwd flops of model = fwd flops per GPU * mp_size: ", number_to_string(total_flops * mp)))
    fwd_latency = run.fwd_latency if run is not None else total_duration
    out(fmt("fwd latency: ", duration_to_string(fwd_latency)))
    out(fmt("fwd FLOPS per GPU = fwd flops per GPU / fwd latency: ",
            flops_to_string(total_flops / fwd_latency if fwd_latency else 0)))
    if run is not None and run.bwd_latency is not None and run.step_latency is not None:
        bwd_factor = 2 + recompute_fwd_factor
        bwd, step = run.bwd_latency, run.step_latency
        out(fmt("bwd latency: ", duration_to_string(bwd)))
        out(fmt(f"bwd FLOPS per GPU = {bwd_factor:g} * fwd flops per GPU / bwd latency: ",
                flops_to_string(bwd_factor * total_flops / bwd if bwd else 0)))
        if run.bwd_flops:
            out(fmt("bwd flops per GPU (measured): ", number_to_string(run.bwd_flops)))
        out(fmt(f"fwd+bwd FLOPS per GPU = {bwd_factor + 1:g} * fwd flops per GPU / (fwd+bwd latency): ",
                flops_to_string((bwd_factor + 1) * total_flops / (fwd_latency + bwd) if fwd_latency + bwd else 0)))
        out(fmt("step latency: ", duration_to_string(step)))
        it = fwd_latency + bwd + step
        out(fmt("iter latency: ", duration_to_string(it)))
        out(fmt(f"FLOPS per GPU = {bwd_factor + 1:g} * fwd flops per GPU / iter latency: ",
                flops_to_string((bwd_factor + 1) * total_flops / it if it else 0)))
        out(fmt("samples/second: ", round(run.micro_batch_size * run.world_size / it, DEFAULT_PRECISION)
                if it else 0))
    return lines


def _aggregated(model: nn.Module, profiles: Dict[int, ModuleProfile], module_depth: int, top_modules: int
                ) -> List[str]:
    """Top modules by class name at each depth (DeepSpeed's walk: depths 0 .. depth-1)."""
    info: Dict[int, Dict[str, List[float]]] = {}

    def walk(m: nn.Module, d: int) -> None:
        p = profiles.get(id(m), ModuleProfile(0, 0, 0, 0.0))
        row = info.setdefault(d, {}).setdefault(type(m).__name__, [0, 0, 0.0])
        row[0] += p.macs
        row[1] += p.params
        row[2] += p.duration
        for c in m.children():
            walk(c, d + 1)

    walk(model, 0)
    depth = len(info) - 1 if module_depth == -1 else module_depth
    lines = [f"Top {top_modules} modules in terms of params, MACs or fwd latency at different model depths:"]
    for d in range(min(depth, len(info))):
        n = min(top_modules, len(info[d]))

        def top_by(i: int, fn: Callable[[float], str], rows: Dict[str, List[float]] = info[d],
                   n: int = n) -> Dict[str, str]:
            items = sorted(rows.items(), key=lambda kv: kv[1][i], reverse=True)[:n]
            return {k: fn(v[i]) for k, v in items}

        lines.append(f"depth {d}:")
        lines.append(f"    params      - {top_by(1, params_to_string)}")
        lines.append(f"    MACs        - {top_by(0, macs_to_string)}")
        lines.append(f"    fwd latency - {top_by(2, duration_to_string)}")
    return lines

def _repr(profiles: Dict[int, ModuleProfile], m: nn.Module, total: ModuleProfile) -> str:
    p = profiles.get(id(m), ModuleProfile(0, 0, 0, 0.0))

    def pct(a: float, b: float) -> float:
        return round(100 * a / b, DEFAULT_PRECISION) if b else 0

    items = [f"{params_to_string(p.params)} = {pct(p.params, total.params):g}% Params",
             f"{macs_to_string(p.macs)} = {pct(p.macs, total.macs):g}% MACs",
             f"{duration_to_string(p.duration)} = {pct(p.duration, total.duration):g}% latency",
             flops_to_string(round(p.flops / p.duration, DEFAULT_PRECISION) if p.duration else 0)]
    extra = m.extra_repr()
    if extra:
        items.append(extra)
    return ", ".join(items)

def _tree(profiles: Dict[int, ModuleProfile], m: nn.Module, indent: str, total: ModuleProfile) -> str:
    """``print(model)``'s layout with the profile in front of each module's own description."""
    desc = _repr(profiles, m, total)
    children = list(m.named_children())
    if not children:
        return f"{type(m).__name__}({desc})"
    body = [f"{indent}  {desc}"] + [f"{indent}  ({name}): {_tree(profiles, c, indent + '  ', total)}"
                                    for name, c in children]
    return f"{type(m).__name__}(\n" + "\n".join(body) + f"\n{indent})"
