"""``deepspeed.runtime.fp16.loss_scaler``: DeepSpeed's ``LossScaler`` / ``DynamicLossScaler`` constructors and
attributes over shardspeed's scalers (:mod:`shardspeed.precision.loss_scaler`, which already follow DeepSpeed's
ZeRO-path update rule). ``cur_scale`` is readable and settable, ``update_scale(overflow)`` is the update."""
from __future__ import annotations

from typing import Iterable

import torch

from ...compat.alias import module_getattr
from ...precision import loss_scaler as ours
from ...precision.overflow import has_inf_or_nan

INITIAL_LOSS_SCALE = "init_scale"
SCALE_WINDOW = "scale_window"
DELAYED_SHIFT = "delayed_shift"
CONSECUTIVE_HYSTERESIS = "consecutive_hysteresis"
MIN_LOSS_SCALE = "min_scale"


class _DeepSpeedScalerMixin:
    """DeepSpeed's scaler methods on top of a shardspeed scaler's ``_scale`` / ``update``."""

    _scale: float

    @property
    def cur_scale(self) -> float:
        return self._scale

    @cur_scale.setter
    def cur_scale(self, value: float) -> None:
        self._scale = float(value)

    @property
    def loss_scale(self) -> float:
        return self._scale

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        return loss * self._scale

    def backward(self, loss: torch.Tensor, retain_graph: bool = False) -> None:
        self.scale_loss(loss).backward(retain_graph=retain_graph)

    def update_scale(self, overflow: bool) -> None:
        self.update(bool(overflow))  # type: ignore[attr-defined]

    def has_overflow_serial(self, params: Iterable[torch.Tensor]) -> bool:
        return bool(has_inf_or_nan([p.grad for p in params]))

    has_overflow = has_overflow_serial


class LossScaler(_DeepSpeedScalerMixin, ours.StaticLossScaler):
    """A static scale (``LossScaler(scale=1)``); ``update_scale`` changes nothing; ``dynamic`` is False."""

    dynamic = False

    def __init__(self, scale: float = 1) -> None:
        ours.StaticLossScaler.__init__(self, scale)

    def has_overflow(self, params: Iterable[torch.Tensor]) -> bool:
        return False


class DynamicLossScaler(_DeepSpeedScalerMixin, ours.DynamicLossScaler):
    """DeepSpeed's constructor: ``delayed_shift`` is the hysteresis (also readable under that name)."""

    dynamic = True

    def __init__(self, init_scale: float, scale_window: int, min_scale: float, delayed_shift: int,
                 consecutive_hysteresis: bool, raise_error_at_min_scale: bool = True, dtype=torch.half) -> None:
        ours.DynamicLossScaler.__init__(self, init_scale=init_scale, scale_window=scale_window, min_scale=min_scale,
                                        hysteresis=delayed_shift, consecutive_hysteresis=consecutive_hysteresis,
                                        raise_error_at_min_scale=raise_error_at_min_scale)
        self.dtype = dtype

    @property
    def delayed_shift(self) -> int:
        return self.hysteresis


def CreateLossScaler(dtype, static_loss_scale, dynamic_scaling, dynamic_loss_args):  # noqa: N802 (DeepSpeed's)
    """DeepSpeed's factory: dynamic for fp16 with ``dynamic_scaling``, else a static scale (1 unless fp16)."""
    if dtype == torch.half and dynamic_scaling:
        return DynamicLossScaler(dtype=dtype, **dynamic_loss_args)
    return LossScaler(scale=static_loss_scale if dtype == torch.half else 1.0)


__getattr__ = module_getattr(__name__)
