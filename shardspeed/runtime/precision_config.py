"""``deepspeed.runtime.precision_config``: the ``fp16`` and ``bf16`` blocks as DeepSpeed reads them from a config
dict (shardspeed's :class:`~shardspeed.config.precision.FP16Config` / ``BF16Config``, the same keys)."""
from __future__ import annotations

from typing import Any, Dict

from ..compat.alias import module_getattr
from ..config.precision import BF16Config as DeepSpeedBF16Config, FP16Config as DeepSpeedFP16Config

BFLOAT16 = "bf16"
BFLOAT16_OLD = "bfloat16"
FP16 = "fp16"


def get_bfloat16_config(param_dict: Dict[str, Any]) -> DeepSpeedBF16Config:
    """The ``bf16`` block (or its older spelling ``bfloat16``) of a config dict, defaults when absent."""
    block = param_dict.get(BFLOAT16)
    if block is None:
        block = param_dict.get(BFLOAT16_OLD, {})
    return DeepSpeedBF16Config(**block)


def get_float16_config(param_dict: Dict[str, Any]) -> DeepSpeedFP16Config:
    """The ``fp16`` block of a config dict, defaults when absent."""
    return DeepSpeedFP16Config(**param_dict.get(FP16, {}))


__all__ = ["BFLOAT16", "BFLOAT16_OLD", "FP16", "DeepSpeedBF16Config", "DeepSpeedFP16Config", "get_bfloat16_config",
           "get_float16_config"]

__getattr__ = module_getattr(__name__)
