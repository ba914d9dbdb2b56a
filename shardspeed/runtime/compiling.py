"""One job: ``engine.compile()``: ``torch.compile`` of a model's blocks, every engine hook left outside.

What is compiled (:func:`compile_targets`): each transformer block of the model (the blocks activation
checkpointing finds: :func:`shardspeed.checkpointing.wrap.find_blocks`), else the whole model. A target with a
hooked module strictly inside it (ZeRO-3's units smaller than a block, a user's module hooks) is not compiled
whole: its hook-free subtrees are. MoE layers (data-dependent dispatch and all-to-alls) are never compiled;
their neighbours are. So every forward hook (ZeRO-3's gather, release and gradient registration) runs eagerly at
the boundary of a compiled region, and dynamo never traces one.

How (torchtitan's per-block compile, FSDP2's hooks outside): the module's *forward* is replaced on the
instance by a :class:`CompiledForward`, never its ``__call__``, so ``module(x)`` runs its hooks eagerly and then
the compiled forward. Parameter names, state dicts and checkpoints are unchanged. Under activation
checkpointing the compiled forward is the one the checkpoint wraps (the recompute reruns compiled code).
Blocks of one class share one compiled graph (dynamo lifts parameters as inputs), so a model of N equal
blocks compiles once per mode (train, eval).
"""
from __future__ import annotations

import functools
import logging
import os
import shutil
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
import torch.nn as nn

from ..checkpointing.wrap import find_blocks, inner_forward, set_inner_forward
from ..compat.alias import not_provided
from ..errors import ShardspeedError
from ..moe.autoep import ExpertParallelExperts
from ..moe.layer import MoE, MOELayer

logger = logging.getLogger("shardspeed.compile")
_ENGINE = "deepspeed.runtime.engine.DeepSpeedEngine"

#: modules that stay eager by design: data-dependent token dispatch, all-to-alls
EAGER_TYPES: Tuple[type, ...] = (MoE, MOELayer, ExpertParallelExperts)


class CompiledForward:
    """A module's ``forward`` replaced on the instance: ``compiled`` (``torch.compile`` of ``inner``). A plain
    object, so the module's ``__call__`` and hooks stay eager and ``inner`` stays reachable."""

    def __init__(self, module: nn.Module, inner: Callable[..., Any], compiled: Callable[..., Any]):
        self.module, self.inner, self.compiled = module, inner, compiled
        functools.update_wrapper(self, inner)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.compiled(*args, **kwargs)


def _hooked(m: nn.Module) -> bool:
    return bool(m._forward_hooks or m._forward_pre_hooks or m._backward_hooks or m._backward_pre_hooks)


def _checkpoints_itself(m: nn.Module) -> bool:
    """A Hugging Face layer with gradient checkpointing on: its own forward calls the checkpoint, which dynamo
    cannot trace with shardspeed's function; its children are compiled instead (inside the checkpoint)."""
    return getattr(m, "gradient_checkpointing", False) is True


def _hook_free(m: nn.Module) -> List[nn.Module]:
    """``m`` when nothing below it is hooked or eager by design; else its children's hook-free subtrees."""
    if isinstance(m, EAGER_TYPES):
        return []
    if not _checkpoints_itself(m) and not any(_hooked(d) or isinstance(d, EAGER_TYPES)
                                              for d in m.modules() if d is not m):
        return [m]
    return [t for c in m.children() for t in _hook_free(c)]


def compile_targets(model: nn.Module) -> List[nn.Module]:
    """The modules whose forward :func:`compile_model` compiles (see the module docstring), in model order."""
    seen: Dict[int, nn.Module] = {}
    for block in find_blocks(model) or [model]:
        for m in _hook_free(block):
            seen.setdefault(id(m), m)
    return list(seen.values())


