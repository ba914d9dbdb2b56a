"""``deepspeed.runtime.utils``: :func:`set_random_seed` (DeepSpeed's: Python's, NumPy's and torch's RNGs) and
:func:`see_memory_usage`."""
from __future__ import annotations

import random
from typing import Any

import torch

from ..compat.alias import module_getattr


def set_random_seed(seed: int) -> None:
    """Seed ``random``, ``numpy.random`` (modulo 2**32, the range it takes) and torch (modulo 2**63; this seeds
    every device), as ``deepspeed.runtime.utils.set_random_seed`` does: the same streams for the same seed."""
    import numpy

    random.seed(seed)
    numpy.random.seed(seed % (2 ** 32))
    torch.manual_seed(seed % (2 ** 63))


def see_memory_usage(message: str, force: bool = False) -> None:
    """DeepSpeed's memory report: nothing unless ``force``; then, on rank 0 only, ``message``, the accelerator's
    allocated / peak / reserved memory in GB and the host's used virtual memory; the peak is reset after."""
    import gc

    import torch.distributed as dist

    from ..accelerator import get_accelerator
    from ..accelerator.cpu_accelerator import CPU_Accelerator

    if not force or (dist.is_available() and dist.is_initialized() and dist.get_rank() != 0):
        return
    gc.collect()
    acc: Any = get_accelerator()  # the memory methods are the concrete accelerators' (CPU: resident set size)
    gb = 1024 ** 3
    print(message)
    print(f"MA {acc.memory_allocated() / gb:.2f} GB  Max_MA {acc.max_memory_allocated() / gb:.2f} GB  "
          f"CA {acc.memory_reserved() / gb:.2f} GB  Max_CA {acc.max_memory_reserved() / gb:.2f} GB")
    host = CPU_Accelerator()
    total, used = host.total_memory(), host.total_memory() - host.available_memory()
    print(f"CPU Virtual Memory:  used = {used / gb:.2f} GB, percent = {100 * used / max(total, 1):.1f}%")
    acc.reset_peak_memory_stats()


__getattr__ = module_getattr(__name__)
