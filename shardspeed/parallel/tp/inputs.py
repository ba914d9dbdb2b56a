"""The check that every rank of a tensor-parallel group got the same inputs.

A tensor-parallel group computes one model replica: its ranks must see the same batch. Loaders built by
``initialize(training_data=...)`` shard by data-parallel rank, so they do; a user's own loader sharded by
global rank does not, and training then goes silently wrong. For the first :attr:`checks` forward calls
the engine all-gathers a small checksum of the inputs over the model group (16 bytes per rank) and raises
a `DistributedError` naming the ranks that disagree.
"""
from __future__ import annotations

from typing import Any, List

import torch
import torch.distributed as dist

from ...errors import DistributedError
from .comm import TPGroup


def _tensors(obj: Any, out: List[torch.Tensor]) -> None:
    if torch.is_tensor(obj):
        out.append(obj)
    elif isinstance(obj, dict):
        for k in sorted(obj, key=str):
            _tensors(obj[k], out)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            _tensors(v, out)


def input_checksum(obj: Any) -> torch.Tensor:
    """``[count, Σx, Σ i·x]`` over every tensor in ``obj`` (float64; position-weighted, so a permuted batch
    differs)."""
    tensors: List[torch.Tensor] = []
    _tensors(obj, tensors)
    out = torch.zeros(3, dtype=torch.float64)
    for t in tensors:
        flat = t.detach().reshape(-1).to(device="cpu", dtype=torch.float64)
        pos = torch.arange(1, flat.numel() + 1, dtype=torch.float64)
        out += torch.stack([torch.tensor(float(flat.numel()), dtype=torch.float64), flat.sum(), (flat * pos).sum()])
    return out


class InputConsistencyCheck:
    """Called with each forward's inputs; checks the first ``checks`` of them over the model group."""

    def __init__(self, group: TPGroup, global_ranks: List[int], checks: int = 2):
        self.group = group
        self.global_ranks = global_ranks
        self.checks = checks
        self.done = 0

    def __call__(self, inputs: Any) -> None:
        if self.done >= self.checks or self.group.size == 1:
            return
        self.done += 1
        mine = input_checksum(inputs).to(self.group.comm.topology.device)
        every = self.group.all_gather(mine.unsqueeze(0), 0).cpu()
        differ = [self.global_ranks[i] for i in range(len(every)) if not torch.equal(every[i], every[0])]
        if differ:
            raise DistributedError(
                f"tensor parallel: ranks {differ} got different inputs than rank {self.global_ranks[0]} of their "
                f"tensor-parallel group {self.global_ranks} at forward call {self.done}; every rank of a group "
                f"must get the same batch: shard your data by data-parallel rank (engine.mpu."
                f"get_data_parallel_rank()), or pass training_data= to initialize")


def model_group_ranks(group: Any) -> List[int]:
    return list(dist.get_process_group_ranks(group)) if group is not None else list(range(dist.get_world_size()))
