"""Mixture of experts: DeepSpeed's ``deepspeed.moe`` API (:mod:`.layer`, :mod:`.utils`) and AutoEP for
Hugging Face MoE models (:mod:`.autoep`); docs/moe.md."""
from .layer import MoE
from .utils import is_moe_param, split_params_into_different_moe_groups_for_optimizer

__all__ = ["MoE", "is_moe_param", "split_params_into_different_moe_groups_for_optimizer"]
