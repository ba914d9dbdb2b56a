"""The loss of a sequence split over the sequence group: equal to the unsharded loss whatever the padding.

Each rank holds some of a sample's tokens, and some ranks may hold only padding (-100 labels). The mean over
all non-ignored tokens of the group is ``Σ_r sum_r / Σ_r n_r``; a mean of per-rank means is not (it weighs a
rank of three real tokens like one of a thousand, and is 0/0 on a rank of padding). Every rank gets the same
value, so losses never differ across SP ranks; the backward gives each rank's tokens their share (see
:func:`~.comm.sum_over_ranks` for the factor P that the gradient reduction's division takes back).
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F

from .comm import sum_over_ranks
from .shard import IGNORE_INDEX


def token_count(shift_labels: torch.Tensor, group, ignore_index: int = IGNORE_INDEX) -> torch.Tensor:
    """Non-ignored tokens over the whole group (no gradient); at least 1."""
    n = (shift_labels != ignore_index).sum().to(torch.float32)
    if dist.get_world_size(group) > 1:
        dist.all_reduce(n, group=group)
    return n.clamp(min=1.0)


def combine_shard_losses(loss_sum: torch.Tensor, shift_labels: torch.Tensor, group,
                         ignore_index: int = IGNORE_INDEX) -> torch.Tensor:
    """The group's mean loss from this rank's *sum* of token losses (``reduction="sum"``)."""
    return sum_over_ranks(loss_sum.float(), group) / token_count(shift_labels, group, ignore_index)


def combine_shard_means(loss_mean: torch.Tensor, shift_labels: torch.Tensor, group,
                        ignore_index: int = IGNORE_INDEX) -> torch.Tensor:
    """The group's mean loss from this rank's *mean* over its own non-ignored tokens (what
    ``model.loss_function(..., shift_labels=...)`` returns), weighted by its token count; a rank with no
    token (its mean 0/0) contributes nothing."""
    n = (shift_labels != ignore_index).sum()
    local = torch.where(n > 0, loss_mean.float() * n, torch.zeros_like(loss_mean, dtype=torch.float32))
    return combine_shard_losses(local, shift_labels, group, ignore_index)


def sequence_parallel_loss(logits: torch.Tensor, shift_labels: torch.Tensor, group,
                           ignore_index: int = IGNORE_INDEX, vocab_size: Optional[int] = None) -> torch.Tensor:
    """Cross entropy of this rank's ``logits`` ``[b, s, V]`` against ``shift_labels`` ``[b, s]`` (already
    shifted, as :func:`~.shard.shard_batch` makes them), combined over the group by token count."""
    vocab = vocab_size if vocab_size is not None else logits.shape[-1]
    loss_sum = F.cross_entropy(logits.float().reshape(-1, vocab), shift_labels.reshape(-1).to(logits.device),
                               ignore_index=ignore_index, reduction="sum")
    return combine_shard_losses(loss_sum, shift_labels, group, ignore_index)
