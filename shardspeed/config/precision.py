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
        False, "Keep master weights and gradients in fp16, no fp32 copy (ZeRO 1-3, with fp16.enabled and "
        "zero_optimization.offload_optimizer, as DeepSpeed requires: its DeepSpeedCPUAdam). The fp16 masters live "
        "on the host (or in the NVMe files) beside fp32 Adam moments (fp16 ones with optimizer.params "
        "fp32_optimizer_states false); each element is stepped in fp32 and the master rounded once.")


class BF16Config(ConfigModel):
    """`bf16` (alias `bfloat16`): mixed precision with bf16 weights and activations, no loss scaling."""

    enabled: bool = field(False, "Train in bf16 (fp32 master weights and optimizer states).",
                          auto={"value": False})
    immediate_grad_update: bool = field(False, "DeepSpeed: apply gradient updates immediately.", ignored=True)
    check_grad_overflow: bool = field(
        True, "Skip the optimizer step (on every rank, counted in skipped_steps, LR schedule held) when the "
        "global gradient norm is inf/nan, in bf16 and fp32 training alike; fp16 always checks.")
    bf16_master_weights_and_grads: bool = field(
        False, "Keep master weights and gradients in bf16, no fp32 copy (ZeRO 1-3; with bf16_optimizer_states, "
        "as DeepSpeed requires without offload; with offload_optimizer device cpu the bf16 masters and Adam's "
        "moments live on the host, the moments fp32 unless bf16_optimizer_states, as DeepSpeedCPUAdam keeps them). "
        "A bf16 training run's master is then the bf16 shard itself.")
    bf16_optimizer_states: bool = field(False, "Keep optimizer states (Adam's moments) in bf16 (ZeRO 1-3; needs "
                                        "bf16_master_weights_and_grads; without it they are fp32).")


class DataTypesConfig(ConfigModel):
    """`data_types`: dtypes of specific buffers."""

    grad_accum_dtype: Optional[DtypeName] = field(
        None, "Dtype gradients are accumulated in across micro-batches (\"fp32\", \"fp16\", \"bf16\"); "
        "None means the training dtype.")
    param_dtype: Optional[DtypeName] = field(
        None, "Dtype of the parameters; must equal the training dtype (fp16/bf16/fp32, as DeepSpeed asserts). "
        "None: the training dtype.")
    buffer_dtype: Optional[DtypeName] = field(
        None, "Cast the module's floating buffers to this dtype (except those keep_in_fp32_modules names). "
        "None: buffers keep their dtype.")
    keep_in_fp32_modules: Union[Literal["auto"], List[str]] = field(
        "auto", "Name patterns (`*` any characters, matched anywhere in the buffer's name) of buffers kept in fp32 "
        "under bf16/fp16 training; \"auto\": the model's transformers `_keep_in_fp32_modules_strict` (and "
        "`_keep_in_fp32_modules` under fp16); []: none.", auto="keep")

    @field_validator("grad_accum_dtype", "param_dtype", "buffer_dtype", mode="before")
    @classmethod
    def _normalize_dtype(cls, value: Any) -> Any:
        return normalize_dtype_name(value)


class TorchAutocastConfig(ConfigModel):
    """`torch_autocast`: fp32 parameters (unless bf16/fp16 is enabled too), the forward under `torch.autocast`,
    and the gradients of the listed module types' parameters reduced in the autocast dtype."""

    enabled: bool = field(False, "Run the forward under torch.autocast(device type, dtype).")
    dtype: Optional[DtypeName] = field(
        None, "Autocast dtype (\"bf16\", \"fp16\"); None: torch's default for the device (bf16 on CPU, fp16 on "
        "CUDA). fp16 adds a dynamic loss scale (torch's GradScaler defaults: 2**16, halved on overflow, doubled "
        "after 2000 clean steps).")
    lower_precision_safe_modules: Optional[List[str]] = field(
        None, "Module classes (\"package.Class\") whose parameters' gradients are reduced in the autocast dtype; "
        "None: torch.nn.Linear, Conv1d, Conv2d, Conv3d.")

    @field_validator("dtype", mode="before")
    @classmethod
    def _normalize_dtype(cls, value: Any) -> Any:
        return normalize_dtype_name(value)


def check_precision(fp16: FP16Config, bf16: BF16Config) -> None:
    """fp16 and bf16 are exclusive; 16-bit masters as DeepSpeed allows them (stages are checked by the plan)."""
    if fp16.enabled and bf16.enabled:
        raise PydanticCustomError("precision_conflict",
                                  "fp16.enabled and bf16.enabled are both true; enable at most one", {})
    if bf16.bf16_optimizer_states and not bf16.bf16_master_weights_and_grads:
        raise PydanticCustomError("precision_conflict", "bf16.bf16_optimizer_states requires "
                                  "bf16.bf16_master_weights_and_grads (as in DeepSpeed); set both", {})
    if fp16.fp16_master_weights_and_grads and bf16.bf16_master_weights_and_grads:
        raise PydanticCustomError("precision_conflict", "fp16.fp16_master_weights_and_grads and "
                                  "bf16.bf16_master_weights_and_grads are mutually exclusive; set at most one", {})


__all__ = ["FP16Config", "BF16Config", "DataTypesConfig", "TorchAutocastConfig", "normalize_dtype_name", "TORCH_DTYPES",
           "DtypeName", "check_precision"]
