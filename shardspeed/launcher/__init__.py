"""``deepspeed.launcher``: DeepSpeed's launcher constants (:mod:`.runner`); the launcher is ``shardspeed run``."""
from ..compat.alias import module_getattr

__getattr__ = module_getattr(__name__)
