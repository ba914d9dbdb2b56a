"""``deepspeed.accelerator.cpu_accelerator.CPU_Accelerator``: DeepSpeed's CPU accelerator, on torch.

As DeepSpeed's: ``device_name()`` is ``"cpu"`` whatever the index, streams and events are None, memory
figures are the process's resident set size (and its peak since the last reset), ``range_push`` /
``range_pop`` do nothing, ``pin_memory`` returns the tensor. The backend is gloo (DeepSpeed's without oneCCL).
"""
from __future__ import annotations

import contextlib
import glob
import os
from typing import Optional

import torch

from .abstract_accelerator import DeepSpeedAccelerator, local_rank


def _rss() -> int:
    """This process's resident set size in bytes (Linux ``/proc``; psutil is not a dependency)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _meminfo(key: str) -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    return 0


def _numa_nodes_with_cores() -> int:
    """NUMA nodes that have CPUs (DeepSpeed counts one CPU "device" per node); 1 where unknown."""
    nodes = 0
    for path in glob.glob("/sys/devices/system/node/node[0-9]*/cpulist"):
        with open(path) as f:
            nodes += bool(f.read().strip())
    return max(nodes, 1)


class CPU_Accelerator(DeepSpeedAccelerator):  # noqa: N801 (DeepSpeed's name)
    _name = "cpu"
    _communication_backend_name = "gloo"

    def __init__(self) -> None:
        self.max_mem = 0

    # ---- device -----------------------------------------------------------------------------------
    def device_name(self, device_index: Optional[int] = None) -> str:
        return "cpu"

    def device(self, device_index: Optional[int] = None):
        return None

    def set_device(self, device_index) -> None:
        return None

    def current_device(self) -> int:
        return local_rank()

    def current_device_name(self) -> str:
        return "cpu"

    def device_count(self) -> int:
        size = int(os.environ.get("LOCAL_SIZE", "0"))
        return size if size > 0 else _numa_nodes_with_cores()

    def is_available(self) -> bool:
        return True

    def synchronize(self, device_index=None) -> None:
        return None

    # ---- RNG --------------------------------------------------------------------------------------
    def manual_seed(self, seed: int):
        return torch.manual_seed(seed)

    def manual_seed_all(self, seed: int):
        return torch.manual_seed(seed)

    def initial_seed(self) -> int:
        return torch.initial_seed()

    def default_generator(self, device_index):
        return torch.default_generator

    def get_rng_state(self, device_index=None) -> torch.Tensor:
        return torch.get_rng_state()

    def set_rng_state(self, new_state: torch.Tensor, device_index=None) -> None:
        torch.set_rng_state(new_state)

    # ---- streams and events: none on CPU -----------------------------------------------------------
    @property
    def Stream(self):
        return None

    def stream(self, stream):
        return contextlib.nullcontext()

    def current_stream(self, device_index=None):
        return None

    def default_stream(self, device_index=None):
        return None

    @property
    def Event(self):
        return None

    # ---- memory: the resident set size -------------------------------------------------------------
    def empty_cache(self) -> None:
        return None

    def get_rss(self) -> int:
        mem = _rss()
        self.max_mem = max(self.max_mem, mem)
        return mem

    def reset_rss(self) -> int:
        self.max_mem = _rss()
        return self.max_mem

    def memory_allocated(self, device_index=None) -> int:
        return self.get_rss()

    def max_memory_allocated(self, device_index=None) -> int:
        self.get_rss()
        return self.max_mem

    def reset_max_memory_allocated(self, device_index=None) -> None:
        self.reset_rss()

    memory_cached = memory_reserved = memory_allocated
    max_memory_cached = max_memory_reserved = max_memory_allocated
    reset_max_memory_cached = reset_peak_memory_stats = reset_max_memory_allocated

    def memory_stats(self, device_index=None) -> dict:
        mem = self.get_rss()
        return {"allocated_bytes.all.current": mem, "allocated_bytes.all.peak": self.max_mem}

    def total_memory(self, device_index=None) -> int:
        return _meminfo("MemTotal")

    def available_memory(self, device_index=None) -> int:
        return _meminfo("MemAvailable")

    # ---- dtypes and host memory --------------------------------------------------------------------
    def is_fp16_supported(self) -> bool:
        try:
            return bool(torch.ops.mkldnn._is_mkldnn_fp16_supported())
        except (AttributeError, RuntimeError):
            return False

    def pin_memory(self, tensor: torch.Tensor, make_copy: bool = True, match_shape: bool = True) -> torch.Tensor:
        return tensor  # torch cannot pin memory for a CPU "device": DeepSpeed returns the tensor too

    def is_pinned(self, tensor: torch.Tensor) -> bool:
        return tensor.is_pinned()
