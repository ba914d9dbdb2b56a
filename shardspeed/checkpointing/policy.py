"""Our extension: selective activation checkpointing (keep matmul and attention outputs, recompute the rest).

Full recompute keeps a block's input (2·s·b·h bytes in 16 bits) and reruns the whole block in backward.
The selective policy also keeps the outputs of matrix multiplies and fused attention, the expensive ops,
and recomputes only the cheap elementwise ones (norms, GELU, dropout, residual adds): less recompute,
more memory. Built on ``torch.utils.checkpoint.create_selective_checkpoint_contexts``.

An op that draws random numbers (fused attention with dropout) is always recomputed: the recompute replays
the RNG from the forward's state, and skipping a random op there would shift every later dropout mask.
"""
from __future__ import annotations

from types import MappingProxyType
from typing import Any, Callable, ContextManager, Mapping, Tuple

import torch
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

_aten = torch.ops.aten


def _ops(*names: str) -> frozenset:
    found = []
    for name in names:
        packet = getattr(_aten, name, None)
        if packet is not None:
            found.append(packet.default)
    return frozenset(found)


#: The ops whose outputs the selective policy keeps.
SAVED_OPS = _ops("mm", "addmm", "bmm", "baddbmm", "_scaled_mm", "_scaled_dot_product_flash_attention",
                 "_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_efficient_attention",
                 "_scaled_dot_product_cudnn_attention")


def _draws_random(op: Any, args: tuple, kwargs: dict) -> bool:
    """Whether this call of ``op`` takes a positive ``dropout_p``."""
    for i, arg in enumerate(op._schema.arguments):
        if arg.name == "dropout_p":
            value = kwargs.get("dropout_p", args[i] if i < len(args) else 0.0)
            return bool(value)
    return False


def selective_policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    """Keep the outputs of `SAVED_OPS` (unless random), recompute everything else."""
    if op in SAVED_OPS and not _draws_random(op, args, kwargs):
        return CheckpointPolicy.MUST_SAVE
    return CheckpointPolicy.PREFER_RECOMPUTE


def selective_contexts() -> Tuple[ContextManager, ContextManager]:
    """``context_fn`` for ``torch.utils.checkpoint.checkpoint``: (forward context, recompute context)."""
    return create_selective_checkpoint_contexts(selective_policy)


CONTEXTS: Mapping[str, Callable[[], Tuple[ContextManager, ContextManager]]] = MappingProxyType(
    {"selective": selective_contexts})


def policy_contexts(policy: str) -> Callable[[], Tuple[ContextManager, ContextManager]] | None:
    """The context factory of a policy name; None for "full" (torch's plain checkpoint)."""
    return CONTEXTS.get(policy)
