"""ZeRO-Offload / ZeRO-Infinity: optimizer state (and fp32 masters) in host memory or on disk.

- :mod:`.cpu_adam`: the host Adam/AdamW step (torch's fused kernel on flat tiles) and :class:`CPUAdam`.
- :mod:`.tiles`: pure arithmetic of tiles (ranges of a unit's chunk with one param group).
- :mod:`.store`: host-memory and NVMe state stores (bounded buffer pool, reader/writer threads).
- :mod:`.transfer`: device↔host copies (CUDA copy stream + pinned buffers, or plain copies on CPU).
- :mod:`.master`: :class:`OffloadedMasterWeights`, the offloaded optimizer step.
"""
from __future__ import annotations

from typing import Optional

from .cpu_adam import AdamHyper, CPUAdam, adam_step, is_adam_family
from .master import OffloadedMasterWeights, OffloadPlan
from .store import MemoryStateStore, NvmeStateStore, check_nvme_path

__all__ = ["AdamHyper", "CPUAdam", "adam_step", "is_adam_family", "OffloadedMasterWeights", "OffloadPlan",
           "MemoryStateStore", "NvmeStateStore", "check_nvme_path", "plan_from_config"]


def plan_from_config(offload, sub_group_size: int) -> Optional[OffloadPlan]:
    """The :class:`OffloadPlan` for an ``offload_optimizer`` block (None when it is absent or "none").
    Tiles are ``sub_group_size`` elements at most (DeepSpeed's unit of the offloaded step)."""
    if offload is None or offload.device == "none":
        return None
    return OffloadPlan(device=offload.device, nvme_path=offload.nvme_path, buffer_count=int(offload.buffer_count),
                       pin_memory=bool(offload.pin_memory), ratio=float(offload.ratio),
                       tile_elems=int(sub_group_size))
