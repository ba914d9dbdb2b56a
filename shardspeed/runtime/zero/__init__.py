"""``deepspeed.runtime.zero``: DeepSpeed's ZeRO package path; ``Init`` and ``GatheredParameters`` are
:mod:`shardspeed.zero`'s."""
from ...compat.alias import module_getattr
from ...zero import GatheredParameters, Init

__all__ = ["Init", "GatheredParameters"]

__getattr__ = module_getattr(__name__)
