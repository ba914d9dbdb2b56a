"""``deepspeed.runtime.base_optimizer.DeepSpeedOptimizer``: the class DeepSpeed's engine optimizers derive from.

shardspeed's engine steps an ordinary torch optimizer (``engine.optimizer``, the caller's or the one built
from the config) at every stage, so this class is matched by a check rather than by inheritance:
``isinstance(x, DeepSpeedOptimizer)`` is True for an optimizer a shardspeed engine was built with
(:func:`mark_engine_optimizer`, called by the engine) and for any subclass of this class.
"""
from __future__ import annotations

from typing import Any

from ..compat.alias import module_getattr

#: The attribute the engine sets on its optimizer (public: ``hasattr(opt, ENGINE_OPTIMIZER_ATTR)``).
ENGINE_OPTIMIZER_ATTR = "ds_engine_optimizer"


class _EngineOptimizerCheck(type):
    def __instancecheck__(cls, instance: Any) -> bool:
        return type.__instancecheck__(cls, instance) or bool(getattr(instance, ENGINE_OPTIMIZER_ATTR, False))


class DeepSpeedOptimizer(metaclass=_EngineOptimizerCheck):
    """Base of DeepSpeed's optimizer wrappers; see the module docstring for how instances are recognised."""


def mark_engine_optimizer(optimizer: Any) -> None:
    """Make ``isinstance(optimizer, DeepSpeedOptimizer)`` True (the engine calls it on ``engine.optimizer``)."""
    if optimizer is not None:
        setattr(optimizer, ENGINE_OPTIMIZER_ATTR, True)


__getattr__ = module_getattr(__name__)
