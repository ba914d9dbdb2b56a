"""The engine and its runtime parts (DeepSpeed's ``deepspeed.runtime``): a submodule read as an attribute
(``deepspeed.runtime.lr_schedules``) is imported on first use; a missing one fails with the one line."""
from ..compat.alias import module_getattr

__getattr__ = module_getattr(__name__)
