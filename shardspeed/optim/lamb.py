"""LAMB (You et al. 2019) with DeepSpeed / NVIDIA FusedLamb semantics."""

from __future__ import annotations

import math
from typing import Callable, Iterable, List, Optional, Tuple

import torch

from shardspeed.optim._grouping import group_by_device_dtype

__all__ = ["Lamb"]


class Lamb(torch.optim.Optimizer):
    """Layer-wise adaptive Adam, step for step as DeepSpeed's ``FusedLamb``.

    Per parameter tensor (a "layer"), at step ``t``::

        m = beta1*m + (1-beta1)*g
        v = beta2*v + (1-beta2)*g*g
        u = m / (sqrt(v) + eps) + weight_decay * p        # eps_inside_sqrt: m / sqrt(v + eps)
        ratio = clamp(||p|| / ||u||, min_coeff, max_coeff)  # 1 if either norm is 0
        step_size = lr * sqrt(1 - beta2**t) / (1 - beta1**t)  # = lr without bias_correction
        p -= step_size * ratio * u

    As in DeepSpeed the bias correction is folded into the step size, so the trust ratio is computed
    on the uncorrected update. Norms and trust ratios stay on the device (``torch._foreach_norm``);
    :meth:`get_lamb_coeffs` reads the last ratios back (a host sync). State per parameter:
    ``step`` (0-dim CPU float tensor), ``exp_avg``, ``exp_avg_sq``.
    """

    def __init__(
        self,
        params: Iterable,
        lr: float = 1e-3,
        bias_correction: bool = True,
        betas: Tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        eps_inside_sqrt: bool = False,
        weight_decay: float = 0.0,
        max_coeff: float = 10.0,
        min_coeff: float = 0.01,
    ) -> None:
        if not lr >= 0:
            raise ValueError(f"Lamb: invalid lr {lr}")
        if not (0.0 <= betas[0] < 1.0 and 0.0 <= betas[1] < 1.0):
            raise ValueError(f"Lamb: invalid betas {betas}")
        if not eps >= 0:
            raise ValueError(f"Lamb: invalid eps {eps}")
        if not 0 <= min_coeff <= max_coeff:
            raise ValueError(f"Lamb: need 0 <= min_coeff <= max_coeff, got {min_coeff}, {max_coeff}")
        defaults = dict(
            lr=lr,
            bias_correction=bias_correction,
            betas=tuple(betas),
            eps=eps,
            eps_inside_sqrt=eps_inside_sqrt,
            weight_decay=weight_decay,
            max_coeff=max_coeff,
            min_coeff=min_coeff,
        )
        super().__init__(params, defaults)
        self._last_coeffs: List[torch.Tensor] = []

    @torch.no_grad()
    def step(self, closure: Optional[Callable[[], float]] = None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._last_coeffs = []
        for group in self.param_groups:
            # Parameters of one group can be at different step counts (a parameter that had no grad on
            # some steps), so bucket by step count as well as by device and dtype.
            by_step: dict = {}
            for p in group["params"]:
                if p.grad is None:
                    continue
                if p.grad.is_sparse:
                    raise RuntimeError("Lamb does not support sparse gradients")
                state = self.state[p]
                if len(state) == 0:
                    state["step"] = torch.tensor(0.0)
                    state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                    state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["step"] += 1
                lists = by_step.setdefault(int(state["step"].item()), ([], [], [], []))
                lists[0].append(p)
                lists[1].append(p.grad)
                lists[2].append(state["exp_avg"])
                lists[3].append(state["exp_avg_sq"])
            beta1, beta2 = group["betas"]
            lr, eps, wd = float(group["lr"]), group["eps"], group["weight_decay"]
            for t, lists in by_step.items():
                if group["bias_correction"]:
                    step_size = lr * math.sqrt(1 - beta2**t) / (1 - beta1**t)
                else:
                    step_size = lr
                for ps, gs, ms, vs in group_by_device_dtype(*lists):
                    self._update(ps, gs, ms, vs, beta1, beta2, eps, group["eps_inside_sqrt"], wd,
                                 group["min_coeff"], group["max_coeff"], step_size)
        return loss

    def _update(self, ps, gs, ms, vs, beta1, beta2, eps, eps_inside_sqrt, wd, min_coeff, max_coeff, step_size):
        torch._foreach_lerp_(ms, gs, 1.0 - beta1)
        torch._foreach_mul_(vs, beta2)
        torch._foreach_addcmul_(vs, gs, gs, value=1.0 - beta2)
        if eps_inside_sqrt:
            denom = torch._foreach_add(vs, eps)
            torch._foreach_sqrt_(denom)
        else:
            denom = torch._foreach_sqrt(vs)
            torch._foreach_add_(denom, eps)
        update = torch._foreach_div(ms, denom)
        del denom
        if wd != 0:
            torch._foreach_add_(update, ps, alpha=wd)
        w_norms = torch._foreach_norm(ps)
        u_norms = torch._foreach_norm(update)
        w = torch.stack(w_norms)
        u = torch.stack(u_norms)
        ratio = torch.where((w != 0) & (u != 0), (w / u).clamp(min_coeff, max_coeff), torch.ones_like(w))
        self._last_coeffs.append(ratio)
        # One scale per tensor: multiply each update by its own 0-dim ratio times -step_size.
        scales = (ratio * -step_size).to(ps[0].dtype).unbind(0)
        torch._foreach_mul_(update, scales)
        torch._foreach_add_(ps, update)

    def get_lamb_coeffs(self) -> List[float]:
        """Trust ratios of the last step, one per updated tensor (host sync)."""
        return [c for r in self._last_coeffs for c in r.tolist()]
