"""``deepspeed.ops.lion.fused_lion``: ``FusedLion`` (see :mod:`.cpu_lion`)."""
from ...compat.alias import module_getattr
from .cpu_lion import FusedLion

__all__ = ["FusedLion"]

__getattr__ = module_getattr(__name__)
