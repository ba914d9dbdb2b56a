"""``deepspeed.ops.lion.DeepSpeedCPULion`` and ``FusedLion``: shardspeed's :class:`~shardspeed.optim.lion.Lion`
(torch ``_foreach`` ops, CPU and CUDA) with DeepSpeed's constructors and defaults (lr 1e-3, betas
(0.9, 0.999), weight_decay 0). The one difference is Lion's own: where the interpolation is exactly 0,
shardspeed leaves the parameter (sign 0) and DeepSpeed's kernel moves it by lr."""
from __future__ import annotations

from ...compat.alias import module_getattr
from ...optim.lion import Lion
from ..adam.adam_math import check_on_cpu


class DeepSpeedCPULion(Lion):
    optimizer_id = 0

    def __init__(self, model_params, lr: float = 1e-3, betas=(0.9, 0.999), weight_decay: float = 0,
                 fp32_optimizer_states: bool = True):
        super().__init__(model_params, lr=lr, betas=tuple(betas), weight_decay=weight_decay)
        self.opt_id = DeepSpeedCPULion.optimizer_id
        DeepSpeedCPULion.optimizer_id += 1
        self.fp32_optimizer_states = fp32_optimizer_states

    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    check_on_cpu("DeepSpeedCPULion", p, "FusedLion")
        return super().step(closure)


class FusedLion(Lion):
    def __init__(self, params, lr: float = 1e-3, betas=(0.9, 0.999), weight_decay: float = 0.0,
                 set_grad_none: bool = True):
        super().__init__(params, lr=lr, betas=tuple(betas), weight_decay=weight_decay)
        self.set_grad_none = set_grad_none

    def zero_grad(self, set_to_none: bool = True) -> None:
        super().zero_grad(set_to_none=self.set_grad_none)


__getattr__ = module_getattr(__name__)
