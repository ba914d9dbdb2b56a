"""``deepspeed.ops.lion``: ``DeepSpeedCPULion`` and ``FusedLion`` on shardspeed's Lion."""
from ...compat.alias import module_getattr
from .cpu_lion import DeepSpeedCPULion, FusedLion

__all__ = ["DeepSpeedCPULion", "FusedLion"]

__getattr__ = module_getattr(__name__)
