"""The precision modes beyond fp16/bf16 training: ``torch_autocast``, 16-bit master weights and optimizer
states, and ``data_types.param_dtype``/``buffer_dtype``/``keep_in_fp32_modules``, with DeepSpeed 0.19.8's rules
(its config's and ZeRO optimizers' asserts) as ConfigErrors naming the keys. Pure: no tensor, no module."""
from __future__ import annotations

from dataclasses import dataclass
from types import MappingProxyType
from typing import Optional, Tuple, Union

import torch

from ..config import ShardspeedConfig
from ..errors import ConfigError

_DTYPES = MappingProxyType({"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16})

#: DeepSpeed's default ``torch_autocast.lower_precision_safe_modules`` (deepspeed/runtime/torch_autocast.py)
DEFAULT_SAFE_MODULES: Tuple[str, ...] = ("torch.nn.Linear", "torch.nn.Conv1d", "torch.nn.Conv2d", "torch.nn.Conv3d")


@dataclass(frozen=True)
class AutocastPlan:
    """``torch_autocast``: the forward runs under ``torch.autocast(device, dtype)`` (dtype None: torch's
    default for the device); parameters of ``safe_modules`` (classes by dotted name) reduce their gradients in
    that dtype."""

    dtype: Optional[torch.dtype] = None
    safe_modules: Tuple[str, ...] = DEFAULT_SAFE_MODULES


@dataclass(frozen=True)
class CastPlan:
    """How the builder casts the module: parameters to ``params`` (None: left as given), floating buffers to
    ``buffers`` (None: left as given), except buffers matching ``keep_in_fp32`` ("auto": the model's own
    transformers lists; a tuple of patterns; () none), which are kept in (or brought to) fp32 under 16-bit
    training."""

    params: Optional[torch.dtype] = None
    buffers: Optional[torch.dtype] = None
    keep_in_fp32: Union[str, Tuple[str, ...]] = "auto"


def autocast_plan(cfg: ShardspeedConfig) -> Optional[AutocastPlan]:
    """None unless ``torch_autocast.enabled``; refuses what DeepSpeed refuses with it (quantized weights)."""
    ta = cfg.torch_autocast
    if not ta.enabled:
        return None
    if cfg.zero_optimization.zero_quantized_weights:
        raise ConfigError("torch_autocast.enabled with zero_optimization.zero_quantized_weights: DeepSpeed refuses "
                          "the pair (\"Cannot enable both torch autocast and zero quantized weights\"); drop one")
    safe = tuple(ta.lower_precision_safe_modules) if ta.lower_precision_safe_modules is not None \
        else DEFAULT_SAFE_MODULES
    return AutocastPlan(dtype=_DTYPES[ta.dtype] if ta.dtype is not None else None, safe_modules=safe)


def _offloaded(cfg: ShardspeedConfig) -> bool:
    offload = cfg.zero_optimization.offload_optimizer
    return offload is not None and offload.device != "none"


def master_dtype(cfg: ShardspeedConfig) -> torch.dtype:
    """The dtype of master weights and of the gradients the optimizer steps on: bf16 with
    ``bf16.bf16_master_weights_and_grads``, fp16 with ``fp16.fp16_master_weights_and_grads``, else fp32.
    DeepSpeed's rules: 16-bit masters only at ZeRO 1-3; bf16 masters without ``bf16_optimizer_states`` (fp32
    moments), and fp16 masters always, only with ZeRO-Offload and its CPU Adam (``runtime/zero/stage_1_and_2.py``,
    ``stage3.py``: ``_enforce_cpu_offload``); bf16 masters with ``bf16_optimizer_states`` run with or without
    offload there. shardspeed runs bf16 masters with bf16 states on the device or offloaded (CPU or NVMe: the
    state files in the masters' and moments' dtypes), bf16 or fp16 masters with fp32 states offloaded
    (:func:`state_dtype`); each other case is refused by name, saying whether DeepSpeed refuses it."""
    stage = int(cfg.zero_optimization.stage)
    bf16, fp16 = cfg.bf16, cfg.fp16
    for key, on in (("fp16.fp16_master_weights_and_grads", fp16.fp16_master_weights_and_grads),
                    ("bf16.bf16_master_weights_and_grads", bf16.bf16_master_weights_and_grads),
                    ("bf16.bf16_optimizer_states", bf16.bf16_optimizer_states)):
        if on and stage == 0:
            raise ConfigError(f"{key} is only supported with ZeRO stage 1, 2 or 3 (as in DeepSpeed); set "
                              f"zero_optimization.stage or drop the key")
    offloaded = _offloaded(cfg)
    if fp16.fp16_master_weights_and_grads:
        return _fp16_masters(cfg, offloaded)
    if not bf16.bf16_master_weights_and_grads:
        return torch.float32
    if not bf16.bf16_optimizer_states and not offloaded:
        raise ConfigError("bf16.bf16_master_weights_and_grads without bf16.bf16_optimizer_states and without "
                          "zero_optimization.offload_optimizer: DeepSpeed refuses it too (\"Master weights feature "
                          "requires ZeRO Offload with DeepSpeedCPUAdam\": fp32 moments live on the host); set "
                          "bf16_optimizer_states true, or offload_optimizer device 'cpu'")
    return torch.bfloat16


def _fp16_masters(cfg: ShardspeedConfig, offloaded: bool) -> torch.dtype:
    """fp16 masters (DeepSpeed's: on the host beside fp32 moments, stepped by DeepSpeedCPUAdam in fp32 and rounded
    once) need ZeRO-Offload, as DeepSpeed asserts, and fp16 training (the masters are the fp16 weights' own)."""
    if not offloaded:
        raise ConfigError("fp16.fp16_master_weights_and_grads without zero_optimization.offload_optimizer: DeepSpeed "
                          "refuses it too (\"Master weights feature requires ZeRO Offload with DeepSpeedCPUAdam\"); "
                          "set offload_optimizer device 'cpu' (or 'nvme'), or drop the key (fp32 masters)")
    if not cfg.fp16.enabled:
        raise ConfigError("fp16.fp16_master_weights_and_grads needs fp16.enabled true (fp16 weights, of which the "
                          "masters are the fp16 copy); set fp16.enabled or drop the key")
    return torch.float16


def state_dtype(cfg: ShardspeedConfig) -> torch.dtype:
    """The dtype of the optimizer's states (Adam's moments): bf16 with ``bf16.bf16_optimizer_states``, else fp32
    (with bf16 or fp16 masters too: DeepSpeedCPUAdam's default ``fp32_optimizer_states``), except that offloaded
    16-bit masters with ``optimizer.params.fp32_optimizer_states: false`` keep moments in the masters' dtype
    (DeepSpeedCPUAdam's states then follow its parameters). The rules are :func:`master_dtype`'s."""
    if cfg.bf16.bf16_optimizer_states:
        return torch.bfloat16
    params = cfg.optimizer.params if cfg.optimizer is not None else {}
    if _offloaded(cfg) and params.get("fp32_optimizer_states") is False:
        if cfg.bf16.bf16_master_weights_and_grads:
            return torch.bfloat16
        if cfg.fp16.fp16_master_weights_and_grads:
            return torch.float16
    return torch.float32


def cast_plan(cfg: ShardspeedConfig) -> CastPlan:
    """``data_types``: ``param_dtype`` must equal the training dtype (DeepSpeed asserts it); parameters are cast
    to the training dtype under fp16/bf16, left as given otherwise; buffers only when ``buffer_dtype`` is set."""
    dt = cfg.data_types
    train = cfg.train_dtype
    if dt.param_dtype is not None and _DTYPES[dt.param_dtype] != train:
        raise ConfigError(f"data_types.param_dtype '{dt.param_dtype}' conflicts with the training dtype {train} "
                          f"(fp16/bf16 'enabled'); set the matching fp16/bf16 'enabled' flag or drop param_dtype")
    keep = dt.keep_in_fp32_modules
    return CastPlan(params=train if train != torch.float32 else None,
                    buffers=_DTYPES[dt.buffer_dtype] if dt.buffer_dtype is not None else None,
                    keep_in_fp32=keep if isinstance(keep, str) else tuple(keep))


__all__ = ["AutocastPlan", "CastPlan", "DEFAULT_SAFE_MODULES", "autocast_plan", "master_dtype", "state_dtype",
           "cast_plan"]
