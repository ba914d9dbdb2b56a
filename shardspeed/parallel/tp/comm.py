"""The tensor-parallel group's collectives as autograd Functions (Megatron's mappings).

Each function is a pair (forward op, backward op) over the model group; every call goes through
:class:`~shardspeed.comm.collectives.Collectives`, so the comms log counts tensor-parallel bytes too:

==================  ==========================  ==========================
function            forward                     backward
==================  ==========================  ==========================
copy_to             identity                    all-reduce
reduce_from         all-reduce                  identity
gather_from         all-gather along ``dim``    keep this rank's chunk
scatter_to          keep this rank's chunk      all-gather along ``dim``
gather_seq          all-gather along ``dim``    reduce-scatter along ``dim``
reduce_scatter_seq  reduce-scatter along dim    all-gather along ``dim``
==================  ==========================  ==========================

The last two are sequence parallelism's (activations split along the sequence between the tensor-
parallel regions). At tensor-parallel size 1 every function is the identity and issues nothing.

Under ``torch.compile`` (``engine.compile()``: a block's forward and its compiled backward) the same
collectives are issued as torch's functional collectives (``torch.distributed._functional_collectives``),
which dynamo captures as graph nodes: a tensor-parallel block compiles into one graph, with no break at its
collectives. Those are not counted in the comms log (the log's clock cannot run inside a graph).
"""
from __future__ import annotations

from typing import Any, Tuple

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol

from ...comm.collectives import Collectives, CommsLogger
from ...errors import ConfigError
from ...mesh.topology import Topology


class TPGroup:
    """The model group of one rank: its size, this rank's index, and tensor-shaped collectives."""

    def __init__(self, comm: Collectives):
        self.comm = comm
        self.size = comm.world
        self.rank = comm.topology.shard_rank

    @classmethod
    def of(cls, topology: Topology, log: CommsLogger | None = None) -> TPGroup:
        """The model group of ``topology`` (its ``model_*`` fields), logging into ``log``."""
        return cls(Collectives.over(topology.model_group, log))

    def _group(self) -> dist.ProcessGroup:
        """The model group as a functional collective names it (None: the world)."""
        group = self.comm.group
        return group if group is not None else dist.distributed_c10d._get_default_group()

    def chunk(self, x: torch.Tensor, dim: int) -> torch.Tensor:
        """This rank's part of ``x`` cut into ``size`` equal parts along ``dim``."""
        if x.shape[dim] % self.size:
            raise ConfigError(f"tensor parallel: dimension {dim} of an activation of shape {tuple(x.shape)} is not "
                              f"divisible by the tensor-parallel size {self.size} (with sequence_parallel the "
                              f"sequence length must be a multiple of it)")
        return x.chunk(self.size, dim=dim)[self.rank].contiguous()

    def all_reduce(self, x: torch.Tensor, op: Any = None) -> torch.Tensor:
        if torch.compiler.is_compiling() and op in (None, dist.ReduceOp.SUM):
            return funcol.all_reduce(x.contiguous(), "sum", self._group())
        out = x.contiguous().clone()
        if op is None:
            self.comm.all_reduce(out)
        else:
            self.comm.all_reduce(out, op=op)
        return out

    def all_gather(self, x: torch.Tensor, dim: int) -> torch.Tensor:
        """Every rank's ``x`` concatenated along ``dim`` in rank order."""
        x = x.contiguous()
        if torch.compiler.is_compiling():
            return funcol.all_gather_tensor(x, dim % x.dim(), self._group())
        out = torch.empty((self.size,) + tuple(x.shape), dtype=x.dtype, device=x.device)
        self.comm.all_gather(out.view(-1), x.view(-1))
        return torch.cat(out.unbind(0), dim=dim)

    def reduce_scatter(self, x: torch.Tensor, dim: int) -> torch.Tensor:
        """The sum over ranks of ``x``, this rank's part along ``dim``."""
        if x.shape[dim] % self.size:
            self.chunk(x, dim)  # raises the error naming the shapes
        if torch.compiler.is_compiling():
            return funcol.reduce_scatter_tensor(x.contiguous(), "sum", dim % x.dim(), self._group())
        parts = torch.stack(x.chunk(self.size, dim=dim)).contiguous()
        out = torch.empty(parts.shape[1:], dtype=x.dtype, device=x.device)
        self.comm.reduce_scatter(out.view(-1), parts.view(-1))
        return out


class _CopyTo(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: TPGroup) -> torch.Tensor:
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> Tuple[torch.Tensor, None]:
        return ctx.group.all_reduce(g), None


class _ReduceFrom(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: TPGroup) -> torch.Tensor:
        return group.all_reduce(x)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> Tuple[torch.Tensor, None]:
        return g, None


class _Gather(torch.autograd.Function):
    """All-gather along ``dim``; backward keeps this rank's chunk (``reduce=False``) or reduce-scatters."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: TPGroup, dim: int, reduce: bool) -> torch.Tensor:
        ctx.group, ctx.dim, ctx.reduce = group, dim, reduce
        return group.all_gather(x, dim)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> Tuple[torch.Tensor, None, None, None]:
        out = ctx.group.reduce_scatter(g, ctx.dim) if ctx.reduce else ctx.group.chunk(g, ctx.dim)
        return out, None, None, None


class _Scatter(torch.autograd.Function):
    """Keep this rank's chunk along ``dim`` (``reduce=False``) or reduce-scatter; backward all-gathers."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: TPGroup, dim: int, reduce: bool) -> torch.Tensor:
        ctx.group, ctx.dim = group, dim
        return group.reduce_scatter(x, dim) if reduce else group.chunk(x, dim)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> Tuple[torch.Tensor, None, None, None]:
        return ctx.group.all_gather(g, ctx.dim), None, None, None


def copy_to(x: torch.Tensor, group: TPGroup) -> torch.Tensor:
    """Enter a tensor-parallel region with a replicated input: identity, all-reduce of the gradient."""
    return _CopyTo.apply(x, group) if group.size > 1 else x


def reduce_from(x: torch.Tensor, group: TPGroup) -> torch.Tensor:
    """Leave a tensor-parallel region by summing partial outputs: all-reduce, gradient passed through."""
    return _ReduceFrom.apply(x, group) if group.size > 1 else x


def gather_from(x: torch.Tensor, group: TPGroup, dim: int = -1) -> torch.Tensor:
    """Concatenate the ranks' parts along ``dim``; the gradient keeps this rank's part."""
    return _Gather.apply(x, group, dim, False) if group.size > 1 else x


def scatter_to(x: torch.Tensor, group: TPGroup, dim: int = -1) -> torch.Tensor:
    """Keep this rank's part along ``dim`` of a replicated tensor; the gradient is all-gathered."""
    return _Scatter.apply(x, group, dim, False) if group.size > 1 else x


def gather_seq(x: torch.Tensor, group: TPGroup, dim: int = 1) -> torch.Tensor:
    """Sequence parallelism: all-gather the sequence shards; the gradient is reduce-scattered."""
    return _Gather.apply(x, group, dim, True) if group.size > 1 else x


def reduce_scatter_seq(x: torch.Tensor, group: TPGroup, dim: int = 1) -> torch.Tensor:
    """Sequence parallelism: sum partial outputs and keep this rank's sequence shard; the gradient is
    all-gathered."""
    return _Scatter.apply(x, group, dim, True) if group.size > 1 else x
