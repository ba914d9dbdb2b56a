"""A tiny mixture-of-experts network for the MoE tests, and its one-process reference without any library.

``MoENet(moe_cls, ...)`` is in -> MoE -> out, built on DeepSpeed's ``MoE`` or shardspeed's (same
constructor). ``RefMoENet`` computes the same function in plain torch: the same gating math, written out
here (top-1 with random token selection or not, top-2 with or without second-expert sampling, capacity
and dropping), applied to each rank's tokens separately (each rank gates its own tokens), every expert
a plain MLP.
"""
from __future__ import annotations

import math
from typing import Dict, List, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.utils.checkpoint

D, HID = 8, 16


def expert_mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(D, HID), nn.GELU(), nn.Linear(HID, D))


class MoENet(nn.Module):
    def __init__(self, moe_cls, num_experts: int, ep_size: int, aux: float = 0.01, checkpoint: bool = False,
                 **moe_kwargs):
        super().__init__()
        self.checkpoint = checkpoint  # the MoE layer under torch's (non-reentrant) activation checkpointing
        self.fc_in = nn.Linear(D, D)
        self.moe = moe_cls(D, expert_mlp(), num_experts=num_experts, ep_size=ep_size, **moe_kwargs)
        self.fc_out = nn.Linear(D, D)
        self.aux = aux

    def forward(self, x, y):
        h = torch.tanh(self.fc_in(x))
        if self.checkpoint:
            h, l_aux, _ = torch.utils.checkpoint.checkpoint(self.moe, h, use_reentrant=False)
        else:
            h, l_aux, _ = self.moe(h)
        return F.mse_loss(self.fc_out(h).float(), y.float()) + self.aux * l_aux


def expert_weights(num_experts: int, seed: int = 7) -> List[Dict[str, torch.Tensor]]:
    """Distinct initial weights per global expert (``0.weight``, ``0.bias``, ``2.weight``, ``2.bias``)."""
    g = torch.Generator().manual_seed(seed)
    return [{"0.weight": torch.randn(HID, D, generator=g) * 0.3, "0.bias": torch.randn(HID, generator=g) * 0.1,
             "2.weight": torch.randn(D, HID, generator=g) * 0.3, "2.bias": torch.randn(D, generator=g) * 0.1}
            for _ in range(num_experts)]


@torch.no_grad()
def load_experts(net: MoENet, weights: List[Dict[str, torch.Tensor]], ep_rank: int) -> None:
    """Set the rank's local experts (global ids ep_rank × local ...) of a DeepSpeed or shardspeed MoENet."""
    experts = net.moe.deepspeed_moe.experts
    nl = net.moe.num_local_experts
    local = weights[ep_rank * nl:(ep_rank + 1) * nl]
    if isinstance(experts.deepspeed_experts, nn.ModuleList):  # DeepSpeed: one module per expert
        for mod, w in zip(experts.deepspeed_experts, local):
            for name, t in w.items():
                mod.get_parameter(name).copy_(t)
        return
    for name in local[0]:  # shardspeed: stacked [num_local, ...]
        experts.deepspeed_experts.get_parameter(name).copy_(torch.stack([w[name] for w in local]))


def _gumbel(shape):
    return torch.distributions.gumbel.Gumbel(torch.tensor(0.0), torch.tensor(1.0)).rsample(shape)


