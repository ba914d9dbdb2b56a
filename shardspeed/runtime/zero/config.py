"""``deepspeed.runtime.zero.config``: ``ZeroStageEnum`` (the zero_optimization block itself is
:class:`shardspeed.config.zero.ZeroConfig`, also exported here as ``DeepSpeedZeroConfig``)."""
from enum import Enum

from ...compat.alias import module_getattr
from ...config.zero import ZeroConfig as DeepSpeedZeroConfig


class ZeroStageEnum(int, Enum):
    """The ZeRO stages under DeepSpeed's names."""

    disabled = 0
    optimizer_states = 1
    gradients = 2
    weights = 3
    max_stage = 3


__all__ = ["DeepSpeedZeroConfig", "ZeroStageEnum"]

__getattr__ = module_getattr(__name__)
