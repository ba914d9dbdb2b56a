"""``deepspeed.runtime.zero.partition_parameters``: ``Init`` and ``GatheredParameters`` (shardspeed's,
:mod:`shardspeed.zero`) and ``ZeroParamStatus``, the value of a stage-3 parameter's ``ds_status``."""
from enum import Enum

from ...compat.alias import module_getattr
from ...zero import GatheredParameters, Init


class ZeroParamStatus(Enum):
    """A stage-3 parameter: whole on this rank (``AVAILABLE``), only its shard here (``NOT_AVAILABLE``),
    or being gathered (``INFLIGHT``). The values are DeepSpeed's."""

    AVAILABLE = 1
    NOT_AVAILABLE = 2
    INFLIGHT = 3


__all__ = ["GatheredParameters", "Init", "ZeroParamStatus"]

__getattr__ = module_getattr(__name__)
