"""Optimizers and LR schedules built from the DeepSpeed config blocks."""

from shardspeed.optim.builder import (
    DEEPSPEED_OPTIMIZER_NAMES,
    build_optimizer,
    rebuild_optimizer,
    torch_optimizer_classes,
)
from shardspeed.optim.lamb import Lamb
from shardspeed.optim.lion import Lion

__all__ = [
    "build_optimizer",
    "rebuild_optimizer",
    "torch_optimizer_classes",
    "DEEPSPEED_OPTIMIZER_NAMES",
    "Lamb",
    "Lion",
]
