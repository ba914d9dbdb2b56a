"""The host optimizer step: Adam/AdamW on flat fp32 tiles with torch's fused kernel.

Kernel choice (measured, see ``benchmarks/bench_cpu_adam.py`` and docs/offload.md): torch's fused CPU
AdamW kernel (``torch._fused_adamw_``, vectorised, multithreaded with ``at::parallel_for``) runs at the
speed of DeepSpeed's C++ AVX ``DeepSpeedCPUAdam`` on 10M-100M element tensors: both are memory-bound
(28 bytes moved per parameter: read p, g, m, v; write p, m, v). No hand-written C++ is needed; what
offload adds is *where* the kernel runs: on tiles of the flat master chunk, in a pipeline whose copies
(device↔host, disk↔host) overlap the step (:mod:`shardspeed.offload.master`).

:func:`adam_step` is the single entry point: the same math as ``torch.optim.AdamW(fused=True)`` /
``torch.optim.Adam(fused=True)`` (bit-identical on the same tensors), so an offloaded run matches the
run without offload. ``threads > 1`` splits a tile into chunks stepped from a thread pool (torch ops
release the GIL; the pool is the stepping object's: :class:`CPUAdam`'s, the offloaded masters') — measured
no faster than the kernel's own threading on this 2-core box, kept as an option for hosts where intra-op
threading is disabled.
"""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Iterable, List, Optional

import torch

from ..errors import ConfigError


@dataclass(frozen=True)
class AdamHyper:
    """Hyper-parameters of one param group, read from the engine's optimizer at each step (the LR
    schedule changes ``lr``)."""

    lr: float
    beta1: float
    beta2: float
    eps: float
    weight_decay: float
    decoupled: bool  # AdamW (True) or Adam with L2 weight decay (False)
    maximize: bool = False


def is_adam_family(optimizer: torch.optim.Optimizer) -> bool:
    """True when the host step can run this optimizer's math itself (Adam/AdamW without amsgrad)."""
    if not isinstance(optimizer, (torch.optim.Adam, torch.optim.AdamW, CPUAdam)):
        return False
    return not any(g.get("amsgrad", False) for g in optimizer.param_groups)


def hyper_of(optimizer: torch.optim.Optimizer, group: dict) -> AdamHyper:
    lr = group["lr"]
    b1, b2 = group["betas"]
    decoupled = isinstance(optimizer, torch.optim.AdamW) or bool(group.get("decoupled_weight_decay", False))
    if isinstance(optimizer, CPUAdam):
        decoupled = bool(group.get("adamw_mode", True))
    return AdamHyper(float(lr), float(b1), float(b2), float(group["eps"]), float(group["weight_decay"]),
                     decoupled, bool(group.get("maximize", False)))


#: elements of a 16-bit master stepped at a time against fp32 moments (two fp32 scratch tiles: 8 MiB)
MIXED_CHUNK = 1 << 20


def _kernel(params, grads, exp_avgs, exp_avg_sqs, steps, h: AdamHyper) -> None:
    if params[0].dtype != exp_avgs[0].dtype:
        _mixed_kernel(params[0], grads[0], exp_avgs[0], exp_avg_sqs[0], steps[0], h)
        return
    fn = torch._fused_adamw_ if h.decoupled else torch._fused_adam_
    fn(params, grads, exp_avgs, exp_avg_sqs, [], steps, lr=h.lr, beta1=h.beta1, beta2=h.beta2,
       weight_decay=h.weight_decay, eps=h.eps, amsgrad=False, maximize=h.maximize)


