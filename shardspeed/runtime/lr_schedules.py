"""``deepspeed.runtime.lr_schedules``: DeepSpeed's schedule names and classes (shardspeed's own, in
``shardspeed.optim.schedules``). accelerate reads ``VALID_LR_SCHEDULES`` to tell a config-built schedule apart."""
from __future__ import annotations

from ..compat.alias import module_getattr
from ..optim.schedules import LRRangeTest, OneCycle, WarmupCosineLR, WarmupDecayLR, WarmupLR

VALID_LR_SCHEDULES = ["LRRangeTest", "OneCycle", "WarmupLR", "WarmupDecayLR", "WarmupCosineLR"]

__all__ = ["VALID_LR_SCHEDULES", "LRRangeTest", "OneCycle", "WarmupLR", "WarmupDecayLR", "WarmupCosineLR"]

__getattr__ = module_getattr(__name__)
