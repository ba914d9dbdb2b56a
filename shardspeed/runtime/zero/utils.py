"""``deepspeed.runtime.zero.utils``: ``ZeRORuntimeException``, the type DeepSpeed raises when ZeRO refuses a
setup at run time. shardspeed raises it nowhere yet: where DeepSpeed raises it (a client optimizer with
``offload_optimizer`` while ``zero_force_ds_cpu_optimizer`` is true), shardspeed trains with that optimizer."""
from ...compat.alias import module_getattr
from ...errors import ShardspeedError


class ZeRORuntimeException(ShardspeedError, RuntimeError):
    """DeepSpeed's ZeRO run-time refusal (``except ZeRORuntimeException`` catches nothing shardspeed raises)."""


__getattr__ = module_getattr(__name__)
