"""``deepspeed.accelerator``: ``get_accelerator()`` and DeepSpeed's accelerator classes, on torch (CPU and
CUDA). Importing it initialises no device."""
from ..compat.alias import module_getattr
from .abstract_accelerator import DeepSpeedAccelerator
from .real_accelerator import get_accelerator, is_current_accelerator_supported

__all__ = ["DeepSpeedAccelerator", "get_accelerator", "is_current_accelerator_supported"]

__getattr__ = module_getattr(__name__)
