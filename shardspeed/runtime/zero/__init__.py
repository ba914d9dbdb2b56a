"""``deepspeed.runtime.zero``: ZeRO's names at DeepSpeed's paths (the implementation is :mod:`shardspeed.zero`)."""
from ...compat.alias import module_getattr
from ...zero import GatheredParameters, Init
from .partition_parameters import ZeroParamStatus

__all__ = ["GatheredParameters", "Init", "ZeroParamStatus"]

__getattr__ = module_getattr(__name__)
