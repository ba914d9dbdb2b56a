"""``deepspeed.ops.adam.DeepSpeedCPUAdam``: DeepSpeed's constructor and defaults (``adamw_mode=True``,
weight_decay 0, fp32 moments for low-precision parameters), stepped by torch's fused CPU Adam/AdamW kernel,
which needs no compiler and runs at the speed of DeepSpeed's AVX op (see shardspeed/offload/cpu_adam.py)."""
from __future__ import annotations

import torch

from ...compat.alias import module_getattr
from .adam_math import adam_update, check_no_amsgrad, check_on_cpu, new_state, step_each


class DeepSpeedCPUAdam(torch.optim.Optimizer):
    """Adam/AdamW over CPU parameters. Group keys as DeepSpeed's (``lr``, ``betas``, ``eps``,
    ``weight_decay``, ``bias_correction``, ``amsgrad``) plus ``adamw_mode``; state ``step`` (int),
    ``exp_avg``, ``exp_avg_sq`` (fp32 unless ``fp32_optimizer_states=False``)."""

    optimizer_id = 0

    def __init__(self, model_params, lr: float = 1e-3, bias_correction: bool = True, betas=(0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 0, amsgrad: bool = False, adamw_mode: bool = True,
                 fp32_optimizer_states: bool = True):
        check_no_amsgrad("DeepSpeedCPUAdam", amsgrad)
        super().__init__(model_params, dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay,
                                            bias_correction=bias_correction, amsgrad=amsgrad, adamw_mode=adamw_mode))
        self.opt_id = DeepSpeedCPUAdam.optimizer_id
        DeepSpeedCPUAdam.optimizer_id += 1
        self.adam_w_mode = adamw_mode
        self.fp32_optimizer_states = fp32_optimizer_states

    def add_param_group(self, param_group: dict) -> None:
        check_no_amsgrad("DeepSpeedCPUAdam", bool(param_group.get("amsgrad", self.defaults.get("amsgrad", False))))
        super().add_param_group(param_group)

    def step(self, closure=None):
        return step_each(self, closure, self._update)

    def _update(self, p: torch.Tensor, group: dict) -> None:
        check_on_cpu("DeepSpeedCPUAdam", p, "FusedAdam")
        state = self.state[p]
        if not state:
            state.update(new_state(p, self.fp32_optimizer_states))
        adam_update(p, state, group, adamw=bool(group.get("adamw_mode", self.adam_w_mode)))


__getattr__ = module_getattr(__name__)
