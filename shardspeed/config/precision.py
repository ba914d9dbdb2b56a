"""Mixed-precision blocks: `fp16`, `bf16` (alias `bfloat16`), `data_types`, and dtype spellings."""
from __future__ import annotations

from types import MappingProxyType
from typing import Any, List, Literal, Optional, Union

import torch
from pydantic import field_validator
from pydantic_core import PydanticCustomError

from .base import ConfigModel, field

DtypeName = Literal["fp32", "fp16", "bf16"]

# Spellings DeepSpeed accepts for a dtype (its DtypeEnum), compared case-insensitively.
_DTYPE_SPELLINGS = MappingProxyType({
    "fp32": "fp32", "float32": "fp32", "float": "fp32", "torch.float32": "fp32",
    "fp16": "fp16", "float16": "fp16", "half": "fp16", "torch.float16": "fp16",
    "bf16": "bf16", "bfloat16": "bf16", "torch.bfloat16": "bf16",
})

#: The largest ``fp16.initial_scale_power``: 2.0 ** 1024 overflows a Python float.
MAX_SCALE_POWER = 1023

TORCH_DTYPES = MappingProxyType({"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16})


def normalize_dtype_name(value: Any) -> Any:
    """Map DeepSpeed's dtype spellings ("fp16", "float16", "half", "torch.float16", ...) to
    "fp32" | "fp16" | "bf16"; None stays None. Anything else is an error listing the choices."""
    if value is None:
        return None
    if isinstance(value, torch.dtype):
        value = str(value)
    if isinstance(value, str) and value.strip().lower() in _DTYPE_SPELLINGS:
        return _DTYPE_SPELLINGS[value.strip().lower()]
    raise PydanticCustomError("dtype", "must be one of \"fp32\", \"fp16\", \"bf16\" (or float32, float16, "
                              "bfloat16, half, ...)", {})


class FP16Config(ConfigModel):
    """`fp16`: mixed precision with fp16 weights and activations, fp32 master weights, loss scaling."""

    enabled: bool = field(False, "Train in fp16 (fp32 master weights and optimizer states, loss scaling).",
                          auto={"value": False})
    auto_cast: bool = field(False, "Cast floating-point inputs of the model's forward to fp16.")
    loss_scale: float = field(0.0, "Static loss scale; 0 selects dynamic loss scaling.", ge=0,
                              allow_inf_nan=False)
    initial_scale_power: int = field(16, "Dynamic scaling starts at 2**initial_scale_power (at most 1023: "
                                     "the scale must be a finite float).", ge=0, le=MAX_SCALE_POWER)
    loss_scale_window: int = field(1000, "Steps without overflow before the dynamic scale is doubled.", ge=1)
    hysteresis: int = field(2, "Overflows tolerated (delayed shift) before the dynamic scale is halved.", ge=1)
    consecutive_hysteresis: bool = field(
        False, "Refill the hysteresis counter after every step without overflow.")
    min_loss_scale: float = field(1.0, "Floor of the dynamic loss scale.", gt=0, allow_inf_nan=False)
    fp16_master_weights_and_grads: bool = field(
        False, "DeepSpeed: keep master weights in fp16 (CPU Adam only). Master weights are fp32 here.",
        not_implemented="16-bit master weights")


class BF16Config(ConfigModel):
    """`bf16` (alias `bfloat16`): mixed precision with bf16 weights and activations, no loss scaling."""

    enabled: bool = field(False, "Train in bf16 (fp32 master weights and optimizer states).",
                          auto={"value": False})
    immediate_grad_update: bool = field(False, "DeepSpeed: apply gradient updates immediately.", ignored=True)
    check_grad_overflow: bool = field(
        True, "Skip the optimizer step (on every rank, counted in skipped_steps, LR schedule held) when the "
        "global gradient norm is inf/nan, in bf16 and fp32 training alike; fp16 always checks.")
    bf16_master_weights_and_grads: bool = field(
        False, "DeepSpeed: keep master weights and gradients in bf16. Master weights are fp32 here.",
        not_implemented="16-bit master weights")
    bf16_optimizer_states: bool = field(False, "DeepSpeed: keep optimizer states in bf16.",
                                        not_implemented="bf16 optimizer states")


class DataTypesConfig(ConfigModel):
    """`data_types`: dtypes of specific buffers."""

    grad_accum_dtype: Optional[DtypeName] = field(
        None, "Dtype gradients are accumulated in across micro-batches (\"fp32\", \"fp16\", \"bf16\"); "
        "None means the training dtype.")
    param_dtype: Optional[DtypeName] = field(None, "DeepSpeed: cast parameters to this dtype.",
                                             not_implemented="casting parameters to data_types.param_dtype")
    buffer_dtype: Optional[DtypeName] = field(None, "DeepSpeed: cast module buffers to this dtype.",
                                              not_implemented="casting module buffers to data_types.buffer_dtype")
    keep_in_fp32_modules: Union[Literal["auto"], List[str]] = field(
        "auto", "DeepSpeed: module name patterns whose buffers stay fp32 (\"auto\": the model's own list).",
        auto="keep", ignored=True)

    @field_validator("grad_accum_dtype", "param_dtype", "buffer_dtype", mode="before")
    @classmethod
    def _normalize_dtype(cls, value: Any) -> Any:
        return normalize_dtype_name(value)


def check_precision(fp16: FP16Config, bf16: BF16Config) -> None:
    """fp16 and bf16 are exclusive."""
    if fp16.enabled and bf16.enabled:
        raise PydanticCustomError("precision_conflict",
                                  "fp16.enabled and bf16.enabled are both true; enable at most one", {})


__all__ = ["FP16Config", "BF16Config", "DataTypesConfig", "normalize_dtype_name", "TORCH_DTYPES",
           "DtypeName", "check_precision"]
