"""A FLOPs profiler on ``torch.utils.flop_counter.FlopCounterMode`` with DeepSpeed's API and report layout.

FLOPs are counted at the dispatcher (every ``aten.mm/addmm/bmm/baddbmm``, convolution and attention kernel,
whichever Python path reached it), attributed to modules by ``FlopCounterMode``'s module tracker, with the
formulas torch's table lacks (:mod:`.counting`). MACs are the matmul-type FLOPs halved. Latency per module
comes from forward hooks, as in DeepSpeed (:mod:`.latency`). The report is :mod:`.report`'s, its number
strings :mod:`.strings`' (re-exported here, where DeepSpeed has them).
"""
from __future__ import annotations

import os
import sys
from contextlib import contextmanager
from typing import Any, Callable, Dict, Iterator, Optional, Sequence, Set

import torch
import torch.nn as nn
from torch.utils.flop_counter import FlopCounterMode

from .counting import ModuleProfile, flop_counter, module_profiles
from .latency import ModuleLatency
from .report import RunInfo, format_report
from .strings import (
    DEFAULT_PRECISION,
    duration_to_string,
    flops_to_string,
    macs_to_string,
    number_to_string,
    params_to_string,
)

__all__ = [
    "FlopsProfiler", "ModuleProfile", "RunInfo", "get_model_profile", "DEFAULT_PRECISION", "number_to_string",
    "macs_to_string", "flops_to_string", "params_to_string", "duration_to_string",
]


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
        self._latency = ModuleLatency()
        self._ignored: Set[type] = set()
        self._profile: Dict[int, ModuleProfile] = {}
        self._bwd_flops = 0
        self.flops = self.macs = self.params = 0

    # ---- start / stop --------------------------------------------------------------------------------
    def start_profile(self, ignore_list: Optional[Sequence[type]] = None) -> None:
        """Reset the counts and start counting (FLOPs at the dispatcher, latency per module)."""
        if self.started:
            self.stop_profile()
        self.reset_profile()
        self._ignored = set(ignore_list or ())
        self._latency.attach(self.model, self._ignored)
        self._counter = flop_counter()
        self._counter.__enter__()
        torch.zeros(1).add_(1)  # the mode's first op imports torch._dynamo (seconds): not in any module's latency
        self.started = True

    def stop_profile(self) -> None:
        """Stop counting; the counts stay readable until :meth:`end_profile` or the next start."""
        if self._counter is not None and self._counter.mode is not None:
            self._counter.__exit__(None, None, None)
            self._aggregate()
        self._latency.detach()

    def reset_profile(self) -> None:
        self._counter = None
        self._latency.clear()
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
        counter = flop_counter()
        with counter:
            yield
        self._bwd_flops += counter.get_total_flops()

    def _aggregate(self) -> None:
        """Per-module inclusive profiles from the counter's per-name counts."""
        assert self._counter is not None
        self._profile.update(module_profiles(self.model, self._counter.get_flop_counts(), self._ignored,
                                             self.param_numel, self._latency.duration))
        top = self._profile[id(self.model)]
        self.flops, self.macs, self.params = top.flops, top.macs, top.params

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
        """The text :meth:`print_model_profile` prints (:func:`.report.format_report`)."""
        self._top()
        return format_report(self.model, self._profile, self.recompute_fwd_factor, profile_step, module_depth,
                             top_modules, detailed, run)


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
