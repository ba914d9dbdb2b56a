"""Which ranks work together: built once, passed explicitly (no global process groups)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist

from .init import local_device


@dataclass(frozen=True)
class Topology:
    """The data-parallel group this rank belongs to and the device it computes on."""

    dp_group: Optional[dist.ProcessGroup]
    dp_rank: int
    dp_size: int
    device: torch.device

    @classmethod
    def data_parallel(cls, group: Optional[dist.ProcessGroup] = None) -> "Topology":
        """All ranks of ``group`` (default: the world) form one data-parallel group."""
        return cls(
            dp_group=group,
            dp_rank=dist.get_rank(group),
            dp_size=dist.get_world_size(group),
            device=local_device(),
        )
