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
"""
from __future__ import annotations

from typing import Any, List, Tuple

import torch.nn as nn
from torch.utils.hooks import RemovableHandle

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
        for name, module in modules:
            own = [module.register_forward_pre_hook(self._clear)]
            own.append(module.register_forward_hook(self._attention_done(name, own)))
            self.handles += own
        if not modules:
            self.handles.append(model.register_forward_hook(self._model_done(model)))

    def remove(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles = []

    @staticmethod
    def _clear(module: nn.Module, args: Any) -> None:
        module.__dict__.pop(SP_MARK, None)

    def _attention_done(self, name: str, own: List[RemovableHandle]):
        def hook(module: nn.Module, args: Any, output: Any) -> None:
            for h in own:  # checked once
                h.remove()
            if module.__dict__.pop(SP_MARK, False):
                return
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


def check_attention_on_first_forward(model: nn.Module, sequence_parallel_size: int) -> None:
    """Arm the check on ``model`` (nothing at ``sequence_parallel_size`` 1)."""
    if int(sequence_parallel_size) > 1:
        _FirstForwardCheck(model, int(sequence_parallel_size))
