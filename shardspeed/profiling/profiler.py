"""A FLOPs profiler on ``torch.utils.flop_counter.FlopCounterMode`` with DeepSpeed's API and report layout.

FLOPs are counted at the dispatcher (every ``aten.mm/addmm/bmm/baddbmm``, convolution and attention kernel,
whichever Python path reached it), attributed to modules by ``FlopCounterMode``'s module tracker. Two
additions to its formula table: the CPU attention kernel (``_scaled_dot_product_flash_attention_for_cpu``
and its backward, absent from torch's table) and DeepSpeed's estimates for the element-wise functions it
counts (layer norm 5 FLOPs per element, 4 without affine; GELU/ReLU/SiLU and softmax 1), forward only, so
that the forward totals are DeepSpeed's. MACs are the matmul-type FLOPs halved (element-wise ops carry no
MACs, as in DeepSpeed). Latency per module comes from forward hooks, as in DeepSpeed.
"""
from __future__ import annotations

import os
import sys
import time
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Set, Tuple

import torch
import torch.nn as nn
from torch.utils.flop_counter import FlopCounterMode, sdpa_backward_flop_count, sdpa_flop_count

aten = torch.ops.aten
DEFAULT_PRECISION = 2


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
_ELEMENTWISE = {str(op) for op in _optional_ops("native_layer_norm", "gelu", "relu", "silu", "_softmax",
                                                 "leaky_relu", "elu", "hardtanh")}


def _counter() -> FlopCounterMode:
    return FlopCounterMode(display=False, custom_mapping=_extra_formulas())


def _split(per_op: Dict[Any, int]) -> Tuple[int, int]:
    """(FLOPs, MACs) of one module's per-op counts."""
    flops = sum(per_op.values())
    macs = sum(v for k, v in per_op.items() if str(k) not in _ELEMENTWISE) // 2
    return flops, macs


# ---- number formatting (DeepSpeed's strings) ----------------------------------------------------------
_MAGNITUDES = [(1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "K")]


def number_to_string(num: float, units: Optional[str] = None, precision: int = DEFAULT_PRECISION) -> str:
    if units is None:
        magnitude, units = 1e-6, "u"
        for m, u in _MAGNITUDES:
            if num >= m:
                magnitude, units = m, u
                break
        else:
            if num >= 1 or num == 0:
                magnitude, units = 1, ""
            elif num >= 1e-3:
                magnitude, units = 1e-3, "m"
    else:
        magnitude = {u: m for m, u in _MAGNITUDES + [(1e-3, "m"), (1e-6, "u")]}.get(units, 1)
    return f"{round(num / magnitude, precision):g} {units}"


def macs_to_string(macs: float, units: Optional[str] = None, precision: int = DEFAULT_PRECISION) -> str:
    return f"{number_to_string(macs, units, precision)}MACs"


def flops_to_string(flops: float, units: Optional[str] = None, precision: int = DEFAULT_PRECISION) -> str:
    return f"{number_to_string(flops, units, precision)}FLOPS"


def params_to_string(params: float, units: Optional[str] = None, precision: int = DEFAULT_PRECISION) -> str:
    units = units.replace("B", "G") if units else units
    return number_to_string(params, units, precision).replace("G", "B").strip()


def duration_to_string(seconds: float, units: Optional[str] = None, precision: int = DEFAULT_PRECISION) -> str:
    return f"{number_to_string(seconds, units, precision)}s"


# ---- the profiler -----------------------------------------------------------------------------------------
@dataclass
class ModuleProfile:
    """One module's forward profile (inclusive of its submodules, as DeepSpeed reports)."""

    params: int
    flops: int
    macs: int
    duration: float


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


