"""The model and data of tests/precision_ds_worker.py (imported by the worker under torchrun and by
tests/test_precision_modes.py), and the one-process plain-torch reference of fp16 master weights offloaded
(``fp16.fp16_master_weights_and_grads`` with ``offload_optimizer``), which DeepSpeed 0.19.8 cannot run on its
CPU accelerator ("Type fp16 is not supported on your device.").

The reference is DeepSpeed's meaning written out in torch: an fp16 model; each rank's micro-batch loss scaled by
the loss scale and divided by the accumulation steps; the fp16 gradients summed over the ranks in fp16 (as gloo's
reduction does: it overflows where the sum exceeds fp16's range), then divided by the world size (DeepSpeed's
default ``postscale_gradients``), accumulated in fp16 over the micro-batches (ZeRO 2-3 reduce every micro-batch,
ZeRO 1 each rank's accumulated gradient once); their global norm, the step skipped when it is not finite (and a dynamic scale updated by DeepSpeed's ``DynamicLossScaler.update_scale``); else the
gradient unscaled and clipped in fp32 and rounded to fp16 (DeepSpeed multiplies its fp16 gradient partition in
place), and Adam(W) stepped in fp32 from the fp16 master with fp32 moments (``DeepSpeedCPUAdam``'s default
``fp32_optimizer_states``), the master rounded to fp16 once."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import List, Tuple

import torch


def model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.LayerNorm(64), torch.nn.GELU(),
                               torch.nn.Linear(64, 64), torch.nn.GELU(), torch.nn.Linear(64, 8))


def batch(gen: torch.Generator) -> Tuple[torch.Tensor, torch.Tensor]:
    """One rank's micro-batch of 4 (``gen``: the rank's own, seeded ``100 + rank``)."""
    x = torch.randn(4, 16, generator=gen)
    return x, torch.sin(x[:, :8] * 2)


@dataclass
class DynamicScale:
    """DeepSpeed 0.19.8's ``DynamicLossScaler.update_scale`` (runtime/fp16/loss_scaler.py), restated: on overflow
    the scale halves once the hysteresis is spent (else the hysteresis drops by one); it doubles after
    ``window`` clean steps since the last overflow, refilling the hysteresis."""

    scale: float
    window: int
    hysteresis: int = 2
    min_scale: float = 1.0
    _left: int = field(init=False)
    _it: int = field(default=0, init=False)
    _last: int = field(default=-1, init=False)

    def __post_init__(self) -> None:
        self._left = self.hysteresis

    def update(self, overflow: bool) -> None:
        if overflow:
            if self.hysteresis == 1 or self._left == 1:
                self.scale = max(self.scale / 2, self.min_scale)
            else:
                self._left -= 1
            self._last = self._it
        elif (self._it - self._last - 1) > 0 and (self._it - self._last - 1) % self.window == 0:
            self._left = self.hysteresis  # refilled when the scale grows
            self.scale *= 2
        self._it += 1


def _clip_coef(norm: float, clip: float) -> float:
    """DeepSpeed ZeRO 1-3's clip factor, in fp32: the reciprocal of max((norm + 1e-6) / clip, 1)."""
    shifted = torch.tensor(norm, dtype=torch.float32) + 1e-6
    return float(1.0 / torch.clamp(shifted / clip, min=1.0))


@dataclass
class Fp16Run:
    losses: List[float]  # per step: the last micro-batch's loss averaged over the ranks (as the worker reports)
    scales: List[float]  # per step: the loss scale the step ran with
    skipped: List[bool]
    params: List[float]  # the fp16 parameters at the end, flattened in the model's order


def _summed(per_rank: List[List[torch.Tensor]]) -> List[torch.Tensor]:
    """The fp16 sum over the ranks (each addition rounded to fp16)."""
    out = []
    for grads in zip(*per_rank):
        acc = grads[0].clone()
        for g in grads[1:]:
            acc = (acc.float() + g.float()).half()
        out.append(acc)
    return out


def _accumulate(acc: List[torch.Tensor], grads: List[torch.Tensor], alpha: float = 1.0) -> List[torch.Tensor]:
    """``acc + alpha * grads`` rounded once to fp16 (``torch.add(alpha=)`` on fp16); ``acc`` empty: zeros."""
    acc = acc or [torch.zeros_like(g) for g in grads]
    return [(a.float() + g.float() * alpha).half() for a, g in zip(acc, grads)]


def fp16_masters_reference(steps: int, accum: int, world: int, lr: float, weight_decay: float, clip: float,
                           scale: DynamicScale, reduce_every_micro_step: bool) -> Fp16Run:
    """``steps`` optimizer steps of :func:`model` in fp16 over ``world`` ranks' data, ``accum`` micro-batches of
    4 each, AdamW(``lr``, ``weight_decay``), clipping at ``clip``; ``scale``: a :class:`DynamicScale` (a static
    scale is one whose window is never reached); ``reduce_every_micro_step``: ZeRO 2-3 (else ZeRO 1)."""
    net = model().half()
    params = list(net.parameters())
    work = [torch.zeros_like(p, dtype=torch.float32, requires_grad=True) for p in params]
    opt = torch.optim.AdamW(work, lr=lr, weight_decay=weight_decay, fused=True)  # fp32 moments
    gens = [torch.Generator().manual_seed(100 + r) for r in range(world)]
    out = Fp16Run([], [], [], [])
    for _ in range(steps):
        grads: List[torch.Tensor] = []  # the reduced fp16 gradients
        ranks: List[List[torch.Tensor]] = [[] for _ in range(world)]  # ZeRO 1: each rank's, accumulated
        last = []
        for _ in range(accum):
            micro = []
            for r, gen in enumerate(gens):
                x, y = batch(gen)
                loss = (net(x.half()).float() - y).pow(2).mean()
                net.zero_grad(set_to_none=True)
                (loss * (scale.scale / accum)).backward()
                micro.append([p.grad.clone() for p in params])
                ranks[r] = _accumulate(ranks[r], micro[-1])
                last.append(loss.detach())
            if reduce_every_micro_step:
                grads = _accumulate(grads, _summed(micro), 1.0 / world)
        if not reduce_every_micro_step:
            grads = [g / world for g in _summed(ranks)]
        sq = torch.zeros((), dtype=torch.float32)
        for g in grads:
            sq += torch.dot(g.float().view(-1), g.float().view(-1))
        norm = float(sq.sqrt()) / scale.scale
        out.losses.append(float(sum(last[-world:])) / world)  # summed in fp32, as the worker's all-reduce
        out.scales.append(scale.scale)
        overflow = not torch.isfinite(torch.tensor(norm))
        out.skipped.append(bool(overflow))
        scale.update(bool(overflow))
        if overflow:
            continue
        coef = 1.0 / out.scales[-1] * (_clip_coef(norm, clip) if clip > 0 else 1.0)
        with torch.no_grad():
            for p, w, g in zip(params, work, grads):
                w.copy_(p.float())  # the fp16 master, read up to fp32
                w.grad = (g.float() * coef).half().float()  # unscaled and clipped in fp32, an fp16 gradient
            opt.step()
            for p, w in zip(params, work):
                p.copy_(w.half())  # rounded once
    out.params = [float(v) for p in params for v in p.detach().reshape(-1)]
    return out
