"""The sequence group's autograd collectives: Ulysses' all-to-all, the KV all-gather of ring attention, and
the loss's sum. Each backward is the adjoint of its forward, so a rank's parameter gradients are what its
own tokens contribute to the loss of the whole sequence."""
from __future__ import annotations

from typing import Any, List, Optional

import torch
import torch.distributed as dist

from ...errors import DistributedError


def _size(group: Optional[dist.ProcessGroup]) -> int:
    return dist.get_world_size(group)


def _all_to_all(x: torch.Tensor, scatter_dim: int, gather_dim: int, group) -> torch.Tensor:
    """Split ``x`` in P pieces along ``scatter_dim``, send piece i to rank i, and concatenate what arrives
    along ``gather_dim`` (in rank order)."""
    p = _size(group)
    if x.shape[scatter_dim] % p:
        raise DistributedError(f"all-to-all over {p} sequence ranks: dimension {scatter_dim} of {tuple(x.shape)} "
                               f"is not divisible by {p}")
    send = torch.stack(x.chunk(p, dim=scatter_dim)).contiguous()
    recv = torch.empty_like(send)
    try:
        dist.all_to_all_single(recv, send, group=group)
    except RuntimeError as exc:
        raise DistributedError(f"all_to_all_single over the sequence group failed: {exc}") from exc
    return torch.cat(recv.unbind(0), dim=gather_dim)


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, scatter_dim: int, gather_dim: int, group) -> torch.Tensor:
        ctx.dims, ctx.group = (scatter_dim, gather_dim), group
        return _all_to_all(x, scatter_dim, gather_dim, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor):
        scatter_dim, gather_dim = ctx.dims
        return _all_to_all(grad.contiguous(), gather_dim, scatter_dim, ctx.group), None, None, None


def all_to_all(x: torch.Tensor, scatter_dim: int, gather_dim: int, group) -> torch.Tensor:
    """Differentiable all-to-all over the sequence group (e.g. heads scattered, sequence gathered)."""
    if _size(group) == 1:
        return x
    return _AllToAll.apply(x, scatter_dim, gather_dim, group)


class _GatherSeq(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group) -> torch.Tensor:
        ctx.group = group
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(_size(group))]
        dist.all_gather(parts, x, group=group)
        return torch.stack(parts)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor):
        out = torch.empty_like(grad[0])
        dist.reduce_scatter(out, list(grad.contiguous().unbind(0)), group=ctx.group)
        return out, None


def all_gather_stacked(x: torch.Tensor, group) -> torch.Tensor:
    """Every rank's ``x``, stacked on a new first dimension in rank order; the backward sums each rank's
    gradient of its own piece (a reduce-scatter)."""
    if _size(group) == 1:
        return x.unsqueeze(0)
    return _GatherSeq.apply(x, group)


class _SumOverRanks(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group) -> torch.Tensor:
        ctx.group = group
        out = x.detach().clone()
        dist.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor):
        # every rank's copy of the sum depends on every rank's x: the adjoint sums the incoming gradients
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


def sum_over_ranks(x: torch.Tensor, group) -> torch.Tensor:
    """The sum of ``x`` over the group, the same on every rank, differentiable.

    Its backward is also a sum: with the same upstream gradient g on the P ranks each receives P·g, which the
    gradient reduction's division by data × sequence turns back into the mean over data replicas."""
    if _size(group) == 1:
        return x
    return _SumOverRanks.apply(x, group)


def gather_lengths(n: int, group, device: torch.device) -> List[int]:
    """Each rank's integer ``n``, in rank order (no gradient)."""
    mine = torch.tensor([n], dtype=torch.int64, device=device)
    out = [torch.zeros_like(mine) for _ in range(_size(group))]
    dist.all_gather(out, mine, group=group)
    return [int(t.item()) for t in out]
