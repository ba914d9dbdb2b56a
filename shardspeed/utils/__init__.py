"""DeepSpeed-compatible utility modules (``shardspeed.utils.groups`` mirrors ``deepspeed.utils.groups``) and
``RepeatingLoader`` (``deepspeed.utils.RepeatingLoader``)."""
from .repeating import RepeatingLoader

__all__ = ["RepeatingLoader"]
