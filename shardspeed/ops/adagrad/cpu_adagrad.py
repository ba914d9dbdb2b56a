"""``deepspeed.ops.adagrad.DeepSpeedCPUAdagrad``: DeepSpeed's constructor and defaults (lr 1e-2, eps 1e-10),
its update (L2 weight decay on the gradient, ``v += g*g``, ``p -= lr * g / (sqrt(v) + eps)``: torch's Adagrad
without lr decay) and its state (``step``, ``exp_avg_sq``), on torch tensor ops over CPU parameters."""
from __future__ import annotations

import torch

from ...compat.alias import module_getattr
from ...errors import ConfigError
from ..adam.adam_math import check_on_cpu, step_each


class DeepSpeedCPUAdagrad(torch.optim.Optimizer):
    optimizer_id = 0

    def __init__(self, model_params, lr: float = 1e-2, eps: float = 1e-10, weight_decay: float = 0,
                 amsgrad: bool = False, fp32_optimizer_states: bool = True):
        super().__init__(model_params, dict(lr=lr, eps=eps, weight_decay=weight_decay, amsgrad=amsgrad))
        self.opt_id = DeepSpeedCPUAdagrad.optimizer_id
        DeepSpeedCPUAdagrad.optimizer_id += 1
        self.fp32_optimizer_states = fp32_optimizer_states

    def step(self, closure=None):
        return step_each(self, closure, self._update)

    def _update(self, p: torch.Tensor, group: dict) -> None:
        check_on_cpu("DeepSpeedCPUAdagrad", p, "torch.optim.Adagrad")
        assert p.grad is not None  # step_each skips parameters without a gradient
        if p.grad.is_sparse:
            raise ConfigError("DeepSpeedCPUAdagrad: sparse gradients are not supported here; use torch.optim.Adagrad")
        state = self.state[p]
        if not state:
            dtype = torch.float32 if self.fp32_optimizer_states else p.dtype
            state.update(step=0, exp_avg_sq=torch.zeros_like(p, dtype=dtype))
        state["step"] += 1
        v = state["exp_avg_sq"]
        work, g = p.detach().to(v.dtype), p.grad.detach().to(v.dtype)
        if group["weight_decay"] > 0:
            g = g.add(work, alpha=group["weight_decay"])
        v.addcmul_(g, g)
        work.addcdiv_(g, v.sqrt().add_(group["eps"]), value=-group["lr"])
        if work.data_ptr() != p.data_ptr():
            p.detach().copy_(work)


__getattr__ = module_getattr(__name__)
