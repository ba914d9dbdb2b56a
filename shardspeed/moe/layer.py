"""DeepSpeed's mixture-of-experts layer: ``shardspeed.moe.layer.MoE``, same signature and semantics.

``MoE(hidden_size, expert, num_experts, ep_size, k, ...)`` holds a gate (``deepspeed_moe.gate.wg``, a
bias-free linear to the experts) and this rank's ``num_experts / ep_size`` experts, stacked
(:mod:`.experts`). Its forward routes each token (:mod:`.gating`), places the routed tokens in an
``[experts, capacity, d]`` buffer, sends each rank its experts' rows with one ``all_to_all_single`` over
the expert-parallel group, runs the local experts in one batched call, sends the results back with a
second all-to-all and combines them weighted by the gate. It returns ``(output, l_aux, exp_counts)``.

The expert-parallel group is the engine's: :func:`shardspeed.initialize` gives every MoE layer the mesh's
``expert`` group (the plan's expert dimension is the largest ``ep_size`` of the model's layers) and tells
it which experts it holds (global ids ``ep_rank × num_local ...``), as DeepSpeed's engine calls
``set_deepspeed_parallelism``. A layer with ``ep_size`` 1 needs no group.
"""
from __future__ import annotations

from typing import Any, Optional, Tuple

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor

from .experts import Experts
from .gating import Routes, multiplicative_jitter, top1gating, top2gating, topkgating
from .overlap import overlapped_experts


class _AllToAll(torch.autograd.Function):
    """``all_to_all_single`` over ``group`` (equal splits along dim 0); its gradient is the same exchange back."""

    @staticmethod
    def forward(ctx: Any, group, x: Tensor) -> Tensor:
        ctx.group = group
        x = x.contiguous()
        out = torch.empty_like(x)
        dist.all_to_all_single(out, x, group=group)
        return out

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> Tuple[None, Tensor]:
        return None, _AllToAll.apply(ctx.group, grad)


def all_to_all(group, x: Tensor) -> Tensor:
    """Rank ``i`` of ``group`` receives block ``i`` (of ``size`` equal blocks along dim 0) of every rank's ``x``,
    in rank order; differentiable."""
    return _AllToAll.apply(group, x)


class TopKGate(nn.Module):
    """The gate: ``wg`` (hidden → experts, no bias) in fp32, then top-1, top-2 or top-k gating."""

    def __init__(self, model_dim: int, num_experts: int, k: int = 1, capacity_factor: float = 1.0,
                 eval_capacity_factor: float = 1.0, min_capacity: int = 8, noisy_gate_policy: Optional[str] = None,
                 drop_tokens: bool = True, use_rts: bool = True, ep_group=None,
                 top2_2nd_expert_sampling: bool = True) -> None:
        super().__init__()
        self.wg = nn.Linear(model_dim, num_experts, bias=False)
        self.ep_group = ep_group
        self.k = k
        self.capacity_factor = capacity_factor
        self.eval_capacity_factor = eval_capacity_factor
        self.min_capacity = min_capacity
        self.noisy_gate_policy = noisy_gate_policy
        self.drop_tokens = drop_tokens
        self.use_rts = use_rts
        self.top2_2nd_expert_sampling = top2_2nd_expert_sampling

    def _set_ep_group(self, ep_group) -> None:
        self.ep_group = ep_group

    def forward(self, input: Tensor, used_token: Optional[Tensor] = None) -> Routes:  # noqa: A002 - DeepSpeed's
        x = input.float()
        if self.noisy_gate_policy == "Jitter" and self.training:
            x = multiplicative_jitter(x)
        logits = F.linear(x, weight=self.wg.weight.float(), bias=None)
        cf = self.capacity_factor if self.training else self.eval_capacity_factor
        if self.k == 1:
            return top1gating(logits, cf, self.min_capacity, used_token,
                              self.noisy_gate_policy if self.training else None, self.drop_tokens, self.use_rts,
                              self.ep_group)
        if self.k == 2:
            return top2gating(logits, cf, self.min_capacity, self.drop_tokens, self.ep_group,
                              self.top2_2nd_expert_sampling)
        return topkgating(logits, self.k, cf, self.min_capacity, self.drop_tokens, self.ep_group)


