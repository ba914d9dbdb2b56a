"""``deepspeed.runtime.activation_checkpointing``: ``checkpointing`` is :mod:`shardspeed.checkpointing`."""
from ...compat.alias import module_getattr
from . import checkpointing

__all__ = ["checkpointing"]

__getattr__ = module_getattr(__name__)
