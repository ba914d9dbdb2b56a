"""The first forward at ``sequence_parallel_size`` > 1 must run the model's attention through a
sequence-parallel function; plain attention over a rank's shard of the sequence trains a wrong model
without any error (each token would see only the tokens of its own shard).

``initialize`` arms :func:`check_attention_on_first_forward` on the model. The attention modules are the
innermost modules whose class name contains "Attention" (transformers' ``LlamaAttention``, a script's
``SelfAttention``); the sequence-parallel functions (``UlyssesSPAttentionHF``, ``ulysses_attention``,
``ring_attention``) mark the module they are called for. At each attention module's first call the check
reads the mark and raises ``ConfigError`` naming the module when it is missing; a model without such
modules is checked at the root's first forward for any mark at all. The hooks are removed after the first
call.

An attention module inside a transformer block (:func:`shardspeed.checkpointing.wrap.find_blocks`: a decoder
layer) is checked by hooks on its block, at the block's first call, not on the module itself: hooks sit on
the block's boundary, so ``engine.compile()`` (called between ``initialize`` and the first forward) compiles
the block whole instead of splitting it around a hooked attention module.
"""
from __future__ import annotations

from typing import Any, Dict, List, Tuple

import torch.nn as nn
from torch.utils.hooks import RemovableHandle

from ...checkpointing.wrap import find_blocks
from ...errors import ConfigError
from ...parallel.sp import SP_MARK

ADVICE = ("register the attention before the model's first forward: UlyssesSPAttentionHF.register_with_transformers("
          "model_or_name, core_attn_implementation=<the model's attn_implementation, e.g. 'sdpa'>, "
          "sequence_parallel_size=P, micro_batch_size=...), or call shardspeed.parallel.sp.ulysses_attention / "
          "ring_attention in the model's attention")


def attention_modules(model: nn.Module) -> List[Tuple[str, nn.Module]]:
    """The innermost modules of ``model`` whose class name contains "attention", with their names."""
    named = [(n, m) for n, m in model.named_modules() if "attention" in type(m).__name__.lower()]
    ids = {id(m) for _, m in named}
    return [(n, m) for n, m in named if not any(id(c) in ids for c in m.modules() if c is not m)]


class _FirstForwardCheck:
    """The hooks of one model's check, removed at the first call (each module's) or at the first error."""

    def __init__(self, model: nn.Module, sp: int):
        self.sp, self.model_name = sp, type(model).__name__
        self.handles: List[RemovableHandle] = []
        modules = attention_modules(model)
        for host, checked in _by_host(model, modules).items():
            own = [host.register_forward_pre_hook(self._clear(checked))]
            own.append(host.register_forward_hook(self._attention_done(checked, own)))
            self.handles += own
        if not modules:
            self.handles.append(model.register_forward_hook(self._model_done(model)))

    def remove(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles = []

    @staticmethod
    def _clear(checked: List[Tuple[str, nn.Module]]):
        def hook(host: nn.Module, args: Any) -> None:
            for _, module in checked:
                module.__dict__.pop(SP_MARK, None)
        return hook

    def _attention_done(self, checked: List[Tuple[str, nn.Module]], own: List[RemovableHandle]):
        def hook(host: nn.Module, args: Any, output: Any) -> None:
            for h in own:  # checked once
                h.remove()
            missing = [(n, m) for n, m in checked if not m.__dict__.pop(SP_MARK, False)]
            if not missing:
                return
            name, module = missing[0]
            self.remove()
            impl = getattr(getattr(module, "config", None), "_attn_implementation", None)
            used = f", attn_implementation {impl!r}" if impl is not None else ""
            raise ConfigError(f"sequence_parallel_size {self.sp}: attention module {name!r} "
                              f"({type(module).__name__}{used}) ran plain attention over this rank's shard of the "
                              f"sequence, not the sequence-parallel attention; {ADVICE}")
        return hook

    def _model_done(self, model: nn.Module):
        def hook(root: nn.Module, args: Any, output: Any) -> None:
            self.remove()
            if not any(SP_MARK in m.__dict__ for m in model.modules()):
                raise ConfigError(f"sequence_parallel_size {self.sp}: the first forward of {self.model_name} ran no "
                                  f"attention through the sequence-parallel attention; {ADVICE}")
        return hook


def _by_host(model: nn.Module, modules: List[Tuple[str, nn.Module]]) -> Dict[nn.Module, List[Tuple[str, nn.Module]]]:
    """The attention modules grouped by the module whose hooks check them: their transformer block, else
    themselves."""
    blocks = find_blocks(model)
    inside = {id(d): b for b in blocks for d in b.modules()}
    out: Dict[nn.Module, List[Tuple[str, nn.Module]]] = {}
    for name, module in modules:
        out.setdefault(inside.get(id(module), module), []).append((name, module))
    return out


def check_attention_on_first_forward(model: nn.Module, sequence_parallel_size: int) -> None:
    """Arm the check on ``model`` (nothing at ``sequence_parallel_size`` 1)."""
    if int(sequence_parallel_size) > 1:
        _FirstForwardCheck(model, int(sequence_parallel_size))
