"""The engine and what it is built from; DeepSpeed's ``deepspeed.runtime`` (its submodules load on first use,
as ``deepspeed.runtime.lr_schedules.VALID_LR_SCHEDULES`` is read by accelerate without an import)."""
from ..compat.alias import module_getattr

__getattr__ = module_getattr(__name__)
