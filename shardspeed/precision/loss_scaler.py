"""Loss scalers for fp16 training: a static one and DeepSpeed's dynamic one.

The engine multiplies the loss by ``scaler.scale`` before backward, treats a non-finite global gradient
norm (one all-reduce of squared norms, in :meth:`shardspeed.zero.master.MasterWeights.step`) as overflow
and skips the update, and calls ``scaler.update(overflow)`` exactly once per optimizer step (overflowed or not).

Design note "ZeRO-path loss scaling": DeepSpeed has two dynamic scalers in practice. Its ZeRO optimizers
(and ``FP16_Optimizer``) use ``DynamicLossScaler.update_scale`` with hysteresis and raise when an overflow
happens at the minimum scale; its non-ZeRO "unfused" fp16 path halves on every overflow and never raises.
shardspeed uses the ZeRO-path semantics for every stage, so a job behaves the same whatever the stage.
"""

from __future__ import annotations

import logging
from types import MappingProxyType
from typing import Any, Dict, Optional, Union

import torch

from shardspeed.errors import LossScaleError

logger = logging.getLogger(__name__)

__all__ = ["StaticLossScaler", "DynamicLossScaler", "build_loss_scaler"]


_DTYPE_NAMES = MappingProxyType({torch.float16: "fp16", torch.bfloat16: "bf16", torch.float32: "fp32"})


def dtype_name(dtype: Union[torch.dtype, str, None]) -> Optional[str]:
    """``fp16``/``bf16``/``fp32`` for a torch dtype (a string is kept; None stays None)."""
    if dtype is None or isinstance(dtype, str):
        return dtype
    return _DTYPE_NAMES.get(dtype, str(dtype).replace("torch.", ""))


class StaticLossScaler:
    """A constant loss scale. ``update`` does nothing (the step is still skipped on overflow).

    ``dtype``: the training dtype, named in the warning of a skipped step (``fp16``: an overflow under the
    static scale; ``fp32``/``bf16``: no loss scaling, the gradients themselves were inf/NaN; None: fp32 or
    bf16, not known which)."""

    dynamic = False

    def __init__(self, scale: float = 1.0, dtype: Union[torch.dtype, str, None] = "fp16") -> None:
        if not scale > 0:
            raise LossScaleError(f"static loss scale must be > 0, got {scale}")
        self._scale = float(scale)
        self.dtype = dtype_name(dtype)

    @property
    def scale(self) -> float:
        return self._scale

    # DeepSpeed's attribute names, for user code that reads them off the optimizer.
    loss_scale = scale
    cur_scale = scale

    def update(self, overflow: bool) -> None:
        if not overflow:
            return
        if self.dtype == "fp16":
            logger.warning("fp16 overflow (inf/nan gradients) with static loss scale %g: step skipped", self._scale)
        else:
            logger.warning("non-finite gradients (inf/nan) in %s training (no loss scaling): step skipped",
                           self.dtype or "fp32/bf16")

    def state_dict(self) -> Dict[str, Any]:
        return {"scale": self._scale, "dynamic": False}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        # A static scale comes from the config, not from the checkpoint: nothing to restore.
        pass

    def __repr__(self) -> str:
        return f"StaticLossScaler(scale={self._scale:g}, dtype={self.dtype})"


