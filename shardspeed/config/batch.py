"""Batch-size arithmetic: train_batch_size = micro-batch × accumulation steps × data-parallel size."""
from __future__ import annotations

from typing import Optional, Tuple

from shardspeed.errors import ConfigError


def resolve_batch_sizes(train_batch_size: Optional[int], micro: Optional[int], gas: Optional[int],
                        world_size: int) -> Tuple[int, int, int]:
    """Fill in the batch trio as DeepSpeed does and check it.

    Returns `(train_batch_size, train_micro_batch_size_per_gpu, gradient_accumulation_steps)`.
    Given all three, they must satisfy train == micro × gas × world. Given two, the third is derived
    (it must divide exactly). Only train: micro = train / world, gas 1. Only micro: gas 1,
    train = micro × world. Otherwise a `ConfigError`.
    """
    if not isinstance(world_size, int) or isinstance(world_size, bool) or world_size < 1:
        raise ConfigError(f"world size must be a positive integer, got {world_size!r}")
    for name, value in (("train_batch_size", train_batch_size), ("train_micro_batch_size_per_gpu", micro),
                        ("gradient_accumulation_steps", gas)):
        if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
            raise ConfigError(f"{name} must be a positive integer, got {value!r}")

    if train_batch_size is not None and micro is not None and gas is None:
        _check_divisible(train_batch_size, "train_micro_batch_size_per_gpu", micro, world_size)
        gas = train_batch_size // (micro * world_size)
    elif train_batch_size is not None and gas is not None and micro is None:
        _check_divisible(train_batch_size, "gradient_accumulation_steps", gas, world_size)
        micro = train_batch_size // (gas * world_size)
    elif train_batch_size is None and micro is not None and gas is not None:
        train_batch_size = micro * gas * world_size
    elif train_batch_size is not None and micro is None and gas is None:
        _check_divisible(train_batch_size, None, None, world_size)
        micro, gas = train_batch_size // world_size, 1
    elif train_batch_size is None and micro is not None and gas is None:
        gas, train_batch_size = 1, micro * world_size
    elif train_batch_size is None and micro is None:
        raise ConfigError("set train_batch_size or train_micro_batch_size_per_gpu (or both): neither is given"
                          + (" (gradient_accumulation_steps alone is not enough)" if gas is not None else ""))

    assert train_batch_size is not None and micro is not None and gas is not None
    if train_batch_size != micro * gas * world_size:
        raise ConfigError(
            f"train_batch_size ({train_batch_size}) != train_micro_batch_size_per_gpu ({micro}) × "
            f"gradient_accumulation_steps ({gas}) × data-parallel size ({world_size}) = "
            f"{micro * gas * world_size}")
    return train_batch_size, micro, gas


def _check_divisible(train: int, other_name: Optional[str], other: Optional[int], world_size: int) -> None:
    divisor = world_size if other is None else other * world_size
    if train % divisor:
        what = "world size" if other is None else f"{other_name} {other} × world size"
        result = "" if other is None else f" = {divisor}"
        raise ConfigError(f"train_batch_size {train} is not divisible by {what} {world_size}{result}")