class FlopsProfiler:
    """DeepSpeed's ``FlopsProfiler`` API: ``start_profile()``, run the forward, ``get_total_flops()``, ...,
    ``print_model_profile()``, ``end_profile()``. Counts what runs between start and stop (forward and, if
    run, backward: :meth:`get_total_flops` is the forward's, :meth:`get_backward_flops` the backward's).

    ``param_numel`` gives a parameter's true size where the module holds a placeholder (ZeRO-3 shards).
    """

    def __init__(self, model: nn.Module, ds_engine: Any = None, recompute_fwd_factor: float = 0.0,
                 param_numel: Optional[Callable[[nn.Parameter], int]] = None):
        self.model = model
        self.ds_engine = ds_engine
        self.recompute_fwd_factor = recompute_fwd_factor
        self.param_numel = param_numel or (lambda p: p.numel())
        self.started = False
        self._counter: Optional[FlopCounterMode] = None
        self._bwd_counter: Optional[FlopCounterMode] = None
        self._hooks: List[Any] = []
        self._ignored: Set[type] = set()
        self._t0: Dict[int, float] = {}
        self._duration: Dict[int, float] = {}
        self._profile: Dict[int, ModuleProfile] = {}
        self._bwd_flops = 0
        self._sync = False
        self.flops = self.macs = self.params = 0

    # ---- start / stop --------------------------------------------------------------------------------
    def start_profile(self, ignore_list: Optional[Sequence[type]] = None) -> None:
        """Reset the counts and start counting (FLOPs at the dispatcher, latency per module)."""
        if self.started:
            self.stop_profile()
        self.reset_profile()
        self._ignored = set(ignore_list or ())
        self._sync = any(p.is_cuda for p in self.model.parameters())
        for m in self.model.modules():
            if type(m) in self._ignored:
                continue
            self._hooks.append(m.register_forward_pre_hook(self._pre_hook))
            self._hooks.append(m.register_forward_hook(self._post_hook))
        self._counter = _counter()
        self._counter.__enter__()
        torch.zeros(1).add_(1)  # the mode's first op imports torch._dynamo (seconds): not in any module's latency
        self.started = True

    def stop_profile(self) -> None:
        """Stop counting; the counts stay readable until :meth:`end_profile` or the next start."""
        if self._counter is not None and self._counter.mode is not None:
            self._counter.__exit__(None, None, None)
            self._aggregate()
        for h in self._hooks:
            h.remove()
        self._hooks.clear()

    def reset_profile(self) -> None:
        self._counter = None
        self._duration.clear()
        self._t0.clear()
        self._profile.clear()
        self._bwd_flops = 0

    def end_profile(self) -> None:
        """Stop and drop everything (hooks, counts)."""
        if not self.started:
            return
        self.stop_profile()
        self.reset_profile()
        self.started = False

    @contextmanager
    def count_backward(self) -> Iterator[None]:
        """Count the FLOPs of what runs inside (a backward) as backward FLOPs (added up over calls)."""
        counter = _counter()
        with counter:
            yield
        self._bwd_flops += counter.get_total_flops()

    # ---- hooks ------------------------------------------------------------------------------------------
    def _now(self) -> float:
        if self._sync:
            torch.cuda.synchronize()
        return time.perf_counter()

    def _pre_hook(self, module: nn.Module, inputs) -> None:
        self._t0[id(module)] = self._now()

    def _post_hook(self, module: nn.Module, inputs, output) -> None:
        t0 = self._t0.pop(id(module), None)
        if t0 is not None:
            self._duration[id(module)] = self._duration.get(id(module), 0.0) + self._now() - t0

    # ---- aggregation -----------------------------------------------------------------------------------
    def _aggregate(self) -> None:
        """Per-module inclusive profiles from the counter's per-name counts (names are ``Root.fqn``)."""
        assert self._counter is not None
        counts = self._counter.get_flop_counts()
        root = type(self.model).__name__
        names: Dict[int, str] = {}
        for fqn, m in self.model.named_modules():
            names.setdefault(id(m), f"{root}.{fqn}" if fqn else root)
        incl: Dict[int, Tuple[int, int]] = {}

        def inclusive(m: nn.Module) -> Tuple[int, int]:
            if id(m) not in incl:
                kids = [inclusive(c) for c in m.children()]
                name = names.get(id(m))
                if name in counts:
                    incl[id(m)] = _split(counts[name])
                else:  # never ran (ModuleList) or ran without counted ops: its children's sum
                    incl[id(m)] = (sum(k[0] for k in kids), sum(k[1] for k in kids))
            return incl[id(m)]

        inclusive(self.model)
        # own = inclusive - children's; an ignored module's own counts go to its parent (as in DeepSpeed,
        # whose ignored modules get no hooks, so their functionals land in the enclosing module)
        own: Dict[int, List[int]] = {}
        if "Global" in counts:
            gf, gm = _split(counts["Global"])
            tf, tm = incl[id(self.model)]
            extra = (gf - tf, gm - tm)  # counted outside the model's forward (e.g. a loss on its output)
        else:
            extra = (0, 0)

        def assign(m: nn.Module, parent: Optional[int]) -> None:
            f, c = incl[id(m)]
            for child in m.children():
                cf, cc = incl[id(child)]
                f, c = f - cf, c - cc
            target = parent if (type(m) in self._ignored and parent is not None) else id(m)
            slot = own.setdefault(target, [0, 0])
            slot[0] += f
            slot[1] += c
            own.setdefault(id(m), [0, 0])
            for child in m.children():
                assign(child, target)

        assign(self.model, None)
        own[id(self.model)][0] += max(extra[0], 0)
        own[id(self.model)][1] += max(extra[1], 0)

        def profile(m: nn.Module) -> ModuleProfile:
            subs = list(m.modules())  # de-duplicated, as DeepSpeed's sums over module.modules()
            flops = sum(own.get(id(s), [0, 0])[0] for s in subs)
            macs = sum(own.get(id(s), [0, 0])[1] for s in subs)
            params = sum(self.param_numel(p) for p in m.parameters())
            return ModuleProfile(params, flops, macs, self._module_duration(m))

        for m in self.model.modules():
            self._profile[id(m)] = profile(m)
        top = self._profile[id(self.model)]
        self.flops, self.macs, self.params = top.flops, top.macs, top.params

    def _module_duration(self, m: nn.Module) -> float:
        d = self._duration.get(id(m), 0.0)
        if d == 0:  # e.g. a ModuleList: its children's
            d = sum(self._module_duration(c) for c in m.children())
        return d

    def _top(self) -> ModuleProfile:
        if self._counter is not None and self._counter.mode is not None:  # still counting: read it live
            self.stop_profile()
        return self._profile.get(id(self.model), ModuleProfile(0, 0, 0, 0.0))

    def module_profile(self, module: nn.Module) -> ModuleProfile:
        self._top()
        return self._profile.get(id(module), ModuleProfile(0, 0, 0, 0.0))

    # ---- totals (DeepSpeed's getters) --------------------------------------------------------------------
    def get_total_flops(self, as_string: bool = False):
        """Forward FLOPs of the profiled run(s)."""
        v = self._top().flops
        return number_to_string(v) if as_string else v

    def get_total_macs(self, as_string: bool = False):
        v = self._top().macs
        return macs_to_string(v) if as_string else v

    def get_total_duration(self, as_string: bool = False):
        v = self._top().duration
        return duration_to_string(v) if as_string else v

    def get_total_params(self, as_string: bool = False):
        if not self._profile:
            v = sum(self.param_numel(p) for p in self.model.parameters())
        else:
            v = self._top().params
        return params_to_string(v) if as_string else v

    def get_backward_flops(self, as_string: bool = False):
        """Backward FLOPs measured under :meth:`count_backward` (0 when none ran)."""
        return number_to_string(self._bwd_flops) if as_string else self._bwd_flops

    # ---- the report ---------------------------------------------------------------------------------------
    def print_model_profile(self, profile_step: int = 1, module_depth: int = -1, top_modules: int = 1,
                            detailed: bool = True, output_file: Optional[str] = None,
                            run: Optional[RunInfo] = None) -> None:
        """Print DeepSpeed's report (to ``output_file`` when given): summary, aggregated profile per depth,
        and with ``detailed`` the module tree with each module's params, MACs, latency and FLOPS."""
        if not self.started:
            return
        text = self.format_model_profile(profile_step, module_depth, top_modules, detailed, run)
        if output_file:
            os.makedirs(os.path.dirname(os.path.abspath(output_file)), exist_ok=True)
            with open(output_file, "w") as f:
                f.write(text)
        else:
            sys.stdout.write(text)
            sys.stdout.flush()

    def format_model_profile(self, profile_step: int = 1, module_depth: int = -1, top_modules: int = 1,
                             detailed: bool = True, run: Optional[RunInfo] = None) -> str:
        lines: List[str] = []
        out = lines.append
        top = self._top()
        total_flops, total_macs, total_params, total_duration = top.flops, top.macs, top.params, top.duration
        mp = run.mp_size if run is not None else 1
        out("\n-------------------------- DeepSpeed Flops Profiler --------------------------")
        out(f"Profile Summary at step {profile_step}:")
        out("Notations:\n"
            "data parallel size (dp_size), model parallel size(mp_size),\n"
            "number of parameters (params), number of multiply-accumulate operations(MACs),\n"
            "number of floating-point operations (flops), floating-point operations per second (FLOPS),\n"
            "fwd latency (forward propagation latency), bwd latency (backward propagation latency),\n"
            "step (weights update latency), iter latency (sum of fwd, bwd and step latency)\n")
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
            bwd_factor = 2 + self.recompute_fwd_factor
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

        out("\n----------------------------- Aggregated Profile per GPU -----------------------------")
        lines.extend(self._aggregated(module_depth, top_modules))
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
            out(self._tree(self.model, "", top))
        out("------------------------------------------------------------------------------")
        return "\n".join(lines) + "\n"

    def _aggregated(self, module_depth: int, top_modules: int) -> List[str]:
        """Top modules by class name at each depth (DeepSpeed's walk: depths 0 .. depth-1)."""
        info: Dict[int, Dict[str, List[float]]] = {}

        def walk(m: nn.Module, d: int) -> None:
            p = self._profile.get(id(m), ModuleProfile(0, 0, 0, 0.0))
            row = info.setdefault(d, {}).setdefault(type(m).__name__, [0, 0, 0.0])
            row[0] += p.macs
            row[1] += p.params
            row[2] += p.duration
            for c in m.children():
                walk(c, d + 1)

        walk(self.model, 0)
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

    def _repr(self, m: nn.Module, total: ModuleProfile) -> str:
        p = self._profile.get(id(m), ModuleProfile(0, 0, 0, 0.0))

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

    def _tree(self, m: nn.Module, indent: str, total: ModuleProfile) -> str:
        """``print(model)``'s layout with the profile in front of each module's own description."""
        desc = self._repr(m, total)
        children = list(m.named_children())
        if not children:
            return f"{type(m).__name__}({desc})"
        body = [f"{indent}  {desc}"] + [f"{indent}  ({name}): {self._tree(c, indent + '  ', total)}"
                                        for name, c in children]
        return f"{type(m).__name__}(\n" + "\n".join(body) + f"\n{indent})"


