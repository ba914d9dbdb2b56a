"""The Adam/AdamW update behind ``FusedAdam`` and ``DeepSpeedCPUAdam``: torch's fused kernels.

DeepSpeed's two classes differ in constructor and state layout, not in math: both keep ``exp_avg`` /
``exp_avg_sq`` and an integer ``step`` per parameter, and step with decoupled weight decay (AdamW) unless
told otherwise. Here each parameter is stepped by ``torch._fused_adamw_`` / ``torch._fused_adam_`` (CPU and
CUDA), in fp32 when the states are fp32 and the parameter is not. ``bias_correction=False`` (torch's kernels
always correct) runs the same update, uncorrected, with plain tensor ops.
"""
from __future__ import annotations

from typing import Any, Callable, Dict, Optional

import torch

from ...errors import ConfigError


def step_each(optimizer: torch.optim.Optimizer, closure: Optional[Callable[[], Any]],
              update: Callable[[torch.Tensor, Dict[str, Any]], None]) -> Any:
    """``optimizer.step(closure)`` of DeepSpeed's ops: the closure's loss (under grad), then ``update(p, group)``
    for every parameter that has a gradient."""
    loss = None
    if closure is not None:
        with torch.enable_grad():
            loss = closure()
    with torch.no_grad():
        for group in optimizer.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    update(p, group)
    return loss


def check_on_cpu(cls_name: str, p: torch.Tensor, instead: str) -> None:
    if p.device.type != "cpu":
        raise ConfigError(f"{cls_name}: a parameter is on {p.device} and must be on the CPU; "
                          f"enable 'offload_optimizer': {{'device': 'cpu'}} or use {instead}")


def check_no_amsgrad(cls_name: str, amsgrad: bool) -> None:
    if amsgrad:
        raise ConfigError(f"{cls_name} does not support the AMSGrad variant; use torch.optim.AdamW(amsgrad=True)")


def new_state(p: torch.Tensor, fp32_states: bool) -> Dict[str, Any]:
    dtype = torch.float32 if fp32_states else p.dtype
    return {"step": 0, "exp_avg": torch.zeros_like(p, dtype=dtype), "exp_avg_sq": torch.zeros_like(p, dtype=dtype)}


def _uncorrected(p, g, m, v, lr: float, b1: float, b2: float, eps: float, wd: float, adamw: bool) -> None:
    if wd and adamw:
        p.mul_(1 - lr * wd)
    elif wd:
        g = g.add(p, alpha=wd)
    m.mul_(b1).add_(g, alpha=1 - b1)
    v.mul_(b2).addcmul_(g, g, value=1 - b2)
    p.addcdiv_(m, v.sqrt().add_(eps), value=-lr)


def adam_update(p: torch.Tensor, state: Dict[str, Any], group: Dict[str, Any], adamw: bool) -> None:
    """One Adam (``adamw`` False: L2 weight decay added to the gradient) or AdamW update of ``p`` in place,
    from ``p.grad``; ``state["step"]`` (an int, as DeepSpeed keeps it) is incremented first."""
    assert p.grad is not None  # the callers skip parameters without a gradient
    state["step"] += 1
    m, v = state["exp_avg"], state["exp_avg_sq"]
    work = p.detach() if p.dtype == m.dtype else p.detach().to(m.dtype)
    g = p.grad.detach() if p.grad.dtype == m.dtype else p.grad.detach().to(m.dtype)
    b1, b2 = group["betas"]
    lr, eps, wd = float(group["lr"]), float(group["eps"]), float(group["weight_decay"])
    if group.get("bias_correction", True):
        step = torch.tensor(float(state["step"]), dtype=torch.float32, device=work.device)
        fn = torch._fused_adamw_ if adamw else torch._fused_adam_
        fn([work], [g], [m], [v], [], [step], lr=lr, beta1=float(b1), beta2=float(b2), weight_decay=wd, eps=eps,
           amsgrad=False, maximize=False)
    else:
        _uncorrected(work, g, m, v, lr, float(b1), float(b2), eps, wd, adamw)
    if work is not p.detach():
        p.detach().copy_(work)
