"""What the engine records for DeepSpeed's names that start from an object the engine holds, not the engine:
``isinstance(engine.optimizer, DeepSpeedOptimizer)`` and ``safe_get_full_fp32_param(param)``."""
from __future__ import annotations

from typing import Any

from ..utils.tensor_fragment import link_engine as _link_params
from .base_optimizer import mark_engine_optimizer


def link_engine(engine: Any) -> None:
    """Mark ``engine.optimizer`` as a DeepSpeedOptimizer and link the model's parameters to ``engine``."""
    mark_engine_optimizer(engine.optimizer)
    _link_params(engine)