class DynamicLossScaler:
    """DeepSpeed's dynamic loss scaling (ZeRO path), step for step.

    Per call to :meth:`update` (once per optimizer step):

    * overflow: if ``hysteresis == 1`` or the remaining hysteresis counter is 1, the scale is divided by
      ``scale_factor`` (floored at ``min_scale``) -- unless it is already at ``min_scale``, where a
      :class:`~shardspeed.errors.LossScaleError` is raised (or, with ``raise_error_at_min_scale=False``,
      the scale stays at the floor and the step is just skipped). Otherwise the counter is decremented.
      Either way this iteration is remembered as the last overflow.
    * no overflow: with ``consecutive_hysteresis`` the counter is refilled. If the number of iterations
      since the last overflow, minus one, is positive and a multiple of ``scale_window``, the scale is
      multiplied by ``scale_factor`` (and, without ``consecutive_hysteresis``, the counter is refilled).
    * the iteration counter always advances.

    So with the defaults a run of ``scale_window`` clean steps after an overflow is not enough: the
    scale first grows at the ``scale_window + 1``-th clean step, as in DeepSpeed.
    """

    dynamic = True

    def __init__(
        self,
        init_scale: float = 2.0**16,
        scale_window: int = 1000,
        min_scale: float = 1.0,
        hysteresis: int = 2,
        consecutive_hysteresis: bool = False,
        scale_factor: float = 2.0,
        raise_error_at_min_scale: bool = True,
    ) -> None:
        if not init_scale > 0:
            raise LossScaleError(f"initial loss scale must be > 0, got {init_scale}")
        if int(scale_window) < 1:
            raise LossScaleError(f"loss_scale_window must be >= 1, got {scale_window}")
        if int(hysteresis) < 1:
            raise LossScaleError(f"hysteresis must be >= 1, got {hysteresis}")
        if not min_scale > 0:
            raise LossScaleError(f"min_loss_scale must be > 0, got {min_scale}")
        if not scale_factor > 1:
            raise LossScaleError(f"scale_factor must be > 1, got {scale_factor}")
        self._scale = float(init_scale)
        self.scale_window = int(scale_window)
        self.min_scale = float(min_scale)
        self.hysteresis = int(hysteresis)
        self.consecutive_hysteresis = bool(consecutive_hysteresis)
        self.scale_factor = float(scale_factor)
        self.raise_error_at_min_scale = bool(raise_error_at_min_scale)
        self.cur_iter = 0
        self.last_overflow_iter = -1
        self.cur_hysteresis = self.hysteresis

    @property
    def scale(self) -> float:
        return self._scale

    loss_scale = scale
    cur_scale = scale

    def update(self, overflow: bool) -> None:
        if overflow:
            if self.hysteresis == 1 or self.cur_hysteresis == 1:
                if self._scale == self.min_scale:
                    if self.raise_error_at_min_scale:
                        raise LossScaleError(
                            f"fp16 gradients overflowed (inf/NaN) at the minimum loss scale {self._scale:g} "
                            f"(iteration {self.cur_iter}); the loss scale cannot go lower. The model is "
                            "diverging or its values exceed the fp16 range: lower the learning rate, check "
                            "the data and the loss for inf/NaN, or train in bf16 ('bf16': {'enabled': true}); "
                            "raising 'min_loss_scale' does not help. To skip such steps and go on instead, "
                            "build the scaler with raise_error_at_min_scale=False."
                        )
                    logger.warning(
                        "fp16 overflow at the minimum loss scale %g: step skipped, scale stays", self._scale
                    )
                else:
                    new_scale = max(self._scale / self.scale_factor, self.min_scale)
                    logger.info("fp16 overflow: step skipped, loss scale %g -> %g", self._scale, new_scale)
                    self._scale = new_scale
            else:
                logger.info(
                    "fp16 overflow: step skipped, loss scale stays %g (hysteresis %d -> %d)",
                    self._scale,
                    self.cur_hysteresis,
                    self.cur_hysteresis - 1,
                )
                self.cur_hysteresis -= 1
            self.last_overflow_iter = self.cur_iter
        else:
            if self.consecutive_hysteresis:
                self.cur_hysteresis = self.hysteresis
            stable = self.cur_iter - self.last_overflow_iter - 1
            if stable > 0 and stable % self.scale_window == 0:
                if not self.consecutive_hysteresis:
                    self.cur_hysteresis = self.hysteresis
                self._scale *= self.scale_factor
        self.cur_iter += 1

    def state_dict(self) -> Dict[str, Any]:
        """The evolving state (scale and counters); the settings come from the config on resume."""
        return {
            "dynamic": True,
            "scale": self._scale,
            "cur_iter": self.cur_iter,
            "last_overflow_iter": self.last_overflow_iter,
            "cur_hysteresis": self.cur_hysteresis,
        }

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        self._scale = float(state["scale"])
        self.cur_iter = int(state["cur_iter"])
        self.last_overflow_iter = int(state["last_overflow_iter"])
        self.cur_hysteresis = int(state["cur_hysteresis"])

    def __repr__(self) -> str:
        return (
            f"DynamicLossScaler(scale={self._scale:g}, scale_window={self.scale_window}, "
            f"min_scale={self.min_scale:g}, hysteresis={self.cur_hysteresis}/{self.hysteresis}, "
            f"consecutive_hysteresis={self.consecutive_hysteresis})"
        )


def build_loss_scaler(
    *,
    fp16_enabled: bool,
    loss_scale: float = 0.0,
    initial_scale_power: int = 16,
    loss_scale_window: int = 1000,
    hysteresis: int = 2,
    consecutive_hysteresis: bool = False,
    min_loss_scale: float = 1.0,
    raise_error_at_min_scale: bool = True,
    compute_dtype: Union[torch.dtype, str, None] = None,
):
    """The scaler for the ``fp16`` config block (defaults are DeepSpeed's).

    fp16 off (fp32 or bf16): ``StaticLossScaler(1.0, compute_dtype)`` (the dtype, if given, is named in the
    warning of a skipped step). ``loss_scale > 0``: that static scale. Otherwise a :class:`DynamicLossScaler`
    starting at ``2 ** initial_scale_power``.
    """
    if not fp16_enabled:
        return StaticLossScaler(1.0, dtype=compute_dtype)
    if loss_scale and loss_scale > 0:
        return StaticLossScaler(loss_scale, dtype="fp16")
    return DynamicLossScaler(
        init_scale=2.0 ** initial_scale_power,
        scale_window=loss_scale_window,
        min_scale=min_loss_scale,
        hysteresis=hysteresis,
        consecutive_hysteresis=consecutive_hysteresis,
        raise_error_at_min_scale=raise_error_at_min_scale,
    )
