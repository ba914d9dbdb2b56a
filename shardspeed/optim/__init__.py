"""Optimizers and LR schedules built from the DeepSpeed config blocks."""

from shardspeed.optim.builder import (
    DEEPSPEED_OPTIMIZER_NAMES,
    build_optimizer,
    rebuild_optimizer,
    retarget_optimizer,
    torch_optimizer_classes,
)
from shardspeed.optim.lamb import Lamb
from shardspeed.optim.lion import Lion
from shardspeed.optim.schedules import (
    DEEPSPEED_SCHEDULER_NAMES,
    LRRangeTest,
    OneCycle,
    WarmupCosineLR,
    WarmupDecayLR,
    WarmupLR,
    build_scheduler,
)

__all__ = [
    "build_optimizer",
    "rebuild_optimizer",
    "retarget_optimizer",
    "torch_optimizer_classes",
    "DEEPSPEED_OPTIMIZER_NAMES",
    "Lamb",
    "Lion",
    "build_scheduler",
    "DEEPSPEED_SCHEDULER_NAMES",
    "WarmupLR",
    "WarmupDecayLR",
    "WarmupCosineLR",
    "OneCycle",
    "LRRangeTest",
]
