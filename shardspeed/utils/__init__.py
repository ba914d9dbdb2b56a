"""DeepSpeed-compatible utility modules (``shardspeed.utils.groups`` mirrors ``deepspeed.utils.groups``),
``RepeatingLoader`` (``deepspeed.utils.RepeatingLoader``) and ``logger`` (``deepspeed.utils.logger``: shardspeed's
logger, whose level transformers' Trainer sets)."""
import logging

from .repeating import RepeatingLoader

logger = logging.getLogger("shardspeed")

__all__ = ["RepeatingLoader", "logger"]
