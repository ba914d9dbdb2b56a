"""Per-rank memory of model states under ZeRO (the ZeRO paper's arithmetic), priced on a plan.

Model states are parameters, gradients and optimizer states; activations, communication buffers,
padding and the allocator's fragmentation come on top and are not counted here (the per-rank training
peak is :func:`shardspeed.estimate.estimate_peak`).

With Ψ parameters, N data-parallel ranks and Adam:

=========  ==================================  =======================================
           fp32 (4Ψ params, 4Ψ grads, 8Ψ m+v)  bf16/fp16 (2Ψ, 2Ψ, 12Ψ fp32 master+m+v)
=========  ==================================  =======================================
stage 0    16Ψ                                 16Ψ
stage 1    8Ψ + 8Ψ/N                           4Ψ + 12Ψ/N
stage 2    4Ψ + 12Ψ/N                          2Ψ + 14Ψ/N
stage 3    16Ψ/N                               16Ψ/N
=========  ==================================  =======================================

The precision modes of issue 40 (bytes per parameter, N ranks, Adam): ``torch_autocast`` trains fp32
parameters (the fp32 column); ``bf16.bf16_master_weights_and_grads`` with ``bf16_optimizer_states`` keeps no
fp32 copy: bf16 parameters are their own master (no second copy, where DeepSpeed keeps a bf16 clone) and
Adam's moments are bf16, so 2Ψ + 2Ψ + 4Ψ: stage 1 4Ψ + 4Ψ/N, stage 2 2Ψ + 6Ψ/N, stage 3 8Ψ/N (not at
stage 0, as in DeepSpeed).

``offload_optimizer`` moves the optimizer-state shard to host memory (stages 1-3): 12Ψ/N; at fp32 8Ψ/N plus
a 4Ψ/N master (the parameter shard stays behind, so the master is a copy); with bf16 masters and states 6Ψ/N;
with bf16 or fp16 masters and fp32 moments (DeepSpeedCPUAdam's default; fp16 masters only so, as in
DeepSpeed) 2Ψ/N + 8Ψ/N = 10Ψ/N; ``offload_param`` (stage 3 only) moves the parameter shard to host memory too. Which of these a run
does is the plan's (:func:`model_states`); :func:`estimate_model_state_memory` writes the config of a stage,
a dtype and the offloads, and prices its plan.
"""
from __future__ import annotations

from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, Dict

import torch

from ..errors import ConfigError
from ..plan import Plan
from .planning import plan_for

