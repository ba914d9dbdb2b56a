"""The distributed DataLoader returned by ``initialize(training_data=...)``."""
from __future__ import annotations

from typing import Callable, Optional

import torch
from torch.utils.data import DataLoader, DistributedSampler

from ..dist.topology import Topology


def build_dataloader(dataset, micro_batch_size: int, topo: Topology, collate_fn: Optional[Callable] = None,
                     drop_last: bool = False, shuffle: bool = True, seed: int = 0) -> DataLoader:
    """Each data-parallel rank reads a disjoint 1/N of ``dataset`` in micro-batches."""
    if isinstance(dataset, torch.utils.data.IterableDataset):
        return DataLoader(dataset, batch_size=micro_batch_size, collate_fn=collate_fn, drop_last=drop_last)
    sampler = DistributedSampler(dataset, num_replicas=topo.dp_size, rank=topo.dp_rank, shuffle=shuffle,
                                 seed=seed, drop_last=drop_last)
    return DataLoader(dataset, batch_size=micro_batch_size, sampler=sampler, collate_fn=collate_fn,
                      drop_last=drop_last, pin_memory=topo.device.type == "cuda")
