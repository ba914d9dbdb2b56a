"""Lion (Chen et al. 2023, "Symbolic Discovery of Optimization Algorithms")."""

from __future__ import annotations

from typing import Callable, Iterable, Optional, Tuple

import torch

from shardspeed.optim._grouping import group_by_device_dtype

__all__ = ["Lion"]


class Lion(torch.optim.Optimizer):
    """Lion: ``p -= lr * (sign(beta1*m + (1-beta1)*g) + weight_decay * p)``, then
    ``m = beta2*m + (1-beta2)*g``.

    Weight decay is decoupled (applied as ``p *= 1 - lr*weight_decay`` before the signed step).
    ``sign(0) = 0`` as in the paper (DeepSpeed's fused kernel moves a parameter by +lr when the
    interpolation is exactly 0; the difference only shows on exactly-zero interpolations).
    Defaults are the paper's (lr 1e-4, betas (0.9, 0.99)); :func:`shardspeed.optim.build_optimizer`
    fills DeepSpeed's defaults (lr 1e-3, betas (0.9, 0.999)) for ``"type": "Lion"`` configs.
    State per parameter: ``exp_avg`` (same shape and dtype as the parameter).
    Uses ``torch._foreach_*`` over each (device, dtype) bucket of a group.
    """

    def __init__(
        self,
        params: Iterable,
        lr: float = 1e-4,
        betas: Tuple[float, float] = (0.9, 0.99),
        weight_decay: float = 0.0,
    ) -> None:
        if not lr >= 0:
            raise ValueError(f"Lion: invalid lr {lr}")
        if not (0.0 <= betas[0] < 1.0 and 0.0 <= betas[1] < 1.0):
            raise ValueError(f"Lion: invalid betas {betas}")
        if not weight_decay >= 0:
            raise ValueError(f"Lion: invalid weight_decay {weight_decay}")
        super().__init__(params, dict(lr=lr, betas=tuple(betas), weight_decay=weight_decay))

    @torch.no_grad()
    def step(self, closure: Optional[Callable[[], float]] = None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            params, grads, avgs = [], [], []
            for p in group["params"]:
                if p.grad is None:
                    continue
                if p.grad.is_sparse:
                    raise RuntimeError("Lion does not support sparse gradients")
                state = self.state[p]
                if len(state) == 0:
                    state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                params.append(p)
                grads.append(p.grad)
                avgs.append(state["exp_avg"])
            if not params:
                continue
            lr = float(group["lr"])
            beta1, beta2 = group["betas"]
            wd = group["weight_decay"]
            for ps, gs, ms in group_by_device_dtype(params, grads, avgs):
                if wd != 0:
                    torch._foreach_mul_(ps, 1.0 - lr * wd)
                update = torch._foreach_lerp(ms, gs, 1.0 - beta1)  # beta1*m + (1-beta1)*g
                torch._foreach_sign_(update)
                torch._foreach_add_(ps, update, alpha=-lr)
                torch._foreach_lerp_(ms, gs, 1.0 - beta2)  # m = beta2*m + (1-beta2)*g
        return loss
