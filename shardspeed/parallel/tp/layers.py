"""Tensor-parallel layers (Megatron-LM's): each holds its local slice as a plain ``nn.Parameter``.

ZeRO's flat units, pieces and checkpoints therefore treat the slices like any parameter. Each sliced
parameter is marked with :func:`~shardspeed.mesh.replicas.mark_tensor_parallel` and carries
``tp_slice`` (:class:`~.slicing.TPSlice`: where it lies in the full tensor). Parameters that stay whole
(a row-parallel bias) are replicas across the model group.

``transposed``: the weight is stored ``(in, out)`` as in Hugging Face's ``Conv1D`` (else ``(out, in)`` as
in ``nn.Linear``); the layer keeps the original layout so that state-dict names and shapes line up.
With ``sequence_parallel`` the activations between tensor-parallel regions are split along the
sequence (dimension :data:`SEQ_DIM`): a column-parallel layer all-gathers its input and a row-parallel
layer reduce-scatters its output instead of the all-reduce.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from ...mesh.replicas import mark_tensor_parallel
from . import comm
from .comm import TPGroup
from .slicing import TPSlice

#: The sequence dimension of activations ``(batch, sequence, hidden)``.
SEQ_DIM = -2


def sliced_parameter(local: torch.Tensor, sl: TPSlice, requires_grad: bool) -> nn.Parameter:
    p = nn.Parameter(local, requires_grad=requires_grad)
    mark_tensor_parallel(p)
    p.tp_slice = sl  # type: ignore[attr-defined]
    return p


def mark_sequence_parallel_grad(param: nn.Parameter, group: TPGroup) -> None:
    """``param`` is replicated but used on a sequence shard: sum its gradient over the model group as it is
    produced (before it is accumulated into ``.grad``). Megatron's ``sequence_parallel`` attribute."""
    if group.size == 1 or getattr(param, "sequence_parallel", False):
        return
    param.sequence_parallel = True  # type: ignore[attr-defined]
    param.register_hook(lambda g: group.all_reduce(g))