def dispatch(tokens: Tensor, routes: Routes) -> Tensor:
    """The ``[experts, capacity, d]`` buffer: each kept route's token in its slot, zeros in empty slots (one
    gather: the token of every slot is found by inverting the routing map)."""
    n, d = tokens.shape
    e, c = routes.num_experts, routes.capacity
    source = torch.full((e * c + 1,), n, dtype=torch.long, device=tokens.device)
    owners = torch.arange(n, device=tokens.device).expand_as(routes.slots)
    source.scatter_(0, routes.slots.reshape(-1), owners.reshape(-1))
    padded = torch.cat([tokens, tokens.new_zeros(1, d)])
    return padded.index_select(0, source[:-1]).view(e, c, d)


def combine(expert_out: Tensor, routes: Routes, num_tokens: int) -> Tensor:
    """Each token's routes read back from ``expert_out`` (``[experts × capacity, d]``) and summed, weighted by
    the gate in fp32; in ``expert_out``'s dtype."""
    d = expert_out.size(-1)
    padded = torch.cat([expert_out, expert_out.new_zeros(1, d)])
    routed = padded.index_select(0, routes.slots.reshape(-1)).view(routes.slots.size(0), num_tokens, d)
    return (routed * routes.weights.unsqueeze(-1)).sum(0).to(expert_out.dtype)


class MOELayer(nn.Module):
    """Gate, dispatch, all-to-all, experts, all-to-all, combine (GShard's Algorithm 2)."""

    def __init__(self, gate: TopKGate, experts: Experts, ep_group_name: str, ep_size: int, num_local_experts: int,
                 use_tutel: bool = False) -> None:
        super().__init__()
        self.gate = gate
        self.experts = experts
        self.ep_group = None
        self.ep_size = ep_size
        self.ep_group_name = ep_group_name
        self.num_local_experts = num_local_experts
        self.use_tutel = False  # tutel's kernels are not used; the gather dispatch does the same job
        self.l_aux: Optional[Tensor] = None
        self.exp_counts: Optional[Tensor] = None
        #: capacity chunks whose exchanges overlap the experts' compute (:mod:`.overlap`); None: decided with
        #: the group (2 on NCCL, 1 on gloo, whose CPU ranks share the cores the exchange would overlap with)
        self.overlap_chunks: Optional[int] = None

    def _set_ep_group(self, ep_group) -> None:
        self.ep_group = ep_group
        self.gate._set_ep_group(ep_group)
        if self.overlap_chunks is None and ep_group is not None:
            self.overlap_chunks = 2 if dist.get_backend(ep_group) == "nccl" else 1

    def _run_experts(self, buf: Tensor) -> Tensor:
        """``[experts, rows, d]`` received (blocks by source rank, then local expert) → the experts' outputs."""
        e, rows, d = buf.shape
        out = self.experts(buf.reshape(self.ep_size, self.num_local_experts, rows, d))
        return out.reshape(e, rows, out.shape[-1])

    def forward(self, *input: Tensor, **kwargs: Any) -> Tensor:  # noqa: A002 - DeepSpeed's signature
        d = input[0].shape[-1]
        tokens = input[0].reshape(-1, d)
        used = input[1] if len(input) > 1 else None
        routes = self.gate(tokens, used)
        self.l_aux, self.exp_counts = routes.l_aux, routes.exp_counts
        buf = dispatch(tokens, routes)
        if self.ep_size > 1:
            if self.ep_group is None:
                raise RuntimeError(f"MoE layer with ep_size {self.ep_size} has no expert-parallel group: build the "
                                   f"engine with shardspeed.initialize before the first forward")
            chunks = min(self.overlap_chunks or 1, routes.capacity)
            if chunks > 1:
                out = overlapped_experts(self.ep_group, buf, self._run_experts, chunks)
                return combine(out.reshape(-1, out.shape[-1]), routes, tokens.size(0)).reshape(
                    input[0].shape[:-1] + (-1,))
            buf = all_to_all(self.ep_group, buf)
        out = self._run_experts(buf)
        if self.ep_size > 1:
            out = all_to_all(self.ep_group, out)
        return combine(out.reshape(-1, out.shape[-1]), routes, tokens.size(0)).reshape(input[0].shape[:-1] + (-1,))


