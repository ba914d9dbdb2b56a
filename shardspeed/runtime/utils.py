"""``deepspeed.runtime.utils``: :func:`set_random_seed` (DeepSpeed's: Python's, NumPy's and torch's RNGs)."""
from __future__ import annotations

import random

import torch

from ..compat.alias import module_getattr


def set_random_seed(seed: int) -> None:
    """Seed ``random``, ``numpy.random`` (modulo 2**32, the range it takes) and torch (modulo 2**63; this seeds
    every device), as ``deepspeed.runtime.utils.set_random_seed`` does: the same streams for the same seed."""
    import numpy

    random.seed(seed)
    numpy.random.seed(seed % (2 ** 32))
    torch.manual_seed(seed % (2 ** 63))


__getattr__ = module_getattr(__name__)