class _TPLinearBase(nn.Module):
    def __init__(self, weight: nn.Parameter, bias: Optional[nn.Parameter], group: TPGroup, transposed: bool,
                 sequence_parallel: bool):
        super().__init__()
        self.weight = weight
        self.bias = bias
        self.group = group
        self.transposed = transposed
        self.sequence_parallel = sequence_parallel and group.size > 1

    def _matmul(self, x: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
        if self.transposed:
            y = x @ self.weight
            return y if bias is None else y + bias
        return F.linear(x, self.weight, bias)


class SharedInput:
    """Column-parallel siblings that read the same input (Llama's q/k/v projections, gate/up) enter the
    tensor-parallel region once: the first call's entry (copy_to / gather_seq) is reused for the same
    input tensor, so backward sums their input gradients locally and all-reduces once, not once each.

    The entry is forgotten when the last of the ``users`` siblings took it, so nothing is kept between
    forwards: no activation held, and ``torch.compile`` of the block finds the same (empty) state at every
    call (no recompile after the first). A sibling skipped in a forward only delays that; the identity check
    keeps a later input from reusing a stale entry."""

    def __init__(self, users: int = 0) -> None:
        self.users = users
        self._last: Optional[tuple] = None
        self._taken = 0

    def enter(self, x: torch.Tensor, enter_fn) -> torch.Tensor:
        if self._last is not None and self._last[0] is x and self._last[2] == torch.is_grad_enabled():
            y = self._last[1]
            self._taken += 1
        else:
            y = enter_fn(x)
            self._last, self._taken = (x, y, torch.is_grad_enabled()), 1
        if self.users and self._taken >= self.users:
            self._last, self._taken = None, 0
        return y


class ColumnParallelLinear(_TPLinearBase):
    """``y = x Wᵀ + b`` with W (and b) split by output features: each rank computes its columns of ``y``.

    Input: replicated (or, with sequence parallelism, this rank's sequence shard, all-gathered here).
    Output: this rank's columns, or all of them when ``gather_output`` (an all-gather).
    """

    def __init__(self, weight: nn.Parameter, bias: Optional[nn.Parameter], group: TPGroup, *,
                 transposed: bool = False, gather_output: bool = False, sequence_parallel: bool = False):
        super().__init__(weight, bias, group, transposed, sequence_parallel)
        self.gather_output = gather_output
        self.shared_input: Optional[SharedInput] = None  # set by the plan for siblings reading one input

    def _enter(self, x: torch.Tensor) -> torch.Tensor:
        return comm.gather_seq(x, self.group, SEQ_DIM) if self.sequence_parallel else comm.copy_to(x, self.group)

    def parallel_input(self, x: torch.Tensor) -> torch.Tensor:
        return self._enter(x) if self.shared_input is None else self.shared_input.enter(x, self._enter)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self._matmul(self.parallel_input(x), self.bias)
        return comm.gather_from(y, self.group, -1) if self.gather_output else y


class RowParallelLinear(_TPLinearBase):
    """``y = x Wᵀ + b`` with W split by input features: the input is already split (the output of a
    column-parallel layer); partial products are summed by an all-reduce (sequence parallel: a
    reduce-scatter to this rank's sequence shard), then the replicated bias is added."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self._matmul(x, None)
        y = comm.reduce_scatter_seq(y, self.group, SEQ_DIM) if self.sequence_parallel else comm.reduce_from(y, self.group)
        return y if self.bias is None else y + self.bias


class VocabParallelEmbedding(nn.Module):
    """An embedding whose rows (the vocabulary) are split: rank r holds ids ``[start, start + rows)``; ids
    elsewhere look up zeros here, and the ranks' outputs are summed (all-reduce; sequence parallel:
    reduce-scatter to this rank's sequence shard)."""

    def __init__(self, weight: nn.Parameter, group: TPGroup, *, sequence_parallel: bool = False,
                 padding_idx: Optional[int] = None):
        super().__init__()
        self.weight = weight
        self.group = group
        self.sequence_parallel = sequence_parallel and group.size > 1
        self.vocab_start = group.rank * weight.shape[0]
        #: the full embedding's padding row, local to this rank when it holds it (its gradient stays zero)
        self.padding_idx = padding_idx
        mine = padding_idx is not None and 0 <= padding_idx - self.vocab_start < weight.shape[0]
        self._local_padding = padding_idx - self.vocab_start if mine and padding_idx is not None else None

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        rows = self.weight.shape[0]
        if self.group.size > 1:
            outside = (ids < self.vocab_start) | (ids >= self.vocab_start + rows)
            local = (ids - self.vocab_start).masked_fill(outside, 0)
            out = F.embedding(local, self.weight, padding_idx=self._local_padding)
            out = out.masked_fill(outside.unsqueeze(-1), 0.0)
        else:
            out = F.embedding(ids, self.weight, padding_idx=self.padding_idx)
        if self.sequence_parallel:
            return comm.reduce_scatter_seq(out, self.group, SEQ_DIM)
        return comm.reduce_from(out, self.group)

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """This weight as a tied LM head: ``x @ weight.T`` over the whole vocabulary (each rank's rows,
        gathered; the input's gradient summed over the group). ``x`` is replicated (not sequence-split)."""
        if self.group.size == 1:
            return x @ self.weight.t()
        return comm.gather_from(comm.copy_to(x, self.group) @ self.weight.t(), self.group, dim=-1)


def scatter_output_along_sequence(module: nn.Module, group: TPGroup) -> None:
    """Sequence parallelism: ``module`` runs on replicated inputs and keeps this rank's sequence shard of its
    output (e.g. the position embedding added to the sharded token embedding). Its gradient is
    all-gathered, so the module's parameters get whole gradients. A forward hook: names do not change."""
    if group.size > 1:
        module.register_forward_hook(lambda _m, _args, out: comm.scatter_to(out, group, SEQ_DIM))


def gather_output_along_sequence(module: nn.Module, group: TPGroup) -> None:
    """Sequence parallelism: ``module`` runs on this rank's sequence shard and its output is all-gathered
    (the end of the sequence-parallel region, e.g. the final norm before a replicated head)."""
    if group.size > 1:
        module.register_forward_hook(lambda _m, _args, out: comm.gather_from(out, group, SEQ_DIM))
