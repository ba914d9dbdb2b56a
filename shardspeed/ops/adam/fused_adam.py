"""``deepspeed.ops.adam.FusedAdam``: DeepSpeed's constructor and defaults (AdamW mode, weight_decay 0,
``set_grad_none``), stepped by torch's fused Adam/AdamW kernel (CPU and CUDA; nothing to compile)."""
from __future__ import annotations

import torch

from ...compat.alias import module_getattr
from .adam_math import adam_update, check_no_amsgrad, new_state, step_each


class FusedAdam(torch.optim.Optimizer):
    """Adam (``adam_w_mode=False``: L2 weight decay) or AdamW over parameters of any float dtype; the moments
    take the parameter's dtype, as in DeepSpeed's kernel. The group keys are DeepSpeed's (``lr``,
    ``bias_correction``, ``betas``, ``eps``, ``weight_decay``) plus ``adamw_mode``."""

    def __init__(self, params, lr: float = 1e-3, bias_correction: bool = True, betas=(0.9, 0.999), eps: float = 1e-8,
                 adam_w_mode: bool = True, weight_decay: float = 0.0, amsgrad: bool = False, set_grad_none: bool = True):
        check_no_amsgrad("FusedAdam", amsgrad)
        super().__init__(params, dict(lr=lr, bias_correction=bias_correction, betas=tuple(betas), eps=eps,
                                      weight_decay=weight_decay, adamw_mode=bool(adam_w_mode)))
        self.adam_w_mode = 1 if adam_w_mode else 0
        self.set_grad_none = set_grad_none

    def zero_grad(self, set_to_none: bool = True) -> None:
        super().zero_grad(set_to_none=self.set_grad_none)

    def step(self, closure=None):
        return step_each(self, closure, self._update)

    def _update(self, p: torch.Tensor, group: dict) -> None:
        if p.grad is not None and p.grad.is_sparse:
            raise RuntimeError("FusedAdam does not support sparse gradients, please consider SparseAdam instead")
        state = self.state[p]
        if not state:
            state.update(new_state(p, fp32_states=False))
        adam_update(p, state, group, adamw=bool(group.get("adamw_mode", self.adam_w_mode)))


__getattr__ = module_getattr(__name__)
