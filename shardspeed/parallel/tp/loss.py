"""Cross entropy over vocabulary-parallel logits, without gathering them (Megatron's
``vocab_parallel_cross_entropy``).

Each rank holds the logits of its vocabulary range ``[start, start + V/t)``. Forward: the max over the
vocabulary (all-reduce MAX), the target's logit (all-reduce SUM: only the owning rank contributes), the sum of
exponentials (all-reduce SUM): three all-reduces of one number per token instead of an all-gather of
``tokens × V``. Backward needs no communication: ``softmax - onehot(target)`` on the local columns.
"""
from __future__ import annotations

from typing import Any, Tuple

import torch
import torch.distributed as dist

from .comm import TPGroup


class _VocabParallelCE(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, logits: torch.Tensor, targets: torch.Tensor, group: TPGroup, vocab_start: int,
                ignore_index: int) -> torch.Tensor:
        ctx.dtype = logits.dtype
        logits = logits.float()
        rows = logits.shape[-1]
        peak = group.all_reduce(logits.max(dim=-1).values, op=dist.ReduceOp.MAX)
        shifted = logits - peak.unsqueeze(-1)
        ignored = targets == ignore_index
        mine = (targets >= vocab_start) & (targets < vocab_start + rows) & ~ignored
        local = (targets - vocab_start).masked_fill(~mine, 0)
        picked = shifted.gather(-1, local.unsqueeze(-1)).squeeze(-1).masked_fill(~mine, 0.0)
        picked = group.all_reduce(picked)
        exp = shifted.exp()
        total = group.all_reduce(exp.sum(dim=-1))
        loss = (total.log() - picked).masked_fill(ignored, 0.0)
        ctx.save_for_backward(exp.div_(total.unsqueeze(-1)), local, mine, ignored)
        return loss

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> Tuple[torch.Tensor, None, None, None, None]:
        softmax, local, mine, ignored = ctx.saved_tensors
        grad = softmax
        hit = torch.zeros_like(grad).scatter_(-1, local.unsqueeze(-1), mine.unsqueeze(-1).to(grad.dtype))
        grad = (grad - hit) * g.masked_fill(ignored, 0.0).unsqueeze(-1)
        return grad.to(ctx.dtype), None, None, None, None


def vocab_parallel_cross_entropy(logits: torch.Tensor, targets: torch.Tensor, group: TPGroup,
                                 ignore_index: int = -100) -> torch.Tensor:
    """Per-token loss ``(...)`` of vocabulary-parallel ``logits (..., V/t)`` (this rank's range starts at
    ``group.rank × V/t``); targets equal to ``ignore_index`` get loss 0 and no gradient. Computed in fp32."""
    return _VocabParallelCE.apply(logits, targets, group, group.rank * logits.shape[-1], ignore_index)


def mean_cross_entropy(logits: torch.Tensor, targets: torch.Tensor, group: TPGroup,
                       ignore_index: int = -100) -> torch.Tensor:
    """The mean over non-ignored tokens, as ``F.cross_entropy(..., reduction="mean")``."""
    per_token = vocab_parallel_cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), group,
                                             ignore_index)
    count = (targets != ignore_index).sum().clamp(min=1)
    return per_token.sum() / count