def _mixed_kernel(param: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor,
                  step: torch.Tensor, h: AdamHyper) -> None:
    """A 16-bit master (and gradient) with moments in another dtype (fp32), as DeepSpeedCPUAdam steps bf16
    masters with its default ``fp32_optimizer_states``: each element is read up to the moments' dtype, stepped
    there, and the master rounded once (to nearest even) on the way back. In chunks of :data:`MIXED_CHUNK`
    through two scratch tensors, so the step holds a bounded extra whatever the tile's size."""
    n = param.numel()
    width = min(n, MIXED_CHUNK)
    p_s = torch.empty(width, dtype=exp_avg.dtype, device=param.device)
    g_s = torch.empty(width, dtype=exp_avg.dtype, device=param.device)
    for a in range(0, n, width):
        b = min(a + width, n)
        p, g = p_s[: b - a], g_s[: b - a]
        p.copy_(param[a:b])
        g.copy_(grad[a:b])
        _kernel([p], [g], [exp_avg[a:b]], [exp_avg_sq[a:b]], [step], h)
        param[a:b].copy_(p)


def adam_step(param: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor,
              step: torch.Tensor, h: AdamHyper, threads: int = 1, pool: Optional[ThreadPoolExecutor] = None) -> None:
    """One Adam/AdamW update of a flat tile, in place: fp32; or a 16-bit master and gradient with moments of
    either dtype (16-bit moments: torch's kernel, computing in fp32; fp32 moments: :func:`_mixed_kernel`).
    ``step`` (a float32 scalar tensor on the tile's device) must already count this step (the caller increments it once per optimizer step).
    ``threads`` > 1 (tiles of 1M elements or more): that many chunks stepped on ``pool``, the stepping
    object's own (:func:`step_pool`; without one, a pool for this call)."""
    if threads <= 1 or param.numel() < 1 << 20:
        _kernel([param], [grad], [exp_avg], [exp_avg_sq], [step], h)
        return
    if pool is None:
        with ThreadPoolExecutor(threads, thread_name_prefix="shardspeed-adam") as own:
            adam_step(param, grad, exp_avg, exp_avg_sq, step, h, threads, own)
        return
    n = param.numel()
    bounds = [n * i // threads for i in range(threads + 1)]
    futs = [pool.submit(_kernel, [param[a:b]], [grad[a:b]], [exp_avg[a:b]], [exp_avg_sq[a:b]], [step], h)
            for a, b in zip(bounds[:-1], bounds[1:])]
    for f in futs:
        f.result()


def step_pool(threads: int) -> Optional[ThreadPoolExecutor]:
    """The pool an object stepping with ``threads`` > 1 owns (its threads start on first use; the owner shuts
    it down when it closes); None for ``threads`` <= 1."""
    return ThreadPoolExecutor(threads, thread_name_prefix="shardspeed-adam") if threads > 1 else None


class CPUAdam(torch.optim.Optimizer):
    """A drop-in for ``DeepSpeedCPUAdam``: Adam (``adamw_mode=False``) or AdamW over CPU tensors, with
    DeepSpeed's defaults (weight_decay 0). Steps every tensor with the fused kernel of :func:`adam_step`;
    needs no compiler."""

    def __init__(self, params: Iterable, lr: float = 1e-3, betas=(0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 0.0, adamw_mode: bool = True, threads: int = 1, bias_correction: bool = True,
                 amsgrad: bool = False):
        if not bias_correction:
            raise ConfigError("CPUAdam: bias_correction=False is not supported; remove it")
        if amsgrad:
            raise ConfigError("CPUAdam: amsgrad is not supported; use torch.optim.AdamW(amsgrad=True)")
        super().__init__(params, dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay,
                                      adamw_mode=adamw_mode))
        self.threads = threads
        self._pool = step_pool(threads)  # this optimizer's: stops with it

    @torch.no_grad()
    def step(self, closure=None):
        loss = closure() if closure is not None else None
        for group in self.param_groups:
            h = hyper_of(self, group)
            for p in group["params"]:
                if p.grad is None:
                    continue
                st = self.state[p]
                if not st:
                    st["step"] = torch.zeros((), dtype=torch.float32)
                    st["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                    st["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                st["step"] += 1
                adam_step(p.view(-1), p.grad.view(-1), st["exp_avg"].view(-1), st["exp_avg_sq"].view(-1),
                          st["step"], h, self.threads, self._pool)
        return loss


def kernel_names() -> List[str]:
    return ["torch._fused_adamw_", "torch._fused_adam_"]
