"""The memory estimator's public names under their first module's name: a re-export of :mod:`shardspeed.estimate`.

``estimate_model_state_memory`` / ``ModelStateMemory`` (the ZeRO paper's model-state arithmetic, DeepSpeed's
``estimate_zero*_model_states_mem_needs`` counterpart) and the per-rank peak estimator (``estimate_peak``,
``describe``, ``describe_module``, ``ModelSpec``, ``PeakEstimate``, ``ActivationProfile``) live in
:mod:`shardspeed.estimate`; importing them from here keeps working.
"""
from __future__ import annotations

from .estimate import (
    ActivationProfile,
    ModelSpec,
    ModelStateMemory,
    PeakEstimate,
    describe,
    describe_module,
    estimate_model_state_memory,
    estimate_peak,
)

__all__ = ["ActivationProfile", "ModelSpec", "ModelStateMemory", "PeakEstimate", "describe", "describe_module",
           "estimate_model_state_memory", "estimate_peak"]
