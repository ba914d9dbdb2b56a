"""Per-rank memory of model states under ZeRO (the ZeRO paper's arithmetic), as a pure function.

The per-rank training peak (activations, buckets, gathered units, start-up) is :mod:`shardspeed.estimate`;
``estimate_peak``, ``describe`` and friends are importable from here too.

Model states are parameters, gradients and optimizer states; activations, communication buffers,
padding and the allocator's fragmentation come on top and are not counted here.

With Ψ parameters, N data-parallel ranks and Adam:

=========  ==================================  =======================================
           fp32 (4Ψ params, 4Ψ grads, 8Ψ m+v)  bf16/fp16 (2Ψ, 2Ψ, 12Ψ fp32 master+m+v)
=========  ==================================  =======================================
stage 0    16Ψ                                 16Ψ
stage 1    8Ψ + 8Ψ/N                           4Ψ + 12Ψ/N
stage 2    4Ψ + 12Ψ/N                          2Ψ + 14Ψ/N
stage 3    16Ψ/N                               16Ψ/N
=========  ==================================  =======================================

``offload_optimizer`` moves the optimizer-state shard (12Ψ/N, or 8Ψ/N at fp32) to host memory (stages
1-3); ``offload_param`` (stage 3 only) moves the parameter shard to host memory too.
"""

from __future__ import annotations

from dataclasses import dataclass

from shardspeed.errors import ConfigError

#: bytes per parameter of (params, grads, optimizer states) by training dtype, for Adam.
_BYTES_PER_PARAM = {
    "fp32": (4, 4, 8),  # fp32 weights and grads; Adam m and v
    "bf16": (2, 2, 12),  # 16-bit weights and grads; fp32 master weights, m and v
    "fp16": (2, 2, 12),
}


@dataclass(frozen=True)
class ModelStateMemory:
    """Bytes of model states one rank holds, on the device and in host memory."""

    params_device: float
    grads_device: float
    optimizer_device: float
    params_host: float = 0.0
    grads_host: float = 0.0
    optimizer_host: float = 0.0

    @property
    def device(self) -> float:
        return self.params_device + self.grads_device + self.optimizer_device

    @property
    def host(self) -> float:
        return self.params_host + self.grads_host + self.optimizer_host

    @property
    def total(self) -> float:
        return self.device + self.host


def estimate_model_state_memory(
    num_params: int | float,
    world_size: int = 1,
    stage: int = 0,
    dtype: str = "bf16",
    offload_optimizer: bool = False,
    offload_param: bool = False,
) -> ModelStateMemory:
    """Bytes of parameters, gradients and Adam states per rank for ZeRO ``stage`` over ``world_size``
    data-parallel ranks. ``dtype``: "fp32", "bf16" or "fp16" (16-bit with fp32 master weights).

    Raises ``ConfigError`` for an unknown dtype or stage, a world size below 1, optimizer offload at
    stage 0 or parameter offload below stage 3.
    """
    if dtype not in _BYTES_PER_PARAM:
        raise ConfigError(f"dtype must be one of {', '.join(_BYTES_PER_PARAM)}, got {dtype!r}")
    if stage not in (0, 1, 2, 3):
        raise ConfigError(f"ZeRO stage must be 0, 1, 2 or 3, got {stage!r}")
    if world_size < 1:
        raise ConfigError(f"world_size must be >= 1, got {world_size}")
    if num_params < 0:
        raise ConfigError(f"num_params must be >= 0, got {num_params}")
    if offload_optimizer and stage == 0:
        raise ConfigError("offload_optimizer needs ZeRO stage 1, 2 or 3")
    if offload_param and stage != 3:
        raise ConfigError("offload_param needs ZeRO stage 3")

    p_bytes, g_bytes, o_bytes = _BYTES_PER_PARAM[dtype]
    n = float(num_params)
    params = p_bytes * n / (world_size if stage >= 3 else 1)
    grads = g_bytes * n / (world_size if stage >= 2 else 1)
    optim = o_bytes * n / (world_size if stage >= 1 else 1)

    params_host = params if offload_param else 0.0
    optim_host = optim if offload_optimizer else 0.0
    return ModelStateMemory(
        params_device=params - params_host,
        grads_device=grads,
        optimizer_device=optim - optim_host,
        params_host=params_host,
        optimizer_host=optim_host,
    )


_PEAK_NAMES = ("ActivationProfile", "ModelSpec", "PeakEstimate", "describe", "describe_module", "estimate_peak")


def __getattr__(name: str):
    """The per-rank peak estimator (``shardspeed.estimate``) under this module's name too, imported on first use
    (it needs torch; the model-state arithmetic above does not)."""
    if name in _PEAK_NAMES:
        from . import estimate

        return getattr(estimate, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
