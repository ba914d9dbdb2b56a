"""``deepspeed.runtime.zero.partition_parameters``: ``Init``, ``GatheredParameters`` and ``ZeroParamStatus``
(the value of a stage-3 parameter's ``ds_status``; defined in :mod:`shardspeed.zero.status`)."""
from ...compat.alias import module_getattr
from ...zero import GatheredParameters, Init
from ...zero.status import ZeroParamStatus

__all__ = ["GatheredParameters", "Init", "ZeroParamStatus"]

__getattr__ = module_getattr(__name__)
