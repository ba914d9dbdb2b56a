"""DeepSpeed-compatible utility modules (``shardspeed.utils.groups`` mirrors ``deepspeed.utils.groups``) and
``RepeatingLoader`` (``deepspeed.utils.RepeatingLoader``)."""
import logging

from .repeating import RepeatingLoader

# ``deepspeed.utils.logger``: shardspeed's own logger (transformers sets its level around ``initialize``)
logger = logging.getLogger("shardspeed")

__all__ = ["RepeatingLoader", "logger"]
