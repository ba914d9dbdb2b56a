"""``deepspeed.ops``: DeepSpeed's optimizer ops (``adam``, ``adagrad``, ``lion``) on torch's kernels, and
``op_builder`` answering for them. The other DeepSpeed ops (transformer kernels, quantizers, aio...) are not
provided: using one fails with the one-line error."""
from ..compat.alias import module_getattr
from . import adagrad, adam, lion, op_builder

__all__ = ["adagrad", "adam", "lion", "op_builder"]

__getattr__ = module_getattr(__name__)
