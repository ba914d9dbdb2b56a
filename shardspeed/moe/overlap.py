"""The expert-parallel exchange overlapped with the experts' compute, in chunks of the capacity.

The ``[experts, capacity, d]`` buffer is cut into ``chunks`` along the capacity. Every chunk's dispatch
all-to-all is launched at once (asynchronously); the experts run on chunk 0 as soon as it has arrived, while
the later chunks are still in flight, and each chunk's results start back as soon as they are computed. In
backward the same happens in reverse: a chunk's gradient exchange is launched when autograd reaches it and
waited for only where the gradient is needed, so the other chunks' expert backward runs meanwhile.

Two autograd functions make one asynchronous exchange: :class:`_Start` launches ``all_to_all_single`` and returns
its output tensor (filled later), :class:`_Wait` waits for it; in backward ``_Wait`` launches the gradient's
exchange and ``_Start`` waits for it. A token-wise expert gives the same result on chunks as on the whole buffer.
Every rank runs the same graph, so the exchanges are issued in the same order on every rank.
"""
from __future__ import annotations

from typing import Any, Callable, List, Optional

import torch
import torch.distributed as dist
from torch import Tensor


class _Box:
    """One exchange in flight: forward's work and output, backward's work and gradient."""

    __slots__ = ("group", "work", "grad_work", "grad")

    def __init__(self, group) -> None:
        self.group = group
        self.work: Any = None
        self.grad_work: Any = None
        self.grad: Optional[Tensor] = None


class _Start(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: Tensor, box: _Box) -> Tensor:
        out = torch.empty_like(x)
        box.work = dist.all_to_all_single(out, x.contiguous(), group=box.group, async_op=True)
        ctx.box = box
        return out

    @staticmethod
    def backward(ctx: Any, grad: Tensor):
        box = ctx.box
        box.grad_work.wait()  # the exchange _Wait's backward launched
        out, box.grad, box.grad_work = box.grad, None, None
        return out, None


class _Wait(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, y: Tensor, box: _Box) -> Tensor:
        box.work.wait()
        box.work = None
        ctx.box = box
        return y.view_as(y)

    @staticmethod
    def backward(ctx: Any, grad: Tensor):
        box = ctx.box
        box.grad = torch.empty_like(grad)
        box.grad_work = dist.all_to_all_single(box.grad, grad.contiguous(), group=box.group, async_op=True)
        return grad, None


def _start(group, x: Tensor) -> tuple[Tensor, _Box]:
    box = _Box(group)
    return _Start.apply(x, box), box


def overlapped_experts(group, buf: Tensor, experts: Callable[[Tensor], Tensor], chunks: int) -> Tensor:
    """``all_to_all(experts(all_to_all(buf)))`` for ``buf`` ``[experts, capacity, d]`` (the experts' function
    takes and returns ``[experts, rows, d]``), in ``chunks`` pieces of the capacity, overlapped."""
    pieces = [p.contiguous() for p in buf.chunk(chunks, dim=1)]
    started = [_start(group, p) for p in pieces]  # every dispatch in flight
    back: List[tuple[Tensor, _Box]] = []
    for out, box in started:
        y = experts(_Wait.apply(out, box))
        back.append(_start(group, y.contiguous()))  # its results go back while the next chunk computes
    return torch.cat([_Wait.apply(out, box) for out, box in back], dim=1)
