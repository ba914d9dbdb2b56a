"""Split parallel tensor lists into (device, dtype) buckets so ``torch._foreach_*`` ops apply."""

from __future__ import annotations

from typing import Dict, List, Sequence, Tuple

import torch


def group_by_device_dtype(params: Sequence[torch.Tensor], *others: Sequence[torch.Tensor]):
    """Yield ``(params_bucket, *other_buckets)`` lists, one tuple per (device, dtype) of ``params``."""
    buckets: Dict[Tuple[torch.device, torch.dtype], List[List[torch.Tensor]]] = {}
    for i, p in enumerate(params):
        lists = buckets.setdefault((p.device, p.dtype), [[] for _ in range(1 + len(others))])
        lists[0].append(p)
        for j, seq in enumerate(others):
            lists[j + 1].append(seq[i])
    for lists in buckets.values():
        yield tuple(lists)