_DTYPES = MappingProxyType({"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16})


@dataclass(frozen=True)
class ModelStateMemory:
    """Bytes of model states one rank holds, on the device and in host memory (``nvme``: in files)."""

    params_device: float
    grads_device: float
    optimizer_device: float
    params_host: float = 0.0
    grads_host: float = 0.0
    optimizer_host: float = 0.0
    nvme: float = 0.0

    @property
    def device(self) -> float:
        return self.params_device + self.grads_device + self.optimizer_device

    @property
    def host(self) -> float:
        return self.params_host + self.grads_host + self.optimizer_host

    @property
    def total(self) -> float:
        return self.device + self.host


def _dtype_bytes(dtype: torch.dtype) -> int:
    return torch.empty(0, dtype=dtype).element_size()


def model_states(plan: Plan, num_params: float) -> ModelStateMemory:
    """Bytes of parameters, gradients and Adam states per rank of ``num_params`` parameters trained as
    ``plan`` says: the model-parallel slice (``mesh.model`` × ``mesh.pipe``) in the compute dtype, gradients in
    the accumulation dtype, Adam's two states in the master's dtype plus a master copy where the parameters
    are in another dtype (fp32 masters below fp32 training), each partitioned over the
    shard group where the plan partitions it, and held where ``placement`` puts it."""
    sh, pr, where = plan.sharding, plan.precision, plan.placement
    n = float(num_params) / (plan.mesh.model * plan.mesh.pipe)
    div = plan.mesh.shard_size
    m_b = _dtype_bytes(pr.master)
    s_b = _dtype_bytes(pr.states)  # Adam's two moments: fp32, or bf16 with bf16_optimizer_states
    # a master copy unless the parameters are it (same dtype, both on the device, as peak._held prices it)
    separate = pr.compute != pr.master or where.optimizer != "device" or where.params != "device"
    o_b = 2 * s_b + (m_b if separate else 0)
    params = _dtype_bytes(pr.compute) * n / (div if sh.partition_parameters else 1)
    grads = _dtype_bytes(pr.accumulate) * n / (div if sh.partition_gradients else 1)
    optim = o_b * n / (div if sh.partition_optimizer else 1)
    placed: Dict[str, Dict[str, float]] = {"device": {}, "host": {}, "file": {}}
    placed[where.params]["params"] = params
    placed[where.optimizer]["optimizer"] = optim
    dev, host = placed["device"], placed["host"]
    return ModelStateMemory(params_device=dev.get("params", 0.0), grads_device=grads,
                            optimizer_device=dev.get("optimizer", 0.0), params_host=host.get("params", 0.0),
                            optimizer_host=host.get("optimizer", 0.0), nvme=sum(placed["file"].values()))


def state_config(stage: int, dtype: str = "bf16", offload_optimizer: bool = False, offload_param: bool = False,
                 bf16_masters: bool = False, bf16_states: bool = True, fp16_masters: bool = False) -> Dict[str, Any]:
    """The config of ZeRO ``stage`` in ``dtype`` with the offloads (to cpu) asked for; ``bf16_masters``: bf16
    master weights (dtype bf16), with bf16 optimizer states unless ``bf16_states`` is False (fp32 moments: needs
    ``offload_optimizer``); ``fp16_masters``: fp16 master weights with fp32 moments (dtype fp16; needs
    ``offload_optimizer``)."""
    zero: Dict[str, Any] = {"stage": stage}
    if offload_optimizer:
        zero["offload_optimizer"] = {"device": "cpu"}
    if offload_param:
        zero["offload_param"] = {"device": "cpu"}
    cfg: Dict[str, Any] = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": zero}
    if dtype != "fp32":
        cfg[dtype] = {"enabled": True}
    if bf16_masters:
        cfg["bf16"] = {"enabled": True, "bf16_master_weights_and_grads": True, "bf16_optimizer_states": bf16_states}
    if fp16_masters:
        cfg["fp16"] = {"enabled": True, "fp16_master_weights_and_grads": True}
    return cfg


def estimate_model_state_memory(
    num_params: int | float,
    world_size: int = 1,
    stage: int = 0,
    dtype: str = "bf16",
    offload_optimizer: bool = False,
    offload_param: bool = False,
    bf16_masters: bool = False,
    bf16_states: bool = True,
    fp16_masters: bool = False,
) -> ModelStateMemory:
    """Bytes of parameters, gradients and Adam states per rank for ZeRO ``stage`` over ``world_size``
    data-parallel ranks. ``dtype``: "fp32", "bf16" or "fp16" (16-bit with fp32 master weights).
    ``bf16_masters``: bf16 master weights (``dtype`` must be "bf16") and optimizer states, or, ``bf16_states``
    False, fp32 moments (offloaded only, as DeepSpeed: its DeepSpeedCPUAdam). ``fp16_masters``: fp16 master
    weights with fp32 moments (``dtype`` "fp16", ``offload_optimizer`` only, as DeepSpeed).

    Raises ``ConfigError`` for an unknown dtype or stage, a world size below 1, a negative count, and
    optimizer offload at stage 0 (decide's) or parameter offload below stage 3 (asked for here by name,
    unlike a config's ``offload_param`` block, which stages 0-2 ignore as DeepSpeed does).
    """
    if dtype not in _DTYPES:
        raise ConfigError(f"dtype must be one of {', '.join(_DTYPES)}, got {dtype!r}")
    if stage not in (0, 1, 2, 3):
        raise ConfigError(f"ZeRO stage must be 0, 1, 2 or 3, got {stage!r}")
    if world_size < 1:
        raise ConfigError(f"world_size must be >= 1, got {world_size}")
    if num_params < 0:
        raise ConfigError(f"num_params must be >= 0, got {num_params}")
    if offload_param and stage < 3:
        raise ConfigError(f"offload_param needs ZeRO stage 3 (parameters are sharded only there), got stage {stage}")
    if bf16_masters and dtype != "bf16":
        raise ConfigError(f"bf16_masters needs dtype 'bf16', got {dtype!r}")
    if fp16_masters and dtype != "fp16":
        raise ConfigError(f"fp16_masters needs dtype 'fp16', got {dtype!r}")
    plan = plan_for(state_config(stage, dtype, offload_optimizer, offload_param, bf16_masters, bf16_states,
                                 fp16_masters), world_size)
    return model_states(plan, num_params)