def _run(model: nn.Module, args: Sequence[Any], kwargs: Dict[str, Any], mode: str) -> None:
    if mode not in ("forward", "generate"):
        raise ValueError(f"mode must be 'forward' or 'generate', got {mode!r}")
    fn: Callable[..., Any] = model if mode == "forward" else getattr(model, "generate")  # noqa: B009
    fn(*args, **kwargs)


def get_model_profile(model: nn.Module, input_shape: Optional[tuple] = None, args: Sequence[Any] = (),
                      kwargs: Optional[Dict[str, Any]] = None, print_profile: bool = True, detailed: bool = True,
                      module_depth: int = -1, top_modules: int = 1, warm_up: int = 1, as_string: bool = True,
                      output_file: Optional[str] = None, ignore_modules: Optional[Sequence[type]] = None,
                      mode: str = "forward"):
    """DeepSpeed's ``get_model_profile``: ``(flops, macs, params)`` of one forward of ``model`` (strings when
    ``as_string``), after ``warm_up`` untimed runs; prints the report unless ``print_profile`` is False.

    ``input_shape`` makes one input tensor of that shape in the model's dtype and device (as DeepSpeed:
    give token ids through ``args`` instead). The model is put in eval mode, as DeepSpeed does.
    """
    if not isinstance(model, nn.Module):
        raise TypeError("model must be a torch.nn.Module")
    kwargs = kwargs or {}
    model.eval()
    if input_shape is not None:
        if not isinstance(input_shape, tuple) or len(input_shape) < 1:
            raise ValueError("input_shape must be a non-empty tuple")
        first = next(model.parameters(), None)
        x = (torch.empty(input_shape, dtype=first.dtype, device=first.device) if first is not None
             else torch.empty(input_shape))
        args = [x]
    if not args and not kwargs:
        raise ValueError("give input_shape, args or kwargs")
    prof = FlopsProfiler(model)
    for _ in range(warm_up):
        _run(model, args, kwargs, mode)
    prof.start_profile(ignore_list=ignore_modules)
    _run(model, args, kwargs, mode)
    prof.stop_profile()
    flops, macs, params = prof.get_total_flops(), prof.get_total_macs(), prof.get_total_params()
    if print_profile:
        prof.print_model_profile(profile_step=warm_up, module_depth=module_depth, top_modules=top_modules,
                                 detailed=detailed, output_file=output_file)
    prof.end_profile()
    if as_string:
        return number_to_string(flops), macs_to_string(macs), params_to_string(params)
    return flops, macs, params
