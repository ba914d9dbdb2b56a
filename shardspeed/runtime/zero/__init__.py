"""``deepspeed.runtime.zero``: ``Init`` and ``GatheredParameters`` (shardspeed's own, from :mod:`shardspeed.zero`)
and the ``partition_parameters`` module."""
from ...compat.alias import module_getattr
from ...zero import GatheredParameters, Init

__all__ = ["GatheredParameters", "Init"]

__getattr__ = module_getattr(__name__)
