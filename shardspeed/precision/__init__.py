"""Mixed-precision helpers: loss scalers and overflow detection."""

from shardspeed.precision.loss_scaler import DynamicLossScaler, StaticLossScaler, build_loss_scaler
from shardspeed.precision.overflow import has_inf_or_nan

__all__ = ["StaticLossScaler", "DynamicLossScaler", "build_loss_scaler", "has_inf_or_nan"]
