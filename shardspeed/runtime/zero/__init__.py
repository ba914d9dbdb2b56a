"""``deepspeed.runtime.zero``: ``Init``, ``GatheredParameters`` (:mod:`shardspeed.zero`), the parameter-status
and offload enums, and ``ZeroStageEnum``."""
from ...compat.alias import module_getattr
from ...zero import GatheredParameters, Init
from .config import ZeroStageEnum
from .offload_config import OffloadDeviceEnum, OffloadStateTypeEnum
from .partition_parameters import ZeroParamStatus

__all__ = ["GatheredParameters", "Init", "OffloadDeviceEnum", "OffloadStateTypeEnum", "ZeroParamStatus",
           "ZeroStageEnum"]

__getattr__ = module_getattr(__name__)
