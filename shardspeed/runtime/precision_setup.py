"""What the builder does to a model for its precision plan: the cast of parameters and buffers
(``data_types``), and ``torch_autocast``'s tags on the parameters that reduce their gradients in the autocast
dtype."""
from __future__ import annotations

import logging
from typing import Optional

import torch
from torch import nn

from ..errors import ConfigError
from ..pipe.module import PipelineModule
from ..plan.types import PrecisionPlan
from ..precision.casting import cast_module, safe_module_classes, tag_lower_precision_params

logger = logging.getLogger("shardspeed")


def prepare_precision(model: nn.Module, precision: PrecisionPlan, device: torch.device) -> Optional[torch.dtype]:
    """Cast ``model`` as the plan says and tag its lower-precision-safe parameters; returns the dtype the forward
    autocasts to (None: no autocast)."""
    cast = precision.cast
    kept = cast_module(model, cast.params, cast.buffers, cast.keep_in_fp32)
    if kept:
        logger.info("data_types.keep_in_fp32_modules: %d buffer(s) kept in fp32", kept)
    ac = precision.autocast
    if ac is None:
        return None
    if isinstance(model, PipelineModule):
        raise ConfigError("torch_autocast with a PipelineModule is not implemented yet in shardspeed (its schedule "
                          "runs the stages without the engine's forward); use bf16.enabled instead")
    dtype = ac.dtype if ac.dtype is not None else torch.get_autocast_dtype(device.type)
    tag_lower_precision_params(model, safe_module_classes(ac.safe_modules), dtype)
    return dtype


__all__ = ["prepare_precision"]
