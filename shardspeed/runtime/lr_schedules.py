"""``deepspeed.runtime.lr_schedules``: DeepSpeed's five LR schedules (shardspeed's own, in
:mod:`shardspeed.optim.schedules`) and ``VALID_LR_SCHEDULES``, the names accelerate checks a scheduler's class
name against before handing it to ``deepspeed.initialize``."""
from __future__ import annotations

from ..compat.alias import module_getattr
from ..optim.schedules import LRRangeTest, OneCycle, WarmupCosineLR, WarmupDecayLR, WarmupLR

VALID_LR_SCHEDULES = ["LRRangeTest", "OneCycle", "WarmupLR", "WarmupDecayLR", "WarmupCosineLR"]

__all__ = ["VALID_LR_SCHEDULES", "LRRangeTest", "OneCycle", "WarmupCosineLR", "WarmupDecayLR", "WarmupLR"]

__getattr__ = module_getattr(__name__)