def ref_routes(logits: torch.Tensor, k: int, cf: float, min_cap: int, drop: bool, rts: bool, sample2: bool):
    """[(token, expert, weight)] kept for one rank's tokens, and l_aux (DeepSpeed's gating, written plainly)."""
    s, e = logits.shape
    gates = F.softmax(logits, dim=1)
    first = gates.argmax(1)
    m1 = F.one_hot(first, e)
    if k == 1:
        cap = max(math.ceil(float(torch.tensor(s / e, dtype=torch.float32) * torch.tensor(cf))), min_cap)
        cap = cap if drop else s
        l_aux = (gates.mean(0) * m1.float().mean(0)).sum() * e
        score = m1 * torch.rand(m1.shape) if rts else m1
        keep = torch.zeros_like(m1).scatter_(0, torch.topk(score, k=min(cap, s), dim=0)[1], 1) * m1
        return [(t, int(first[t]), gates[t, first[t]]) for t in range(s) if keep[t].any()], l_aux
    if sample2:
        logits = logits + _gumbel(logits.shape)
    second = logits.masked_fill(m1.bool(), float("-inf")).argmax(1)
    m2 = F.one_hot(second, e)
    loc1 = torch.cumsum(m1, 0) - 1
    loc2 = torch.cumsum(m2, 0) - 1 + m1.sum(0, keepdim=True)
    l_aux = (gates.mean(0) * m1.float().mean(0)).mean() * e * e
    cap = max(math.ceil(float(torch.tensor(s / e, dtype=torch.float32) * torch.tensor(cf * 2))), min_cap)
    out = []
    for t in range(s):
        kept1 = not drop or bool(loc1[t, first[t]] < cap)
        kept2 = not drop or bool(loc2[t, second[t]] < cap)
        g1 = gates[t, first[t]] if kept1 else gates.new_zeros(())
        g2 = gates[t, second[t]] if kept2 else gates.new_zeros(())
        denom = torch.clamp(g1 + g2, min=torch.finfo(g1.dtype).eps)
        if kept1:
            out.append((t, int(first[t]), g1 / denom))
        if kept2:
            out.append((t, int(second[t]), g2 / denom))
    return out, l_aux


class RefMoENet(nn.Module):
    """One process: the same function as MoENet on ``ranks`` chunks of the batch, each gated alone."""

    def __init__(self, net_state: Dict[str, torch.Tensor], experts: List[Dict[str, torch.Tensor]], k: int = 1,
                 capacity_factor: float = 1.0, min_capacity: int = 4, drop_tokens: bool = True,
                 use_rts: bool = True, top2_2nd_expert_sampling: bool = True, aux: float = 0.01):
        super().__init__()
        self.fc_in, self.fc_out = nn.Linear(D, D), nn.Linear(D, D)
        self.wg = nn.Linear(D, len(experts), bias=False)
        self.experts = nn.ModuleList()
        for w in experts:
            m = expert_mlp()
            m.load_state_dict(w)
            self.experts.append(m)
        with torch.no_grad():
            for name in ("fc_in.weight", "fc_in.bias", "fc_out.weight", "fc_out.bias"):
                self.get_parameter(name).copy_(net_state[name])
            self.wg.weight.copy_(net_state["moe.deepspeed_moe.gate.wg.weight"])
        self.opts = (k, capacity_factor, min_capacity, drop_tokens, use_rts, top2_2nd_expert_sampling)
        self.aux = aux

    def chunk_loss(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.fc_in(x))
        tokens = h.reshape(-1, D)
        k, cf, min_cap, drop, rts, sample2 = self.opts
        routes, l_aux = ref_routes(F.linear(tokens.float(), self.wg.weight), k, cf, min_cap, drop, rts, sample2)
        rows: List[Optional[torch.Tensor]] = [None] * tokens.shape[0]
        for t, e, w in routes:
            contrib = self.experts[e](tokens[t]) * w
            rows[t] = contrib if rows[t] is None else rows[t] + contrib
        out = torch.stack([r if r is not None else tokens.new_zeros(D) for r in rows]).reshape(h.shape)
        return F.mse_loss(self.fc_out(out), y) + self.aux * l_aux

    def step_loss(self, xs: List[torch.Tensor], ys: List[torch.Tensor]) -> torch.Tensor:
        """Mean of the ranks' losses; each chunk's random draws start from the same RNG state (as every rank's)."""
        state = torch.get_rng_state()
        losses = []
        for x, y in zip(xs, ys):
            torch.set_rng_state(state)
            losses.append(self.chunk_loss(x, y))
        return torch.stack(losses).mean()
