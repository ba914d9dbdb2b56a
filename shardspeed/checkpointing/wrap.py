"""Checkpoint every transformer block of a model (``engine.enable_activation_checkpointing``).

- Hugging Face models (``supports_gradient_checkpointing``): their own switch,
  ``activation_checkpointing_enable`` (``gradient_checkpointing_enable`` before transformers 5), with
  shardspeed's checkpoint function as the layers' checkpoint function. A model on which the user already
  enabled it keeps its layer choice (``every_n_layers``); only the function is ours.
- Other models: the modules of ``block_types`` (default: the model class's ``checkpoint_block_types``, as
  ``shardspeed.models.GPT`` has, else the repeated same-type children of the model's largest
  ``nn.ModuleList``). Each block's ``forward`` is
  replaced on the instance by a checkpointed call of the original, so parameter names, state dicts and
  module hooks (ZeRO-3's gathers) are unchanged and stay outside the recompute.
"""
from __future__ import annotations

import functools
import logging
from typing import Any, Callable, List, Optional, Sequence, Tuple, Type

import torch
import torch.nn as nn

from ..errors import ConfigError
from .core import checkpoint_function

logger = logging.getLogger("shardspeed.checkpointing")

_ORIGINAL = "_shardspeed_unchecked_forward"


def _is_hf(model: nn.Module) -> bool:
    return bool(getattr(model, "supports_gradient_checkpointing", False)) and (
        hasattr(model, "activation_checkpointing_enable") or hasattr(model, "gradient_checkpointing_enable"))


def _hf_method(model: nn.Module, verb: str) -> Callable[[], Any]:
    """``activation_checkpointing_<verb>`` (transformers 5), else ``gradient_checkpointing_<verb>``."""
    for name in (f"activation_checkpointing_{verb}", f"gradient_checkpointing_{verb}"):
        method = getattr(model, name, None)
        if callable(method):
            return method
    raise ConfigError(f"{type(model).__name__} has no gradient_checkpointing_{verb}()")


def _hf_enable(model: nn.Module, fn: Callable[..., Any]) -> List[nn.Module]:
    if not getattr(model, "is_gradient_checkpointing", False):
        _hf_method(model, "enable")()  # the model's own switch: layer flags, use_cache off, inputs requiring grad
    layers = [m for m in model.modules() if getattr(m, "gradient_checkpointing", False) is True]
    for m in layers:
        m.__dict__["_gradient_checkpointing_func"] = fn  # the function transformers' layers call
    return [m for m in layers if not hasattr(m, "supports_gradient_checkpointing")]  # the layers, not the models


def find_blocks(model: nn.Module, block_types: Optional[Sequence[Type[nn.Module]]] = None) -> List[nn.Module]:
    """The transformer blocks of ``model`` (outermost matches only)."""
    if block_types is None:  # a model naming its blocks (shardspeed.models.GPT does)
        block_types = getattr(type(model), "checkpoint_block_types", None)
    if block_types is not None:
        types = tuple(block_types)
        found: List[nn.Module] = []

        def visit(m: nn.Module) -> None:
            for child in m.children():
                if isinstance(child, types):
                    found.append(child)
                else:
                    visit(child)

        visit(model)
        return found
    return _repeated_blocks(model)


def _repeated_blocks(model: nn.Module) -> List[nn.Module]:
    best: Tuple[int, List[nn.Module]] = (0, [])
    for m in model.modules():
        if not isinstance(m, nn.ModuleList) or len(m) < 2:
            continue
        kinds = {type(c) for c in m}
        size = sum(getattr(p, "ds_numel", p.numel()) for p in m.parameters())  # ZeRO-3: placeholders
        if len(kinds) == 1 and size > best[0]:
            best = (size, list(m))
    return best[1]


class _CheckpointedForward:
    """A block's ``forward`` replaced on the instance: the original, checkpointed while training with grad.
    A plain object (not a closure), so ``copy.deepcopy`` of the model re-binds it to the copy's block."""

    def __init__(self, block: nn.Module, original: Callable[..., Any], fn: Callable[..., Any]):
        self.block, self.original, self.fn = block, original, fn
        functools.update_wrapper(self, original)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self.block.training and torch.is_grad_enabled():
            return self.fn(self.original, *args, **kwargs)
        return self.original(*args, **kwargs)


def inner_forward(block: nn.Module) -> Callable[..., Any]:
    """The forward a checkpoint of ``block`` wraps (``block.forward`` when it is not checkpointed here)."""
    return block.__dict__.get(_ORIGINAL) or block.forward


def set_inner_forward(block: nn.Module, fn: Callable[..., Any]) -> None:
    """Make ``fn`` the forward of ``block``, inside its checkpoint when it is checkpointed here (torch.compile
    of a block keeps the checkpoint outside the compiled code)."""
    if _ORIGINAL in block.__dict__:
        block.__dict__[_ORIGINAL] = fn
        wrapper = block.__dict__["forward"]
        if isinstance(wrapper, _CheckpointedForward):
            wrapper.original = fn
    else:
        block.forward = fn


def _wrap(block: nn.Module, fn: Callable[..., Any]) -> None:
    original = block.__dict__.get(_ORIGINAL) or block.forward
    block.__dict__[_ORIGINAL] = original
    block.forward = _CheckpointedForward(block, original, fn)  # on the instance: module hooks stay outside


def checkpoint_blocks(model: nn.Module, policy: Optional[str] = None,
                      block_types: Optional[Sequence[Type[nn.Module]]] = None) -> List[nn.Module]:
    """Checkpoint each transformer block of ``model`` with shardspeed's checkpoint and ``policy`` ("full" or
    "selective"; None: the configured one). Returns the blocks. Calling it again re-wraps (new policy)."""
    fn = checkpoint_function(policy)
    if block_types is None and _is_hf(model):
        layers = _hf_enable(model, fn)
    else:
        layers = find_blocks(model, block_types)
        for block in layers:
            _wrap(block, fn)
    if not layers:
        raise ConfigError(
            f"activation checkpointing: no transformer blocks found in {type(model).__name__}; pass "
            f"block_types=(YourBlock,) to engine.enable_activation_checkpointing, or checkpoint inside the model "
            f"with shardspeed.checkpointing.checkpoint(block, x)")
    logger.info("activation checkpointing: %d blocks of %s (%s)", len(layers), type(model).__name__,
                policy or "configured policy")
    return layers


def uncheckpoint_blocks(model: nn.Module) -> int:
    """Undo `checkpoint_blocks`: original forwards back (Hugging Face: its ``gradient_checkpointing_disable``)."""
    n = 0
    for m in model.modules():
        if _ORIGINAL in m.__dict__:
            original = m.__dict__.pop(_ORIGINAL)
            if getattr(original, "__self__", None) is m:  # the class's forward, bound
                del m.__dict__["forward"]
            else:  # a forward replaced on the instance before (engine.compile's): kept
                m.__dict__["forward"] = original
            n += 1
    if _is_hf(model) and getattr(model, "is_gradient_checkpointing", False):
        _hf_method(model, "disable")()
        n += 1
    return n
