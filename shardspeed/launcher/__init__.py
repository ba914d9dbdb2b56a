"""``deepspeed.launcher``: DeepSpeed's launcher constants (:mod:`.runner`). The launcher itself is
``shardspeed run`` (shardspeed/cli/run.py)."""
from ..compat.alias import module_getattr

__getattr__ = module_getattr(__name__)