class MoE(nn.Module):
    """DeepSpeed's ``deepspeed.moe.layer.MoE``: ``forward(hidden_states, used_token=None)`` returns
    ``(output, l_aux, exp_counts)``. ``use_tutel`` is accepted and ignored (the dispatch is a gather already);
    ``enable_expert_tensor_parallelism`` needs a tensor-parallel model dimension and is refused otherwise."""

    def __init__(self, hidden_size: int, expert: nn.Module, num_experts: int = 1, ep_size: int = 1, k: int = 1,
                 capacity_factor: float = 1.0, eval_capacity_factor: float = 1.0, min_capacity: int = 4,
                 use_residual: bool = False, noisy_gate_policy: Optional[str] = None, drop_tokens: bool = True,
                 use_rts: bool = True, use_tutel: bool = False, enable_expert_tensor_parallelism: bool = False,
                 top2_2nd_expert_sampling: bool = True) -> None:
        super().__init__()
        if num_experts % ep_size:
            raise ValueError(f"MoE: num_experts ({num_experts}) must be divisible by ep_size ({ep_size})")
        if noisy_gate_policy not in (None, "None", "Jitter", "RSample"):
            raise ValueError(f"MoE: noisy_gate_policy must be None, 'Jitter' or 'RSample', got {noisy_gate_policy!r}")
        if enable_expert_tensor_parallelism:
            raise ValueError("MoE: enable_expert_tensor_parallelism is not supported by shardspeed yet; leave it False")
        self.use_residual = use_residual
        self.enable_expert_tensor_parallelism = enable_expert_tensor_parallelism
        self.ep_size = ep_size
        self.expert_group_name = f"ep_size_{ep_size}"
        self.num_experts = num_experts
        self.num_local_experts = num_experts // ep_size
        experts = Experts(expert, self.num_local_experts, self.expert_group_name)
        gate = TopKGate(hidden_size, num_experts, k, capacity_factor, eval_capacity_factor, min_capacity,
                        noisy_gate_policy, drop_tokens, use_rts, None, top2_2nd_expert_sampling)
        self.deepspeed_moe = MOELayer(gate, experts, self.expert_group_name, ep_size, self.num_local_experts,
                                      use_tutel=use_tutel)
        if use_residual:
            self.mlp = expert
            self.coefficient = nn.Linear(hidden_size, 2)

    def set_expert_parallel(self, group, ep_rank: int) -> None:
        """The expert-parallel group (``ep_size`` ranks) and this rank's place in it: it holds experts
        ``ep_rank × num_local ... (ep_rank + 1) × num_local - 1``. The engine calls this at initialize."""
        if self.ep_size > 1:
            self.deepspeed_moe._set_ep_group(group)
        self.deepspeed_moe.experts.set_expert_slice(ep_rank if self.ep_size > 1 else 0, self.ep_size)

    def set_deepspeed_parallelism(self, use_data_before_expert_parallel_: bool = False) -> None:
        """DeepSpeed's name: take the current engine's expert group (``shardspeed.utils.groups``); initialize
        already did this for the layers of its model."""
        from ..utils import groups

        if use_data_before_expert_parallel_:
            raise ValueError("use_data_before_expert_parallel_=True is not supported (expert ranks are neighbours)")
        self.set_expert_parallel(groups._get_expert_parallel_group(), groups._get_expert_parallel_rank())

    def forward(self, hidden_states: Tensor, used_token: Optional[Tensor] = None) -> Tuple[Tensor, Tensor, Tensor]:
        args = (hidden_states,) if used_token is None else (hidden_states, used_token)
        output = self.deepspeed_moe(*args)
        if self.use_residual:
            out_mlp = self.mlp(hidden_states)
            if isinstance(out_mlp, tuple):
                out_mlp = out_mlp[0]
            coef = F.softmax(self.coefficient(hidden_states), dim=-1)
            output = output * coef[..., 0:1] + out_mlp * coef[..., 1:]
        l_aux, counts = self.deepspeed_moe.l_aux, self.deepspeed_moe.exp_counts
        assert l_aux is not None and counts is not None
        return output, l_aux, counts
