"""Gradient reduction for flat units: bucketed, launched from gradient hooks while backward runs.

One :class:`GradientReducer` serves stages 0-2 (and the gradient half of stage 3):

- a post-accumulate-grad hook on each trainable parameter adds ``param.grad`` into its unit's bucket
  (a zero-initialised, full-size flat buffer) and drops ``param.grad``;
- when every trainable parameter of a unit has reported and this micro-step reduces, the unit's bucket
  is reduced asynchronously (``overlap_comm``) or at once: all-reduce at stage 0, reduce-scatter
  (in place, into this rank's chunk) at stages 1-3;
- units are launched strictly in their fixed order, so every rank issues the same collectives in the same
  order even when hooks fire in another order (unused parameters, data-dependent control flow);
- the first hook of a backward queues an end-of-backward callback on autograd's engine (as FSDP2 does),
  which launches what is left, waits, averages over ranks and moves the result to where the optimizer
  reads it. So a backward finishes by itself whoever drives autograd: ``engine.backward``, a plain
  ``loss.backward()``, ``torch.autograd.backward`` on several outputs, or a pipeline schedule;
- :meth:`reduce_pending` (called by the engine at the accumulation boundary, before the optimizer step)
  takes in gradients that no hook saw (``.grad`` assigned by hand, as torch's zero-bubble pipeline
  schedules do) and reduces whatever has not been reduced yet, so every gradient is reduced exactly once
  per boundary; a step with no gradient at all is an error, never a step on zeros.

Where gradients live between micro-steps, per stage (``ReducePolicy``):
stage 0 keeps the full bucket (all-reduced at the boundary), stage 1 keeps the full bucket (reduce-scattered
at the boundary), stages 2-3 reduce-scatter every micro-step into a chunk-sized accumulator and free the
bucket. Once reduced, a unit's result is kept apart from its bucket (``UnitGrads.result``): gradients that
arrive after it (a second backward before the step) go into a fresh bucket and are reduced on their own.
"""
from __future__ import annotations

import enum
import logging
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Callable, ContextManager, Dict, List, Optional, Sequence, Tuple, Union

import torch

from ..comm.collectives import Collectives, CommHandle
from ..comm.quantize import BlockCodec
from ..comm.quantized import quantized_reduce_scatter
from ..errors import ShardspeedError
from ..plan.decide import reduce_op_for
from .grad_records import SmallUnitGroup, UnitGrads, reduction_done
from .unit import FlatParamUnit

logger = logging.getLogger(__name__)


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


