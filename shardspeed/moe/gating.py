"""Top-1, top-2 and top-k gating with capacity, token dropping and the auxiliary load-balancing loss.

The math and the use of torch's random number generator are DeepSpeed's (``deepspeed/moe/sharded_moe.py``,
itself GShard's Algorithm 1 by way of fairscale), so the same script with the same seed routes the same
tokens and computes the same ``l_aux``: random token selection (``use_rts``) draws one uniform number per
(token, expert) with ``torch.rand``'s stream, ``noisy_gate_policy`` "RSample" and top-2's second-expert
sampling draw Gumbel noise of the logits' shape, "Jitter" multiplies the input by a uniform in
[1 - 0.01, 1 + 0.01].

Every gate returns :class:`Routes`: per route (k rows) and token (s columns) the expert (-1: dropped over
capacity), the slot in that expert's capacity buffer and the combine weight, which the layer turns into one
gather (dispatch) and one weighted gather (combine) instead of the dense ``[s, e, c]`` one-hot tensors.
Capacity is computed from this rank's tokens; without dropping it is the largest expert count over the
expert-parallel group (one all-reduce of one integer, a host sync point).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor


@dataclass
class Routes:
    """The gate's decisions for ``s`` tokens: ``experts``, ``slots`` (int64) and ``weights`` (fp32) are
    ``[k, s]``; ``capacity`` slots per expert; ``l_aux`` the auxiliary loss; ``exp_counts`` tokens routed per
    expert before dropping."""

    l_aux: Tensor
    capacity: int
    num_experts: int
    experts: Tensor
    slots: Tensor
    weights: Tensor
    exp_counts: Tensor


def capacity_of(num_tokens: int, num_experts: int, capacity_factor: float, min_capacity: int) -> int:
    """``max(ceil(tokens / experts × capacity_factor), min_capacity)``, computed as DeepSpeed does (a float32
    product), so that the same inputs give the same integer."""
    cap = torch.ceil((num_tokens / num_experts) * torch.tensor(capacity_factor)).to(torch.int64)
    return int(torch.maximum(cap, torch.tensor(min_capacity, dtype=torch.int64)))


def gumbel_noise(shape, device: torch.device) -> Tensor:
    """Standard Gumbel noise drawn as DeepSpeed draws it (torch.distributions' Gumbel(0, 1).rsample)."""
    one, zero = torch.tensor(1.0, device=device), torch.tensor(0.0, device=device)
    return torch.distributions.gumbel.Gumbel(zero, one).rsample(shape)


def uniform_noise(shape, device: torch.device, low: float = 0.0, high: float = 1.0) -> Tensor:
    lo, hi = torch.tensor(low, device=device), torch.tensor(high, device=device)
    return torch.distributions.uniform.Uniform(low=lo, high=hi).rsample(shape)


def multiplicative_jitter(x: Tensor, epsilon: float = 1e-2) -> Tensor:
    """``x`` times a uniform number in [1 - epsilon, 1 + epsilon] per element (noisy_gate_policy "Jitter")."""
    if epsilon == 0:
        return x
    return x * uniform_noise(x.shape, x.device, 1.0 - epsilon, 1.0 + epsilon)


def largest_count(exp_counts: Tensor, group) -> int:
    """The largest tokens-per-expert over the expert-parallel ``group`` (capacity without dropping: every
    rank's buffers must have the same size for the all-to-all). A host sync point."""
    top = torch.max(exp_counts).to(exp_counts.device)
    if group is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(top, op=dist.ReduceOp.MAX, group=group)
    return int(top)


def _slots(experts: Tensor, locations: Tensor, capacity: int, num_experts: int) -> Tensor:
    """Each route's flat slot in the ``[experts × capacity]`` buffer; a dropped route's is the scratch slot
    ``experts × capacity`` (one past the end), which dispatch never fills and combine reads as zeros."""
    return torch.where(experts >= 0, experts * capacity + locations, torch.full_like(experts, num_experts * capacity))


def top1gating(logits: Tensor, capacity_factor: float, min_capacity: int, used_token: Optional[Tensor] = None,
               noisy_gate_policy: Optional[str] = None, drop_tokens: bool = True, use_rts: bool = True,
               ep_group=None) -> Routes:
    """Top-1 gating (Switch): each token to its most probable expert, at most ``capacity`` per expert; with
    ``use_rts`` the tokens kept are a random selection, else the first ones."""
    if noisy_gate_policy == "RSample":
        noisy = logits + gumbel_noise(logits.shape, logits.device)
    gates = F.softmax(logits, dim=1)
    num_tokens, num_experts = int(gates.shape[0]), int(gates.shape[1])
    capacity = capacity_of(num_tokens, num_experts, capacity_factor, min_capacity)
    choice = torch.argmax(noisy if noisy_gate_policy == "RSample" else gates, dim=1)
    mask = F.one_hot(choice, num_classes=num_experts)
    if used_token is not None:
        mask = torch.einsum("s,se->se", used_token, mask)
    exp_counts = torch.sum(mask, dim=0).detach()
    if not drop_tokens:
        capacity = min(largest_count(exp_counts, ep_group), num_tokens)
    me = torch.mean(gates, dim=0)
    ce = torch.mean(mask.float(), dim=0)
    l_aux = torch.sum(me * ce) * num_experts
    ranked = mask * uniform_noise(mask.shape, logits.device) if use_rts else mask
    if num_tokens < min_capacity:
        raise ValueError(f"MoE top-1 gating: {num_tokens} tokens is fewer than min_capacity {min_capacity}; set "
                         f"min_capacity lower or give the layer more tokens")
    kept_idx = torch.topk(ranked, k=min(capacity, num_tokens), dim=0)[1]
    mask = mask * torch.zeros_like(mask).scatter_(0, kept_idx, 1)
    choice = torch.min(choice, mask.sum(dim=1) * num_experts - 1)  # -1 where the token was dropped
    locations = torch.sum((torch.cumsum(mask, dim=0) - 1) * mask, dim=1)
    weights = (gates * mask).sum(dim=1)
    experts = choice.long().unsqueeze(0)
    return Routes(l_aux, capacity, num_experts, experts, _slots(experts, locations.long().unsqueeze(0), capacity, num_experts),
                  weights.unsqueeze(0), exp_counts)


def top2gating(logits: Tensor, capacity_factor: float, min_capacity: int, drop_tokens: bool = True,
               ep_group=None, top2_2nd_expert_sampling: bool = True) -> Routes:
    """Top-2 gating (GShard): the most probable expert and a second (sampled with Gumbel noise when
    ``top2_2nd_expert_sampling``), second choices queued after every first choice; weights renormalised over
    the routes kept."""
    gates = F.softmax(logits, dim=1)
    num_tokens, num_experts = int(gates.shape[0]), int(gates.shape[1])
    first = torch.argmax(gates, dim=1)
    mask1 = F.one_hot(first, num_classes=num_experts)
    if top2_2nd_expert_sampling:
        logits = logits + gumbel_noise(logits.shape, logits.device)
    second = torch.argmax(logits.masked_fill(mask1.bool(), float("-inf")), dim=1)
    mask2 = F.one_hot(second, num_classes=num_experts)
    loc1 = torch.cumsum(mask1, dim=0) - 1
    loc2 = torch.cumsum(mask2, dim=0) - 1 + torch.sum(mask1, dim=0, keepdim=True)
    me = torch.mean(gates, dim=0)
    ce = torch.mean(mask1.float(), dim=0)
    l_aux = torch.mean(me * ce) * num_experts * num_experts
    exp_counts = torch.sum(mask1 + mask2, dim=0).detach()
    if drop_tokens:
        capacity = capacity_of(num_tokens, num_experts, capacity_factor * 2, min_capacity)
        mask1 = mask1 * torch.lt(loc1, capacity)
        mask2 = mask2 * torch.lt(loc2, capacity)
    else:
        capacity = largest_count(exp_counts, ep_group)
    loc1_s, loc2_s = torch.sum(loc1 * mask1, dim=1), torch.sum(loc2 * mask2, dim=1)
    g1 = torch.einsum("se,se->s", gates, mask1.float())
    g2 = torch.einsum("se,se->s", gates, mask2.float())
    denom = torch.clamp(g1 + g2, min=torch.finfo(g1.dtype).eps)
    g1, g2 = g1 / denom, g2 / denom
    first = torch.where(mask1.any(dim=1), first, torch.full_like(first, -1))
    second = torch.where(mask2.any(dim=1), second, torch.full_like(second, -1))
    experts = torch.stack([first, second]).long()
    slots = _slots(experts, torch.stack([loc1_s, loc2_s]).long(), capacity, num_experts)
    return Routes(l_aux, capacity, num_experts, experts, slots, torch.stack([g1, g2]), exp_counts)


def topkgating(logits: Tensor, k: int, capacity_factor: float, min_capacity: int, drop_tokens: bool = True,
               ep_group=None) -> Routes:
    """Top-k gating for k > 2 (DeepSpeed's ``topkgating``, drop policy "probs": over capacity, the routes
    with the smallest gate values are dropped); weights renormalised over the routes kept."""
    gates = F.softmax(logits, dim=1)
    num_tokens, num_experts = int(gates.shape[0]), int(gates.shape[1])
    top_gate, top_idx = torch.topk(gates, k=k, dim=1)
    mask = torch.zeros_like(gates, dtype=torch.bool).scatter_(1, top_idx, 1)
    exp_counts = torch.sum(mask, dim=0).detach()
    me = torch.mean(gates, dim=0)
    ce = torch.mean(mask.float(), dim=0)
    l_aux = torch.mean(me * ce) * num_experts * num_experts / k
    if drop_tokens:
        capacity = capacity_of(num_tokens, num_experts, capacity_factor * k, min_capacity)
        masked = torch.zeros_like(gates).scatter(1, top_idx, top_gate)
        _, cap_idx = torch.topk(masked, k=min(capacity, num_tokens), dim=0, sorted=False)
        mask &= torch.zeros_like(gates, dtype=torch.bool).scatter_(0, cap_idx, True)
    else:
        capacity = largest_count(exp_counts, ep_group)
    locations = torch.cumsum(mask, dim=0) - 1
    gm = gates * mask
    gm = gm / torch.clamp(torch.sum(gm, dim=-1, keepdim=True), min=torch.finfo(gm.dtype).eps)
    kept = mask.gather(1, top_idx)
    experts = torch.where(kept, top_idx, torch.full_like(top_idx, -1)).t().contiguous().long()
    locs = (locations.gather(1, top_idx) * kept).t().contiguous().long()
    return Routes(l_aux, capacity, num_experts, experts, _slots(experts, locs, capacity, num_experts),
                  gm.gather(1, top_idx).t().contiguous(), exp_counts)
