"""ZeRO-Offload / ZeRO-Infinity: optimizer state (and fp32 masters) in host memory or on disk.

- :mod:`.cpu_adam`: the host Adam/AdamW step (torch's fused kernel on flat tiles) and :class:`CPUAdam`.
- :mod:`.tiles`: pure arithmetic of tiles (ranges of a unit's chunk with one param group).
- :mod:`.store`: host-memory and NVMe state stores (bounded buffer pool, reader/writer threads).
- :mod:`.swap_io`: NVMe swap-file I/O and the checksums verifying every read.
- :mod:`.swap_dirs`: the checked ``nvme_path`` and the per-job swap folders (naming, dead-folder cleanup).
- :mod:`.transfer`: device↔host copies (CUDA copy stream + pinned buffers, or plain copies on CPU).
- :mod:`.master`: :class:`OffloadedMasterWeights`, the offloaded optimizer step.
"""
from __future__ import annotations

from .cpu_adam import AdamHyper, CPUAdam, adam_step, is_adam_family
from .master import OffloadedMasterWeights, OffloadPlan
from .store import MemoryStateStore, NvmeStateStore, check_nvme_path

__all__ = ["AdamHyper", "CPUAdam", "adam_step", "is_adam_family", "OffloadedMasterWeights", "OffloadPlan",
           "MemoryStateStore", "NvmeStateStore", "check_nvme_path"]