class GradientReducer:
    """Reduces unit gradients over the data-parallel group; drives itself from autograd's hooks."""

    def __init__(self, units: Sequence[FlatParamUnit], collectives: Collectives, policy: ReducePolicy,
                 max_buckets: Optional[int] = None, on_unit_ready: Optional[Callable[[int], None]] = None,
                 first_order: Optional[Callable[[], Sequence[int]]] = None,
                 on_unit_started: Optional[Callable[[int], None]] = None,
                 epilogue_timer: Callable[[], ContextManager] = nullcontext, coalesce_numel: int = 0,
                 max_alive_numel: int = 0):
        self.units = list(units)
        self.comm = collectives
        self.policy = policy
        self.world = collectives.world
        self.divisor = float(self.world) / policy.summed_ranks  # the reduced sum is divided by this
        self._grads = [UnitGrads(u) for u in self.units]
        # launch order: units with trainable parameters, in the units' order or as ``first_order()`` guesses a
        # backward produces them (asked at the first backward); re-learned from it (see _learn_order)
        self._first_order = first_order
        self._order: List[int] = [i for i, u in enumerate(self.units) if u.grad_params]
        self._order_learned = False
        self._completion: List[int] = []
        self._where: Dict[int, Tuple[int, int]] = {}
        self._hooks: list = []
        self._reduce_now = True
        self._in_backward = False
        self._arrived = False  # some gradient reached the reducer since the last step
        self._next_launch = 0
        self._in_flight: List[Union[UnitGrads, SmallUnitGroup]] = []
        # stages 2-3: units under coalesce_numel elements are reduced together, in groups of about that size
        # (stage3_units.small_unit_numel); 0: every unit alone
        self.coalesce_numel = int(coalesce_numel) if policy.every_micro_step else 0
        self._small: List[UnitGrads] = []  # launched (in order), waiting for their group to fill
        self._small_numel = 0
        self._pool: Dict[int, List[torch.Tensor]] = {}  # spare stage 2-3 buckets by size
        # stages 2-3 bound the full-size buckets alive at once, in flight or filling (the plan's
        # ``buckets_alive``); None: no bound (stages 0-1 keep them anyway)
        self.max_buckets = max_buckets
        self.max_alive_numel = int(max_alive_numel)  # elements of full-size buckets alive (0: no such bound)
        self.on_unit_ready = on_unit_ready
        self.on_unit_started = on_unit_started  # stage 3: a unit's first gradient has a bucket (prefetch now)
        self._sync_policy: Callable[[], bool] = lambda: True
        #: wraps the end-of-backward launch-and-wait (the engine times it as backward_allreduce)
        self.epilogue_timer = epilogue_timer
        self.launch_log: List[Tuple[int, int]] = []  # (unit index, params still to come in backward)
        self._pending_hooks = 0
        for ui, unit in enumerate(self.units):
            for pi in unit.grad_params:
                p = unit.params[pi]
                self._where[id(p)] = (ui, pi)
                self._hooks.append(p.register_post_accumulate_grad_hook(self._on_grad))

    # ---- wiring -----------------------------------------------------------------------------------
    def set_sync_policy(self, reduce_this_micro_step: Callable[[], bool]) -> None:
        """``reduce_this_micro_step()`` is asked once per backward, at its first gradient: whether this
        backward ends with a reduction (the accumulation boundary, outside ``no_sync``). Stages 2-3 reduce
        every backward regardless. Default: always."""
        self._sync_policy = reduce_this_micro_step

    # ---- the backward pass -------------------------------------------------------------------
    def _begin_backward(self) -> None:
        """At the first gradient of a backward: decide whether it reduces, and queue its end."""
        self._in_backward = True
        if self._first_order is not None and not self._order_learned:  # the same guess on every rank
            self._order = [i for i in self._first_order() if self.units[i].grad_params]
        self._reduce_now = self.policy.every_micro_step or bool(self._sync_policy())
        self._next_launch = 0
        self._pending_hooks = sum(len(u.grad_params) for u in self.units)
        self.launch_log.clear()
        self._completion.clear()
        for g in self._grads:
            g.reset()
        # runs when autograd's engine finishes this backward, whoever started it (FSDP2 does the same)
        torch.autograd.Variable._execution_engine.queue_callback(self.finish_backward)

    def _bucket(self, g: UnitGrads) -> torch.Tensor:
        """The unit's bucket being filled. Stages 2-3 take a fresh one uninitialised (``g.written`` says which
        parameters' views hold gradients; ``g.zero_unwritten`` clears the rest before it is sent); stages
        0-1 keep one zeroed buffer that sums every micro-step."""
        if g.bucket is None:
            n = g.unit.layout.padded_numel
            free = self._pool.get(n)
            fresh = self.policy.every_micro_step
            if free:
                g.bucket = free.pop() if fresh else free.pop().zero_()
            else:
                make = torch.empty if fresh else torch.zeros
                g.bucket = make(n, dtype=self.policy.accum_dtype, device=g.unit.device)
            g.written = set() if fresh else None
        return g.bucket

    def _recycle(self, t: torch.Tensor) -> None:
        """Keep a few freed buckets for the next units of the same size in this backward (transformer
        blocks all match): fewer allocations; buckets in flight plus spares stay within ``max_buckets``, or
        within ``max_alive_numel`` elements (stage 3)."""
        if self.max_alive_numel:
            keep = self._alive_numel() + t.numel() <= self.max_alive_numel
        else:
            keep = len(self._in_flight) + sum(len(v) for v in self._pool.values()) < (self.max_buckets or 0)
        if keep:
            self._pool.setdefault(t.numel(), []).append(t)

    def _alive_numel(self) -> int:
        """Elements of the full-size buckets alive besides those being filled: in flight, and spare."""
        flying = sum(x.wire.numel() if isinstance(x, SmallUnitGroup) else x.unit.layout.padded_numel
                     for x in self._in_flight)
        return flying + sum(n * len(v) for n, v in self._pool.items())

    def _absorb(self, param: torch.Tensor) -> Optional[UnitGrads]:
        """Add ``param.grad`` into its unit's bucket and drop it. Returns the unit's record (None: no grad)."""
        ui, pi = self._where[id(param)]
        g = self._grads[ui]
        grad = param.grad
        if grad is None:
            return None
        started = g.bucket is None
        if started:
            self._make_room(g.unit.layout.padded_numel)
        view = g.unit.param_view(self._bucket(g), pi)
        if g.written is None or pi in g.written:
            view.add_(grad.reshape(-1))
        else:  # the first gradient of this parameter in this bucket: no zeros to add to
            view.copy_(grad.reshape(-1))
            g.written.add(pi)
        param.grad = None
        g.dirty = True
        self._arrived = True
        if started and self.on_unit_started is not None:
            self.on_unit_started(ui)
        return g

    def _on_grad(self, param: torch.Tensor) -> None:
        if not self._in_backward:
            self._begin_backward()
        g = self._absorb(param)
        if g is None:
            return
        ui, pi = self._where[id(param)]
        self._pending_hooks -= 1
        g.arrivals += 1
        g.counts[pi] += 1
        if g.counts[pi] == 1:
            g.seen += 1
        if self.on_unit_ready is not None:
            self._track_release(ui, g, pi)
        if not g.launched and g.complete:
            self._completion.append(ui)
            if self._reduce_now:
                self._launch_ready_prefix()

    def _track_release(self, ui: int, g: UnitGrads, pi: int) -> None:
        """Stage 3: tell the parameter manager when autograd is done with a unit's parameters. That is when
        each has arrived once more and all of those arrivals came from the graph now running (a reentrant
        checkpoint's recomputed segment, or the whole backward): a parameter that arrived in an earlier
        graph may still be used in this one. And in any case once the unit is complete."""
        assert self.on_unit_ready is not None
        g.round_tasks.add(torch._C._current_graph_task_id())
        if g.counts[pi] == g.round:
            g.at_round += 1
        done = g.expected is not None and g.complete
        if g.at_round == len(g.unit.grad_params):
            done = done or len(g.round_tasks) == 1
            g.round += 1
            g.round_tasks = set()
            g.at_round = sum(1 for i in g.unit.grad_params if g.counts[i] >= g.round)
        if done:
            self.on_unit_ready(ui)

    def _launch_ready_prefix(self) -> None:
        """Launch units in fixed order while the next one is complete (same order on every rank)."""
        while self._next_launch < len(self._order):
            g = self._grads[self._order[self._next_launch]]
            if not g.complete:
                return
            self._launch(g)
            self._next_launch += 1

    def _launch(self, g: UnitGrads) -> None:
        if g.launched:
            return
        g.launched = True
        g.dirty = False
        self.launch_log.append((g.unit.index, self._pending_hooks))
        bucket = self._bucket(g)
        g.zero_unwritten(bucket)
        g.bucket, g.sending = None, bucket  # later gradients go into a fresh bucket, never into this one
        n = g.unit.layout.padded_numel
        if n < self.coalesce_numel and self.policy.op is ReduceOp.REDUCE_SCATTER and g.unit.comm is None:
            self._small.append(g)
            self._small_numel += n
            if self._small_numel >= self.coalesce_numel:
                self._flush_small()
            return  # a larger unit may go first: every rank makes the same choices, so the sequence agrees
        pol = self.policy
        wire = bucket if pol.comm_dtype == bucket.dtype or pol.grad_codec else bucket.to(pol.comm_dtype)
        if pol.predivide_factor != 1.0:
            wire.div_(pol.predivide_factor)
        g.wire = wire
        # an expert unit is summed over its expert-data group, and averaged over the whole data group below
        # (every rank's tokens reached some rank's experts), as DeepSpeed does
        comm = g.unit.comm if g.unit.comm is not None else self.comm
        if pol.op is ReduceOp.ALL_REDUCE:
            g.handle = comm.all_reduce(wire, async_op=pol.overlap)
        else:
            lo, hi = g.unit.layout.chunk_range(g.unit.rank)
            g.handle = self._reduce_scatter(wire[lo:hi], wire, comm)
        self._in_flight.append(g)
        self._bound_in_flight()

    def _bound_in_flight(self) -> None:
        self._reap()  # block only past the memory bound
        while self.max_buckets is not None and len(self._in_flight) > self.max_buckets:
            self._complete(self._in_flight.pop(0))

    def _flush_small(self) -> None:
        """Reduce the pending small units in one reduce-scatter (their buckets are copied and released)."""
        if not self._small:
            return
        group, self._small, self._small_numel = self._small, [], 0
        world, rank = self.world, group[0].unit.rank
        sizes = [g.unit.layout.padded_numel // world for g in group]
        dtype = group[0].sending.dtype if self.policy.grad_codec else self.policy.comm_dtype  # type: ignore[union-attr]
        wire = torch.empty(world, sum(sizes), dtype=dtype, device=group[0].unit.device)
        offsets, off = [], 0
        for g, c in zip(group, sizes):
            assert g.sending is not None
            wire[:, off : off + c].copy_(g.sending.view(world, c))
            self._recycle(g.sending)
            g.sending = None
            offsets.append(off)
            off += c
        if self.policy.predivide_factor != 1.0:
            wire.div_(self.policy.predivide_factor)
        handle = self._reduce_scatter(wire[rank], wire.view(-1))
        self._in_flight.append(SmallUnitGroup(group, offsets, sizes, wire, handle))
        self._bound_in_flight()

    def _reduce_scatter(self, output: torch.Tensor, input: torch.Tensor,
                        comm: Optional[Collectives] = None) -> CommHandle:
        comm = comm if comm is not None else self.comm
        if self.policy.grad_codec is not None:
            return quantized_reduce_scatter(comm, output, input, self.policy.grad_codec,
                                            async_op=self.policy.overlap)
        return comm.reduce_scatter(output, input, async_op=self.policy.overlap)

    def _make_room(self, numel: int) -> None:
        """Before a new full-size bucket of ``numel`` elements is filled: finish the reductions already done
        and, at the bound, wait for the oldest in flight, so that buckets in flight plus the new one stay
        within ``max_buckets`` and ``max_alive_numel`` elements (stage 3: one largest unit; a block's
        reduction then overlaps the next block's backward up to its first gradient, and its bucket is
        reused)."""
        self._reap()
        while self._in_flight and self._over_bound(numel):
            self._complete(self._in_flight.pop(0))
        if self.max_alive_numel and self._over_bound(numel):  # spares of other sizes hold the excess: free them
            for n in [n for n in self._pool if n != numel]:
                del self._pool[n]

    def _over_bound(self, numel: int) -> bool:
        """Whether a new bucket of ``numel`` elements would exceed the bound (a spare of that size, which it
        would reuse, is not counted twice)."""
        if self.max_buckets is not None and len(self._in_flight) >= self.max_buckets:
            return True
        if not self.max_alive_numel:
            return False
        reused = numel if self._pool.get(numel) else 0
        return self._alive_numel() - reused + numel > self.max_alive_numel

    def _reap(self) -> None:
        """Stages 2-3: finish the reductions that are already done, without blocking (their buckets go back to
        the pool, so the next unit's bucket reuses one instead of allocating)."""
        while self._in_flight and self.policy.every_micro_step and reduction_done(self._in_flight[0]):
            self._complete(self._in_flight.pop(0))

    def _complete(self, g: Union[UnitGrads, SmallUnitGroup]) -> None:
        """Wait for one reduction and average it into where the optimizer reads it."""
        if isinstance(g, SmallUnitGroup):
            self._complete_group(g)
            return
        assert g.handle is not None and g.wire is not None and g.sending is not None
        g.handle.wait()
        g.handle = None
        post = self.divisor / self.policy.predivide_factor
        lo, hi = g.unit.layout.chunk_range(g.unit.rank)
        reduced = g.wire[lo:hi]  # all-reduce: every rank has the sum, this rank keeps its chunk
        bucket, g.sending, g.wire = g.sending, None, None
        if self.policy.every_micro_step:  # stages 2-3: a chunk-sized result; full-size buckets are not kept
            if g.result is None:
                g.result = torch.zeros(hi - lo, dtype=self.policy.accum_dtype, device=g.unit.device)
            g.result.add_(reduced, alpha=1.0 / post)
            self._recycle(bucket)
        elif g.result is None:  # stages 0-1, first reduction since the step: the bucket holds the result
            if reduced.data_ptr() != bucket[lo:hi].data_ptr() or reduced.dtype != bucket.dtype:
                bucket[lo:hi].copy_(reduced)
            bucket[lo:hi].div_(post)
            g.result = bucket
        else:  # a later backward before the step (rare): add its separately reduced part
            g.result[lo:hi].add_(reduced, alpha=1.0 / post)

    def _complete_group(self, grp: SmallUnitGroup) -> None:
        grp.handle.wait()
        row = grp.wire[grp.members[0].unit.rank]
        scale = self.policy.predivide_factor / self.divisor
        for g, off, c in zip(grp.members, grp.offsets, grp.sizes):
            if g.result is None:
                g.result = torch.zeros(c, dtype=self.policy.accum_dtype, device=g.unit.device)
            g.result.add_(row[off : off + c], alpha=scale)

    def _launch_all_and_wait(self) -> None:
        """Launch, in the fixed order, every unit not sent yet, then every unit that received gradients after
        it was sent (the same units on every rank: they ran the same graph), and wait for all of them."""
        for ui in self._order[self._next_launch :]:
            self._launch(self._grads[ui])
        self._next_launch = len(self._order)
        self._flush_small()
        self._wait_in_flight()
        late = [self._grads[ui] for ui in self._order if self._grads[ui].dirty]
        for g in late:
            g.launched = False
            self._launch(g)
        self._flush_small()
        self._wait_in_flight()
        self._pool.clear()  # spare buckets serve one backward; nothing full-size is kept between steps

    def _wait_in_flight(self) -> None:
        while self._in_flight:
            self._complete(self._in_flight.pop(0))

    def finish_backward(self) -> None:
        """End of a backward (autograd's final callback): launch what is left in order, wait for every
        reduction and average it. A host sync point when reducing; runs on every rank after every backward."""
        if not self._in_backward:
            return
        self._in_backward = False
        for g in self._grads:  # how many arrivals a whole backward brings (more than one per parameter under
            if g.expected is None and g.seen == len(g.unit.grad_params):  # reentrant checkpointing)
                g.expected = g.arrivals
        if self._reduce_now:
            with self.epilogue_timer():
                self._launch_all_and_wait()
            if not self._order_learned:
                self._learn_order()

    def reduce_pending(self) -> None:
        """Before the optimizer step: take in ``.grad`` that no hook saw (assigned by hand) from the
        trainable parameters, reduce every unit that holds gradients not reduced yet, and check that some
        gradient arrived since the last step (a step on zeros is an error, never silent)."""
        for u in self.units:
            for pi in u.grad_params:
                if u.params[pi].grad is not None:
                    self._absorb(u.params[pi])
        if not self._arrived:
            raise ShardspeedError(
                "step() found no gradients: no backward pass reached the model's parameters since the last "
                "step. Call engine.backward(loss) (or loss.backward()) before engine.step()."
            )
        if any(g.dirty for g in self._grads):  # every rank of the group holds unreduced gradients here
            self._next_launch = 0
            for g in self._grads:
                g.launched = False
            self._launch_all_and_wait()

    def _learn_order(self) -> None:
        """Adopt the order in which unit gradients completed in the first backward, as rank 0 saw it.

        Launching in that order lets early units go while backward still runs; taking rank 0's order keeps
        every rank issuing the same collectives in the same sequence. One small broadcast, once.
        """
        self._order_learned = True
        seen = list(dict.fromkeys(self._completion))
        order = seen + [i for i in self._order if i not in seen]
        t = torch.tensor(order, dtype=torch.int64, device=self.units[0].device if self.units else "cpu")
        if self.world > 1 and t.numel():
            self.comm.broadcast(t, 0)
        self._order = [int(i) for i in t.tolist()]

    # ---- what the optimizer reads ---------------------------------------------------------------
    def grad_shard(self, unit_index: int) -> Optional[torch.Tensor]:
        """This rank's reduced, averaged gradient chunk of a unit (accum dtype), or None if none yet."""
        g = self._grads[unit_index]
        if g.result is None:
            return None
        if self.policy.every_micro_step:
            return g.result
        lo, hi = g.unit.layout.chunk_range(g.unit.rank)
        return g.result[lo:hi]

    def zero_grads(self) -> None:
        """After the step: forget every gradient. Stages 2-3 free their reduced chunks (allocated again as the
        next backward reduces, so the gradient shards grow through backward instead of being held from its
        start, as FSDP2's ``zero_grad(set_to_none=True)``); stages 0-1 keep the full buffer as the next
        bucket."""
        self._arrived = False
        for g in self._grads:
            g.dirty = False
            if self.policy.every_micro_step:
                g.result = g.bucket = None
                continue
            if g.bucket is None and g.result is not None:
                g.bucket, g.result = g.result, None
            elif g.result is not None:
                g.result = None
            if g.bucket is not None:
                g.bucket.zero_()

    def held_tensors(self) -> List[torch.Tensor]:
        """The gradient storage held now: spare buckets, coalesced groups in flight, buckets and results."""
        out = [t for free in self._pool.values() for t in free]
        out += [x.wire for x in self._in_flight if isinstance(x, SmallUnitGroup)]
        return out + [t for g in self._grads for t in (g.bucket, g.sending, g.result) if t is not None]

    def held_bytes(self) -> int:
        """Bytes of gradient storage held now (buckets, coalesced groups in flight and results)."""
        return sum(t.numel() * t.element_size() for t in self.held_tensors())

    def remove_hooks(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks.clear()
