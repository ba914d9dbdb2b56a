"""One job: the engine's record of ``engine.compile()``: which modules' forward is compiled, with which backend,
and the one hook compiling adds (Hugging Face models train without a key/value cache).

The engine holds one :class:`CompiledBlocks` (``engine.compiled_blocks``), empty until ``compile()`` runs;
``engine.is_compiled`` is its :attr:`~CompiledBlocks.is_compiled`. What is compiled and how:
:mod:`shardspeed.runtime.compiling`.

Hugging Face models with ``config.use_cache`` true build a ``DynamicCache`` in every forward, training ones
too, and hand it to each layer: dynamo guards on its per-layer state, so each layer recompiles once (and runs
eagerly after torch's recompile limit). A training forward never reads that cache, and the Hugging Face
Trainer sets ``config.use_cache`` to its ``use_cache`` argument (default False) for the same reason; here the
config is left as it is (``generate()`` and evaluation keep their cache) and a forward pre-hook on the model
passes ``use_cache=False`` to each training forward with gradients that does not pass ``use_cache`` itself
(as transformers' own checkpointed layers turn the cache off when training). A forward passing
``use_cache=True`` explicitly keeps it, with one warning.
"""
from __future__ import annotations

import inspect
import logging
from typing import Any, Dict, List, Optional, Tuple

import torch
import torch.nn as nn
from torch.utils.hooks import RemovableHandle

from .compiling import compile_engine_model

logger = logging.getLogger("shardspeed.compile")


class TrainWithoutCache:
    """The model's forward pre-hook: ``use_cache=False`` for training forwards with gradients that do not pass
    ``use_cache`` (see the module docstring)."""

    def __init__(self, model_name: str):
        self.model_name = model_name
        self.warned = False

    def __call__(self, module: nn.Module, args: Tuple[Any, ...],
                 kwargs: Dict[str, Any]) -> Tuple[Tuple[Any, ...], Dict[str, Any]]:
        if not (module.training and torch.is_grad_enabled()):
            return args, kwargs
        if "use_cache" not in kwargs:
            return args, {**kwargs, "use_cache": False}
        if kwargs["use_cache"] and not self.warned:
            self.warned = True
            logger.warning("%s: a compiled training forward with use_cache=True builds a cache that training never "
                           "reads and recompiles each layer once; pass use_cache=False", self.model_name)
        return args, kwargs


def caches_in_training(model: nn.Module) -> bool:
    """Whether ``model`` is a Hugging Face model whose forward builds a key/value cache by default
    (``config.use_cache`` true and a ``use_cache`` parameter in its forward)."""
    config = getattr(model, "config", None)
    if not getattr(config, "use_cache", False):
        return False
    try:
        return "use_cache" in inspect.signature(model.forward).parameters
    except (TypeError, ValueError):  # a forward without a signature: nothing to pass
        return False


class CompiledBlocks:
    """``engine.compile()``'s state: the modules whose forward is compiled (none before ``compile()``), the
    backend, and the hooks compiling added to the model (removed by :meth:`close`)."""

    def __init__(self) -> None:
        self._modules: List[nn.Module] = []
        self.backend: Any = None
        self._handles: List[RemovableHandle] = []

    @property
    def is_compiled(self) -> bool:
        """Whether ``compile()`` ran (DeepSpeed's ``engine.is_compiled``)."""
        return bool(self._modules)

    @property
    def modules(self) -> Tuple[nn.Module, ...]:
        """The modules whose forward is compiled, in model order."""
        return tuple(self._modules)

    @property
    def trains_without_cache(self) -> bool:
        """Whether training forwards are given ``use_cache=False`` (a Hugging Face model caching by default)."""
        return bool(self._handles)

    def compile(self, model: nn.Module, device: torch.device, backend: Any,
                compile_kwargs: Optional[Dict[str, Any]], schedule: Any, compiled_autograd_enabled: bool) -> None:
        """Compile ``model``'s blocks (:func:`~shardspeed.runtime.compiling.compile_engine_model`); a second
        call does nothing."""
        if self.is_compiled:
            return
        self._modules = compile_engine_model(model, device, backend, compile_kwargs, schedule,
                                             compiled_autograd_enabled)
        self.backend = backend
        if caches_in_training(model):
            name = type(model).__name__
            self._handles.append(model.register_forward_pre_hook(TrainWithoutCache(name), with_kwargs=True))
            logger.info("engine.compile(): %s trains with use_cache=False (its config.use_cache is true; evaluation "
                        "and generate() keep the cache)", name)

    def close(self) -> None:
        """Remove the hooks compiling added (the forwards stay compiled)."""
        for h in self._handles:
            h.remove()
        self._handles = []