def check_backend(backend: Any, device: torch.device) -> None:
    """One line, before dynamo runs, when ``backend`` cannot run here: inductor needs a C++ compiler on a CPU
    host (``g++``, or ``$CXX``) and triton on a GPU."""
    if backend != "inductor":
        return
    if device.type == "cpu":
        from torch._inductor import config as inductor_config

        wanted = [os.environ["CXX"]] if os.environ.get("CXX") else [c for c in inductor_config.cpp.cxx if c]
        if not any(shutil.which(c) for c in wanted):
            raise ShardspeedError(
                f"engine.compile(backend='inductor'): inductor on a CPU host needs a C++ compiler and none was "
                f"found ({', '.join(wanted) or 'g++'} not on PATH); install one (apt-get install g++, or conda "
                f"install gxx) or set CXX to its path, or compile with backend='aot_eager'")
    elif device.type == "cuda":
        from torch.utils._triton import has_triton

        if not has_triton():
            raise ShardspeedError("engine.compile(backend='inductor'): inductor on a GPU needs triton, which is not "
                                  "installed; pip install triton, or compile with backend='aot_eager'")


def compile_model(model: nn.Module, backend: Any, compile_kwargs: Dict[str, Any]) -> List[nn.Module]:
    """Compile the forward of each of :func:`compile_targets`; returns them. Blocks of one class share one
    ``torch.compile`` of the class's forward."""
    targets = compile_targets(model)
    shared: Dict[Any, Callable[..., Any]] = {}
    for m in targets:
        inner = inner_forward(m)
        plain = getattr(inner, "__func__", None) is type(m).forward and getattr(inner, "__self__", None) is m
        if plain:
            fn = shared.get(type(m))
            if fn is None:
                fn = shared[type(m)] = torch.compile(type(m).forward, backend=backend, **compile_kwargs)
            compiled: Callable[..., Any] = functools.partial(fn, m)
        else:  # a forward already replaced on the instance (not by a checkpoint): compiled as it is
            compiled = torch.compile(inner, backend=backend, **compile_kwargs)
        set_inner_forward(m, CompiledForward(m, inner, compiled))
    logger.info("compiled %d modules (%s) with backend %s", len(targets),
                ", ".join(sorted({type(m).__name__ for m in targets})), backend)
    return targets


def compiled_modules(model: nn.Module) -> List[nn.Module]:
    """The modules of ``model`` whose forward is compiled."""
    return [m for m in model.modules() if isinstance(inner_forward(m), CompiledForward)]


def compile_options(backend: Any, compile_kwargs: Optional[Dict[str, Any]]) -> Dict[str, Any]:
    """``compile_kwargs`` for ``torch.compile``, without ``backend`` (DeepSpeed's rule: the argument wins)."""
    kwargs = dict(compile_kwargs or {})
    if "backend" in kwargs:
        logger.warning("engine.compile: 'backend' in compile_kwargs is overridden by backend=%r", backend)
        del kwargs["backend"]
    return kwargs


def compile_engine_model(model: nn.Module, device: torch.device, backend: Any,
                         compile_kwargs: Optional[Dict[str, Any]], schedule: Any,
                         compiled_autograd_enabled: bool) -> List[nn.Module]:
    """``engine.compile()``: :func:`compile_model` after the one-line refusals (DeepCompile's ``schedule``,
    compiled autograd) and :func:`check_backend`. ``compile_kwargs`` go to ``torch.compile`` (``mode``,
    ``dynamic``, ``fullgraph``, ``options``)."""
    if schedule is not None:
        raise not_provided(f"{_ENGINE}.compile(schedule=...): DeepCompile's pass schedule (shardspeed compiles "
                           "blocks with torch.compile; leave schedule=None)")
    if compiled_autograd_enabled:
        raise not_provided(f"{_ENGINE}.compile(compiled_autograd_enabled=True): compiled autograd (the "
                           "engine's gradient hooks run eagerly; leave it False)")
    check_backend(backend, device)
    return compile_model(model, backend, compile_options(backend, compile_kwargs))
