"""One unit's whole life, in one object: :class:`OwnedUnit`.

A unit is a group of parameters flattened into one buffer (:class:`~.unit.FlatParamUnit`; at stage 3 a
:class:`~.unit.ShardedParamUnit` that holds only this rank's chunk between uses). Its owner walks it through
every step, each transition idempotent::

    storage (ShardedState)       SHARDED --start_gather--> GATHERING --finish_gather--> GATHERED
                                    ^                                                      |
                                    +------------- release (refs 0, not kept) ------------+

    training (TrainingState)     IDLE --pre-forward--> FORWARD --post-forward--> IDLE
                                 IDLE --pre-backward--> PRE_BACKWARD --gradients in--> POST_BACKWARD
                                 POST_BACKWARD --end of backward / step--> IDLE

- forward: each running module that needs the unit holds a reference (:meth:`hold` / :meth:`unhold`); the
  unit is released when the last one lets go, unless it is persistent (small, ``param_persistence_threshold``)
  or kept until the step (``reshard_after_forward=False``). Stages 0-2 never release (their storage is
  always gathered), so the same owner serves them.
- backward: each trainable parameter's gradient is added into the unit's bucket (:meth:`absorb`); when all
  have arrived (:attr:`complete`) the unit is reduced (:meth:`launch`: all-reduce at stage 0, reduce-scatter
  at stages 1-3, asynchronous with ``overlap_comm``) and the result averaged into where the optimizer reads
  it (:meth:`finish_reduce`, :meth:`grad_shard`). At stage 3 the unit is released as soon as autograd is done
  with it (:meth:`arrived` says when); a unit of frozen parameters (no gradient to say so) when the backward
  of every forward call of its modules has computed their inputs' gradients (:meth:`post_backward`).
- step: the gathered copy is stale (:meth:`after_step`), the gradients are forgotten (:meth:`zero_grads`).

The root (:class:`~.root.ZeroRoot`) owns the units of a model and what they share: the hooks, the traced
order, the bucket pool, the bound on reductions in flight and the one end-of-backward callback.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import List, Optional, Tuple

import torch

from ..comm.collectives import Collectives, CommHandle
from ..comm.quantize import BlockCodec
from ..comm.quantized import quantized_reduce_scatter
from ..plan.decide import reduce_op_for
from .unit import FlatParamUnit, ShardedParamUnit, UnitState


class ReduceOp(enum.Enum):
    ALL_REDUCE = "all_reduce"
    REDUCE_SCATTER = "reduce_scatter"


@dataclass(frozen=True)
class ReducePolicy:
    """How and when gradients are reduced (decided once by the builder from the ZeRO stage)."""

    op: ReduceOp
    every_micro_step: bool  # stage 2-3: reduce each micro-step and keep only the shard
    overlap: bool  # launch asynchronously from the hooks (overlap_comm)
    accum_dtype: torch.dtype  # dtype of buckets and of the accumulated shard
    comm_dtype: torch.dtype  # dtype on the wire
    predivide_factor: float = 1.0  # divide by this before the reduce, by world/this after
    #: ZeRO++'s qgZ: reduce-scatters become all-to-alls of these codes, summed in fp32 (the wire dtype is unused)
    grad_codec: Optional[BlockCodec] = None
    #: ranks of the group whose gradients add up instead of averaging: the sum is divided by world / this
    #: (DeepSpeed's sequence-parallel ranks: its gradients are the sum over them, the mean over data)
    summed_ranks: int = 1

    @classmethod
    def for_stage(cls, stage: int, *, overlap: bool, accum_dtype: torch.dtype, comm_dtype: torch.dtype,
                  predivide_factor: float = 1.0, reduce_scatter: bool = True) -> ReducePolicy:
        """The policy the plan gives ``stage`` outside a pipeline (:func:`shardspeed.plan.decide.reduce_op_for`)."""
        return cls(ReduceOp(reduce_op_for(stage, reduce_scatter)), stage >= 2, overlap, accum_dtype, comm_dtype,
                   predivide_factor)

    def reduce_scatter(self, comm: Collectives, output: torch.Tensor, input: torch.Tensor) -> CommHandle:
        """``input``'s sum over ``comm``, this rank's chunk into ``output`` (as block codes under qgZ)."""
        if self.grad_codec is not None:
            return quantized_reduce_scatter(comm, output, input, self.grad_codec, async_op=self.overlap)
        return comm.reduce_scatter(output, input, async_op=self.overlap)


class TrainingState(enum.Enum):
    """Where in a step a unit is (FSDP2's ``TrainingState``)."""

    IDLE = "idle"
    FORWARD = "forward"  # a module holding it runs its forward
    PRE_BACKWARD = "pre_backward"  # gathered for its backward, gradients still to come
    POST_BACKWARD = "post_backward"  # autograd is done with it in this backward


class ShardedState(enum.Enum):
    """Where a unit's parameters are: only this rank's chunk, on the way, or whole."""

    SHARDED = "sharded"
    GATHERING = "gathering"
    GATHERED = "gathered"


class OwnedUnit:
    """One unit: its storage's gathers and releases, its references, its gradients and their reduction.

    ``comm``: the group the unit is sharded and reduced over (an expert unit's expert-data group, else the
    data group); ``gather_comm``: the collectives its all-gathers use (qwZ's quantizing one, or ``comm``);
    ``secondary``: hpZ's collectives within this rank's node (dense units only)."""

    def __init__(self, unit: FlatParamUnit, comm: Collectives, *, gather_comm: Optional[Collectives] = None,
                 secondary: Optional[Collectives] = None, persistent: bool = False):
        self.unit = unit
        self._sharded = isinstance(unit, ShardedParamUnit)  # stage 3: gathered and released around use
        self.index = unit.index
        self.comm = comm
        self.gather_comm = gather_comm if gather_comm is not None else comm
        self.secondary = secondary
        self.persistent = persistent  # stays gathered once used (param_persistence_threshold)
        self.kept = False  # kept gathered until the step (reshard_after_forward=False)
        self.frozen = not unit.grad_params
        self.training_state = TrainingState.IDLE
        self.refs = 0  # running forwards (and holds) using the unit
        self.backwards_pending = 0  # frozen: forward calls whose post-backward is still to come
        # ---- gradients: the bucket being filled, one in flight, the reduced result since the step ----------
        self.bucket: Optional[torch.Tensor] = None
        self.written: Optional[set] = None  # stages 2-3: parameters whose gradient the bucket holds
        self.sending: Optional[torch.Tensor] = None
        self.wire: Optional[torch.Tensor] = None
        self.handle: Optional[CommHandle] = None
        self.result: Optional[torch.Tensor] = None
        self.launched = False
        self.dirty = False  # the bucket holds gradients not reduced yet
        self.expected: Optional[int] = None  # arrivals in a whole backward, learned from the first one
        self.start_backward()

    # ---- storage -----------------------------------------------------------------------------------
    @property
    def numel(self) -> int:
        return self.unit.numel

    @property
    def sharded_state(self) -> ShardedState:
        if self.unit.state is UnitState.GATHERED:
            return ShardedState.GATHERED
        return ShardedState.GATHERING if self.gathering else ShardedState.SHARDED

    @property
    def gathering(self) -> bool:
        return self._sharded and self.unit.gathering  # type: ignore[attr-defined]

    @property
    def held(self) -> bool:
        """Gathered or on the way (asked for every unit at every gather: kept to two attribute reads)."""
        return self.unit.state is UnitState.GATHERED or (self._sharded and self.unit.gathering)  # type: ignore[attr-defined]

    def start_gather(self) -> None:
        """Issue the unit's all-gather (asynchronously); nothing to do when it is held."""
        if not self.held:
            assert isinstance(self.unit, ShardedParamUnit)
            self.unit.start_gather(self.gather_comm, self.secondary)

    def finish_gather(self) -> None:
        if isinstance(self.unit, ShardedParamUnit) and self.unit.gathering:
            self.unit.finish_gather()

    def release(self) -> None:
        """Free the gathered parameters, unless persistent or kept until the step; hpZ keeps this rank's part
        within its node first."""
        if self.persistent or self.kept or not isinstance(self.unit, ShardedParamUnit):
            return
        if self.secondary is not None:
            self.unit.keep_secondary(self.secondary.topology.shard_rank, self.secondary.world)
        self.unit.release()

    def after_step(self) -> None:
        """The parameters changed: drop every gathered copy, a persistent one included (it is stale)."""
        self.refs = 0
        self.training_state = TrainingState.IDLE
        if isinstance(self.unit, ShardedParamUnit):
            self.finish_gather()
            self.unit.release()
            self.unit.drop_secondary()

    # ---- forward -----------------------------------------------------------------------------------
    def hold(self) -> None:
        self.refs += 1
        self.training_state = TrainingState.FORWARD

    def unhold(self, release: bool = True) -> None:
        """A forward (or hold) lets go; released when it was the last and ``release``."""
        self.refs -= 1
        if self.refs == 0:
            self.training_state = TrainingState.IDLE
            if release:
                self.release()

    def post_backward(self) -> None:
        """Frozen unit: a forward call's backward computed its inputs' gradients. Released once every such
        call has had it."""
        if self.backwards_pending > 0:
            self.backwards_pending -= 1
        if self.backwards_pending == 0 and self.refs == 0:
            self.release()

    # ---- backward: gradients in ----------------------------------------------------------------------
    def start_backward(self) -> None:
        """A backward begins: count arrivals afresh."""
        self.launched = False
        self.counts = [0] * len(self.unit.params)  # arrivals per parameter in this backward
        self.seen = self.arrivals = self.at_round = 0
        self.round = 1  # stage 3 release: arrivals of every parameter counted up to `round`
        self.round_tasks: set = set()  # autograd graph tasks the current round's arrivals came from
        if self.training_state is TrainingState.POST_BACKWARD:
            self.training_state = TrainingState.IDLE

    @property
    def complete(self) -> bool:
        """Every trainable parameter has arrived, as often as a whole backward brings them."""
        return self.seen == len(self.unit.grad_params) and (self.expected is None or self.arrivals >= self.expected)

    def absorb(self, pi: int, grad: torch.Tensor, bucket: torch.Tensor) -> None:
        """Add parameter ``pi``'s gradient into ``bucket`` (the unit's bucket being filled)."""
        view = self.unit.param_view(bucket, pi)
        if self.written is None or pi in self.written:
            view.add_(grad.reshape(-1))
        else:  # the first gradient of this parameter in this bucket: no zeros to add to
            view.copy_(grad.reshape(-1))
            self.written.add(pi)
        self.dirty = True

    def arrived(self, pi: int, track_release: bool) -> bool:
        """Count parameter ``pi``'s gradient hook. Returns whether autograd is done with the unit's parameters
        (stage 3 may release it): each has arrived once more and all those arrivals came from the graph now
        running (a reentrant checkpoint's recomputed segment, or the whole backward; a parameter that arrived
        in an earlier graph may still be used in this one), or the unit is complete."""
        self.arrivals += 1
        self.counts[pi] += 1
        if self.counts[pi] == 1:
            self.seen += 1
        if not track_release:
            return False
        self.round_tasks.add(torch._C._current_graph_task_id())
        if self.counts[pi] == self.round:
            self.at_round += 1
        done = self.expected is not None and self.complete
        if self.at_round == len(self.unit.grad_params):
            done = done or len(self.round_tasks) == 1
            self.round += 1
            self.round_tasks = set()
            self.at_round = sum(1 for i in self.unit.grad_params if self.counts[i] >= self.round)
        if done:
            self.training_state = TrainingState.POST_BACKWARD
        return done

    def learn_expected(self) -> None:
        """At the end of the first whole backward: how many arrivals one brings (more than one per parameter
        under reentrant checkpointing)."""
        if self.expected is None and self.seen == len(self.unit.grad_params):
            self.expected = self.arrivals

    # ---- backward: reduction -------------------------------------------------------------------------
    def take_bucket(self) -> torch.Tensor:
        """Hand the filled bucket over for sending (unwritten parameters and padding zeroed): later gradients
        go into a fresh bucket, never into this one."""
        bucket = self.bucket
        assert bucket is not None
        if self.written is not None:
            for i in range(len(self.unit.params)):
                if i not in self.written:
                    self.unit.param_view(bucket, i).zero_()
            bucket[self.unit.layout.numel :].zero_()
            self.written = None
        self.launched, self.dirty = True, False
        self.bucket, self.sending = None, bucket
        return bucket

    def launch(self, policy: ReducePolicy, comm: Collectives) -> None:
        """Reduce the sending bucket over ``comm`` (the unit's own group for an expert unit)."""
        bucket = self.sending
        assert bucket is not None
        dtype = self.unit.wire_dtype or policy.comm_dtype  # torch_autocast: the unit's own lower precision
        wire = bucket if dtype == bucket.dtype or policy.grad_codec else bucket.to(dtype)
        if policy.predivide_factor != 1.0:
            wire.div_(policy.predivide_factor)
        self.wire = wire
        if policy.op is ReduceOp.ALL_REDUCE:
            self.handle = comm.all_reduce(wire, async_op=policy.overlap)
        else:
            lo, hi = self.unit.layout.chunk_range(self.unit.rank)
            self.handle = policy.reduce_scatter(comm, wire[lo:hi], wire)

    def finish_reduce(self, policy: ReducePolicy, divisor: float) -> Optional[torch.Tensor]:
        """Wait for the reduction and average it into the result. Returns the bucket when it is free again
        (stages 2-3: it goes back to the pool), else None."""
        assert self.handle is not None and self.wire is not None and self.sending is not None
        self.handle.wait()
        self.handle = None
        post = divisor / policy.predivide_factor
        lo, hi = self.unit.layout.chunk_range(self.unit.rank)
        reduced = self.wire[lo:hi]  # all-reduce: every rank has the sum, this rank keeps its chunk
        bucket, self.sending, self.wire = self.sending, None, None
        if policy.every_micro_step:  # stages 2-3: a chunk-sized result; full-size buckets are not kept
            self.add_reduced(reduced, 1.0 / post, policy.accum_dtype)
            return bucket
        if self.result is None:  # stages 0-1, first reduction since the step: the bucket holds the result
            if reduced.data_ptr() != bucket[lo:hi].data_ptr() or reduced.dtype != bucket.dtype:
                bucket[lo:hi].copy_(reduced)
            bucket[lo:hi].div_(post)
            self.result = bucket
        else:  # a later backward before the step (rare): add its separately reduced part
            self.result[lo:hi].add_(reduced, alpha=1.0 / post)
        return None

    def add_reduced(self, chunk: torch.Tensor, scale: float, dtype: torch.dtype) -> None:
        """Add a reduced chunk (stages 2-3, or a coalesced group's row) into the chunk-sized result."""
        if self.result is None:
            self.result = torch.zeros(chunk.numel(), dtype=dtype, device=self.unit.device)
        self.result.add_(chunk, alpha=scale)

    # ---- what the optimizer reads ----------------------------------------------------------------------
    def grad_shard(self, every_micro_step: bool) -> Optional[torch.Tensor]:
        """This rank's reduced, averaged gradient chunk (accum dtype), or None if none yet."""
        if self.result is None or every_micro_step:
            return self.result
        lo, hi = self.unit.layout.chunk_range(self.unit.rank)
        return self.result[lo:hi]

    def zero_grads(self, every_micro_step: bool) -> None:
        """After the step: forget the gradients. Stages 2-3 free the reduced chunk (allocated again as the next
        backward reduces); stages 0-1 keep the full buffer as the next bucket."""
        self.dirty = False
        if every_micro_step:
            self.result = self.bucket = None
            return
        if self.bucket is None and self.result is not None:
            self.bucket, self.result = self.result, None
        self.result = None
        if self.bucket is not None:
            self.bucket.zero_()

    def grad_tensors(self) -> List[torch.Tensor]:
        return [t for t in (self.bucket, self.sending, self.result) if t is not None]

    def where(self) -> List[Tuple[int, torch.Tensor]]:
        """(index in the unit, parameter) of each trainable parameter."""
        return [(pi, self.unit.params[pi]) for pi in self.unit.grad_params]

    def __repr__(self) -> str:
        return (f"OwnedUnit({self.index}, {self.sharded_state.value}, {self.training_state.value}, "
                f"refs={self.refs})")
