"""One job: the root of a model's ZeRO units (:class:`ZeroRoot`), which drives every
:class:`~.owned_unit.OwnedUnit` from torch's hooks and owns what the units share.

- A parameter's unit is found through a map the root owns (``id(param)`` to its unit), never through an
  attribute on the tensor.
- Stage 3 (``module`` given): forward pre/post hooks on each unit's module (and on any other module that
  directly holds one of its parameters, e.g. a tied LM head) hold and release the unit; a gradient hook on
  their outputs gathers it again before its backward; every module holding a unit's parameter has its reads
  watched (:mod:`.hooks`), so a released parameter read during a forward or a backward is gathered first (in a
  forward its unit joins the innermost running hooked module's units from then on). Prefetch replays the
  order traced on the first step (:class:`~.gather_order.GatherOrder`); every rank checks that it gathers
  the same units (:class:`~.agreement.GatherAgreements`). ZeRO++: qwZ's quantized gathers, hpZ's secondary
  copies within the node.
- Every stage: a post-accumulate-grad hook on each trainable parameter adds its gradient into its unit's
  bucket (buckets come from a pool the root owns) and drops ``param.grad``. Complete units are reduced
  strictly in one fixed order, the same on every rank (learned from rank 0's first backward), within a bound
  on the buckets alive; small units are reduced together (stages 2-3). The first hook of a backward queues
  the one end-of-backward callback on autograd's engine (as FSDP2 does): it releases what stage 3 still
  holds, launches what is left, waits, and averages. So a backward finishes by itself whoever drives
  autograd (``engine.backward``, ``loss.backward()``, a pipeline schedule).
- Stages 0-2 are the same objects with storage that is never released and no forward hooks.
"""
from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass
from typing import Callable, ContextManager, Dict, List, Optional, Sequence, Tuple

import torch
import torch.nn as nn
from torch.utils._python_dispatch import _disable_current_modes

from ..comm.collectives import Collectives
from ..comm.quantize import BlockCodec
from ..comm.quantized import QuantizedGather
from ..errors import ShardspeedError
from ..mesh.current import CURRENT
from .agreement import GatherAgreements
from .gather_order import BACKWARD, FORWARD, GatherOrder
from .hooks import Undo, flatten_tensors, holders, register_post_backward, watch_parameter_reads, within
from .init import warn_sharded_state_dict
from .owned_unit import OwnedUnit, ReducePolicy, ShardedState, TrainingState
from .reductions import ReductionQueue
from .unit import FlatParamUnit


@dataclass(frozen=True)
class GatherPolicy:
    """Stage 3's gathering, from the plan's sharding section."""

    prefetch_numel: int  # stage3_prefetch_bucket_size
    persistence_numel: int  # stage3_param_persistence_threshold
    max_live_numel: int  # stage3_max_live_parameters
    weight_codec: Optional[BlockCodec] = None  # qwZ
    quantize_frozen_only: bool = False  # qwZ on the units without trainable parameters only


class ZeroRoot:
    """A model's units, their hooks, gather order, bucket pool and reductions in flight."""

    def __init__(self, units: Sequence[FlatParamUnit], collectives: Collectives, policy: ReducePolicy, *,
                 max_buckets: Optional[int] = None, coalesce_numel: int = 0, max_alive_numel: int = 0,
                 epilogue_timer: Callable[[], ContextManager] = nullcontext, module: Optional[nn.Module] = None,
                 owners: Sequence[nn.Module] = (), gather: Optional[GatherPolicy] = None,
                 secondary: Optional[Collectives] = None):
        self.comm = collectives
        self.policy = policy
        self.sharded = module is not None  # stage 3
        quantized = QuantizedGather(collectives, gather.weight_codec) \
            if gather is not None and gather.weight_codec is not None else None  # qwZ
        self.owned = [self._own(u, gather, quantized, secondary if secondary is not None and secondary.world > 1
                                else None) for u in units]
        self._where: Dict[int, Tuple[OwnedUnit, int]] = {
            id(p): (o, pi) for o in self.owned for pi, p in enumerate(o.unit.params)}
        self.reductions = ReductionQueue(self.owned, collectives, policy, max_buckets=max_buckets,
                                         coalesce_numel=coalesce_numel, max_alive_numel=max_alive_numel)
        self._sync_policy: Callable[[], bool] = lambda: True
        self.epilogue_timer = epilogue_timer  # the engine times the end-of-backward wait as backward_allreduce
        self._reduce_now = True
        self._in_backward = False
        self._grads_in_backward = False  # a gradient hook ran in the running backward
        self._arrived = False  # some gradient reached the root since the last step
        self._grad_hooks = [p.register_post_accumulate_grad_hook(self._on_grad)
                            for o in self.owned for _, p in o.where()]
        # ---- stage 3 --------------------------------------------------------------------------------
        self._module = module
        self._owners = list(owners)
        self._gather_policy = gather or GatherPolicy(0, 0, 0)
        self.order = GatherOrder()
        self._agreements = GatherAgreements(collectives, self._module_name)
        self._stack: List[nn.Module] = []  # hooked modules whose (non-recompute) forward is running
        self._in_files = any(u.placement.in_file for u in units)  # offload_param nvme: read ahead
        self._shard_listeners: List[Callable[[int], None]] = []
        self.gather_count = 0
        self.read_gathers = 0  # gathers started by a parameter read (a unit its hooks did not gather)
        self.hooks: list = []  # the forward hooks' handles
        self._needs = self._modules_needing_units() if module is not None else {}
        if module is not None:
            self.install_hooks()
            CURRENT.roots.add(self)  # GatheredParameters finds a parameter's unit by asking the live roots

    def _own(self, unit: FlatParamUnit, gather: Optional[GatherPolicy], quantized: Optional[QuantizedGather],
             secondary: Optional[Collectives]) -> OwnedUnit:
        comm = unit.comm if unit.comm is not None else self.comm  # an expert unit: its expert-data group, exact
        gather_comm: Optional[Collectives] = comm
        if quantized is not None and unit.comm is None and not (gather and gather.quantize_frozen_only
                                                                 and unit.grad_params):
            gather_comm = quantized  # type: ignore[assignment]
        persistent = gather is not None and unit.numel < gather.persistence_numel
        return OwnedUnit(unit, comm, gather_comm=gather_comm, secondary=secondary if unit.comm is None else None,
                         persistent=persistent)

    @property
    def launch_log(self) -> List[Tuple[int, int]]:
        """(unit index, gradient hooks still to come) of each launch in the last backward."""
        return self.reductions.launch_log

    @property
    def coalesce_numel(self) -> int:
        return self.reductions.coalesce_numel

    @property
    def units(self) -> List[FlatParamUnit]:
        return [o.unit for o in self.owned]

    def unit_of(self, param: torch.Tensor) -> Optional[OwnedUnit]:
        """The unit holding ``param``, or None when this root has no such parameter."""
        found = self._where.get(id(param))
        return found[0] if found is not None and found[0].unit.params[found[1]] is param else None

    def set_sync_policy(self, reduce_this_micro_step: Callable[[], bool]) -> None:
        """``reduce_this_micro_step()`` is asked once per backward: whether it ends with a reduction (the
        accumulation boundary, outside ``no_sync``). Stages 2-3 reduce every backward regardless."""
        self._sync_policy = reduce_this_micro_step

    # ---- stage 3: hooks -----------------------------------------------------------------------------
    def install_hooks(self) -> None:
        """(Re-)register the forward hooks, the read watchers and the state-dict warning (removed first, so
        they never run twice). Each module gathers what it learned to need."""
        self.remove_hooks()
        root = self._module
        assert root is not None
        self.hooks.append(root.register_forward_pre_hook(lambda module, args: self.begin_forward()))
        for m, idx in self._needs.items():
            self.hooks.append(m.register_forward_pre_hook(self._make_pre_forward(idx), with_kwargs=True))
            self.hooks.append(m.register_forward_hook(self._make_post_forward(idx)))
        for m in holders(root, self.units):  # type: ignore[arg-type]
            self.hooks.append(Undo(watch_parameter_reads(m, self._on_read)))
        self.hooks.append(root.register_state_dict_post_hook(warn_sharded_state_dict))

    def remove_hooks(self) -> None:
        """Take the forward hooks off (the gradient hooks stay: :meth:`close` removes everything)."""
        for h in self.hooks:
            h.remove()
        self.hooks.clear()

    def close(self) -> None:
        """Take every hook off; GatheredParameters no longer finds these units."""
        CURRENT.roots.discard(self)
        self.remove_hooks()
        for h in self._grad_hooks:
            h.remove()
        self._grad_hooks.clear()

    def external_parameters(self, module: nn.Module) -> List[nn.Parameter]:
        """Parameters ``module``'s hooks gather that it does not hold (DeepSpeed's external parameters)."""
        own = {id(p) for p in module.parameters()}
        return [p for i in self._needs.get(module, []) for p in self.owned[i].unit.params if id(p) not in own]

    def _modules_needing_units(self) -> Dict[nn.Module, List[int]]:
        """Which units each hooked module gathers: its own, those of parameters it holds directly from
        elsewhere (a tied LM head), none for the root (hooked to track the forward)."""
        assert self._module is not None
        needs: Dict[nn.Module, List[int]] = {self._module: []}
        for o, m in zip(self.owned, self._owners):
            needs.setdefault(m, []).append(o.index)
        for m in self._module.modules():
            for mp in m._parameters.values():
                found = self.unit_of(mp) if mp is not None else None
                if found is None or within(m, self._owners[found.index]):
                    continue
                if found.index not in needs.setdefault(m, []):
                    needs[m].append(found.index)
        return needs

    def _make_pre_forward(self, indices: List[int]):
        """``indices`` is the module's list in ``_needs`` (read at each call: reads may add to it)."""
        def hook(module, args, kwargs):
            if _recomputing():
                return self._pre_recompute(indices, args, kwargs)
            self._stack.append(module)
            for i in indices:
                self.owned[i].hold()
                self.order.use(i)
                self._gather(i)
            return self._watch_frozen(indices, args, kwargs, count=True)

        return hook

    def _make_post_forward(self, indices: List[int]):
        def hook(module, args, output):
            if _recomputing():
                return output  # the unit stays gathered for the backward that follows (released by it)
            if self._stack and self._stack[-1] is module:
                self._stack.pop()
            for i in indices:
                self.owned[i].unhold(release=not self._needed_again_soon(i, module))
            if torch.is_grad_enabled() and indices:
                tensors = [t for t in flatten_tensors(output) if t.requires_grad]
                if tensors:
                    torch.autograd.graph.register_multi_grad_hook(
                        tensors, lambda grads: self.gather_for_backward(indices), mode="any")
            return output

        return hook

    def _watch_frozen(self, indices: List[int], args, kwargs, count: bool):
        """Frozen units are released by their module's post-backward (no gradient says when autograd is done
        with them): route the forward's inputs through it. ``count``: a forward call (a recompute's call
        registers no extra pending post-backward: its forward call's counted, or never ran with grad)."""
        frozen = [self.owned[i] for i in indices if self.owned[i].frozen]
        if not (torch.is_grad_enabled() and frozen):
            return None
        def post_backward() -> None:
            for o in frozen:
                o.post_backward()

        wrapped, args, kwargs = register_post_backward(args, kwargs, post_backward)
        if not wrapped:
            return None
        if count:
            for o in frozen:
                o.backwards_pending += 1
        return args, kwargs

    def _pre_recompute(self, indices: List[int], args, kwargs):
        """A forward hook inside a backward: activation checkpointing recomputes the module. Gather what is not
        gathered yet and count nothing: the recompute is not a use of the forward's plan and may stop before
        the module's end (its post-forward hook may never run). Released as in any backward."""
        self._begin_backward()
        for i in indices:
            self._gather(i)
        return self._watch_frozen(indices, args, kwargs, count=False)

    def _needed_again_soon(self, index: int, module: nn.Module) -> bool:
        """Keep a unit gathered after its module's forward when gathering it again would be waste: the root
        (its backward comes next) and units the traced forward uses again later (a tied LM head)."""
        if not torch.is_grad_enabled():
            return False
        return module is self._module or self.order.used_again(index)

    def _on_read(self, param: nn.Parameter) -> None:
        """A released parameter is read (``module.weight``). In a forward its unit joins the innermost running
        hooked module's units; in a backward (a recompute, a custom backward) it is gathered as the backward's
        units are. Outside both it stays a placeholder (use GatheredParameters)."""
        o = self.unit_of(param)
        if o is None:
            return
        if self._stack and not _recomputing():
            needs = self._needs[self._stack[-1]]
            if o.index not in needs:
                needs.append(o.index)
                o.hold()  # dropped by that module's post-forward, as its other units' are
                self.order.replan = True  # this forward's traces miss the new use: record them again
            self.read_gathers += 1
            self._gather(o.index)
        elif self._in_backward or _recomputing():
            self._begin_backward()
            self.read_gathers += 1
            self._gather(o.index)

    def _module_name(self, index: int) -> str:
        owner = self._owners[index]
        for name, m in (self._module.named_modules() if self._module is not None else ()):
            if m is owner:
                return f"module '{name}'" if name else "the root module"
        return type(owner).__name__

    # ---- stage 3: gathers ---------------------------------------------------------------------------
    def _gather(self, index: int) -> None:
        o = self.owned[index]
        self.order.record(index)
        start = [] if o.held else [index]
        if not (self.order.phase == BACKWARD and not o.frozen):  # a unit's gradient opens its window
            start += self._window(index, start)
        if not start and o.sharded_state is ShardedState.GATHERED:
            return
        # how many gathers a hook issues depends on what is gathered already, which differs between a forward
        # and its recompute: keep them out of any dispatch mode (selective checkpointing counts the ops)
        with _disable_current_modes():
            self._start_gathers(start, index)
            if o.sharded_state is not ShardedState.GATHERED:
                self._agreements.check_before_use(index)
                o.finish_gather()

    def _window(self, index: int, starting: List[int]) -> List[int]:
        gp = self._gather_policy
        if gp.prefetch_numel <= 0:
            return []
        live = sum(o.numel for o in self.owned if o.held) + sum(self.owned[i].numel for i in starting)
        return self.order.window(index, starting, lambda i: self.owned[i].numel, lambda i: self.owned[i].held,
                                 lambda i: self.owned[i].persistent,
                                 min(gp.prefetch_numel, gp.max_live_numel - live))

    def _start_gathers(self, start: List[int], needed: int) -> None:
        """Agree with the other ranks on ``start`` (the units about to be gathered for ``needed``), then
        launch their all-gathers."""
        self._agreements.start(start, needed, self.order.phase, self.owned[needed].unit.device)
        for i in start:
            self.owned[i].start_gather()
            self.gather_count += 1
        if self._in_files:  # offload_param nvme: read the next unit's shard in the background
            nxt = next((i for i in self.order.ahead() if not self.owned[i].held), None)
            if nxt is not None:
                self.owned[nxt].unit.placement.read_ahead()

    def set_reshard_after_forward(self, reshard: bool, modules: Optional[Sequence[nn.Module]] = None) -> None:
        """``reshard=False``: keep the units owned by ``modules`` (default: all) gathered from their first use
        until the optimizer step (FSDP2's ``reshard_after_forward=False``, for pipeline stages). ``True``
        restores per-use gathering."""
        for o, m in zip(self.owned, self._owners):
            if modules is None or any(within(m, x) for x in modules):
                o.kept = not reshard
                if reshard and o.refs == 0:
                    o.release()

    def begin_forward(self) -> None:
        """The root module's forward starts (a pre-forward hook)."""
        self.order.begin(FORWARD)
        self._stack.clear()  # a forward that raised left its modules on the stack

    def invalidate_trace(self) -> None:
        """Forget the recorded gather order: the next forward and backward record it afresh."""
        self.order.invalidate()

    @property
    def trace_invalid(self) -> bool:
        """:meth:`invalidate_trace` ran and no forward has begun recording since."""
        return self.order.invalid

    # ---- holds for computations that take parameters as tensors (zero.gathered.gathered_for_compute) --------
    def hold(self, index: int) -> None:
        """Gather unit ``index`` and hold it, as a running module's forward does, until :meth:`unhold`."""
        self.owned[index].hold()
        self._gather(index)

    def unhold(self, index: int) -> None:
        self.owned[index].unhold()

    def hold_until_gradient(self, index: int) -> None:
        """End a :meth:`hold` without releasing: gathered until the backward has its gradients."""
        self.owned[index].unhold(release=False)

    def gather_for_backward(self, indices: List[int]) -> None:
        """Gather ``indices`` as the running backward's units (released when their gradients are in)."""
        self._begin_backward()
        for i in indices:
            if self.owned[i].training_state is not TrainingState.POST_BACKWARD:
                self.owned[i].training_state = TrainingState.PRE_BACKWARD
                self._gather(i)

    # ---- edits and steps ------------------------------------------------------------------------------
    def add_shard_listener(self, listener: Callable[[int], None]) -> None:
        """``listener(unit_index)`` runs after a unit's shard was rewritten outside the optimizer."""
        self._shard_listeners.append(listener)

    def shard_written(self, index: int) -> None:
        """Unit ``index``'s shard was rewritten (by ``GatheredParameters(modifier_rank=...)``)."""
        self.owned[index].unit.drop_secondary()  # type: ignore[attr-defined]
        for listener in self._shard_listeners:
            listener(index)

    def after_step(self) -> None:
        """Parameters changed: drop every gathered copy, persistent ones included (they are stale)."""
        if self.sharded:
            self._agreements.check_all()
            for o in self.owned:
                o.after_step()

    # ---- the backward -------------------------------------------------------------------------------
    def _begin_backward(self) -> None:
        """The first hook of a backward: decide whether it reduces, reset the units, queue its end."""
        if self._in_backward:
            return
        self._in_backward = True
        self._grads_in_backward = False
        self._reduce_now = self.policy.every_micro_step or bool(self._sync_policy())
        guess = self.sharded and not self.reductions.order_learned  # once the order is learned, no guess
        self.reductions.begin(self.order.backward_guess(len(self.owned)) if guess else None)
        for o in self.owned:
            o.start_backward()
        if self.sharded:
            self.order.begin(BACKWARD)
        # runs when autograd's engine finishes this backward, whoever started it (FSDP2 does the same)
        torch.autograd.Variable._execution_engine.queue_callback(self._end_backward)

    def _on_grad(self, param: torch.Tensor) -> None:
        self._begin_backward()
        self._grads_in_backward = True
        if param.grad is None:
            return
        o, pi = self._where[id(param)]
        self._absorb(o, pi, param)
        if o.arrived(pi, self.sharded):
            o.release()
        self.reductions.arrived(o, self._reduce_now)

    def _absorb(self, o: OwnedUnit, pi: int, param: torch.Tensor) -> None:
        """Add ``param.grad`` into its unit's bucket and drop it."""
        started = o.bucket is None
        if started:
            self.reductions.fill(o)
        assert param.grad is not None
        o.absorb(pi, param.grad, o.bucket)  # type: ignore[arg-type]
        param.grad = None
        self._arrived = True
        if started and self.sharded and self.order.phase == BACKWARD and not o.frozen:
            plan = self._window(o.index, [])  # its first gradient: all-gather the window ahead of it
            if plan:
                with _disable_current_modes():
                    self._start_gathers(plan, o.index)

    def _end_backward(self) -> None:
        """End of a backward (autograd's final callback): release what stage 3 still holds (except units kept
        until the step), freeze the traces, then launch every reduction left in order and wait for them."""
        if not self._in_backward:
            return
        self._in_backward = False
        if self.sharded:
            self._agreements.check_all()
            for o in self.owned:
                o.finish_gather()
                if o.refs == 0:
                    o.release()
                o.backwards_pending = 0  # calls whose post-backward did not run (inputs' gradients unused)
            self.order.freeze()
        if not self._grads_in_backward:
            return
        for o in self.owned:
            o.learn_expected()
        if self._reduce_now:
            with self.epilogue_timer():
                self.reductions.finish_backward()

    def reduce_pending(self) -> None:
        """Before the optimizer step: take in ``.grad`` that no hook saw (assigned by hand), reduce every unit
        holding gradients not reduced yet, and check that some gradient arrived since the last step."""
        for o in self.owned:
            for pi, p in o.where():
                if p.grad is not None:
                    self._absorb(o, pi, p)
        if not self._arrived:
            raise ShardspeedError(
                "step() found no gradients: no backward pass reached the model's parameters since the last "
                "step. Call engine.backward(loss) (or loss.backward()) before engine.step()."
            )
        if any(o.dirty for o in self.owned):  # every rank of the group holds unreduced gradients here
            self.reductions.launch_all_and_wait(again=True)

    # ---- what the optimizer reads -------------------------------------------------------------------------
    def grad_shard(self, unit_index: int) -> Optional[torch.Tensor]:
        """This rank's reduced, averaged gradient chunk of a unit (accum dtype), or None if none yet."""
        return self.owned[unit_index].grad_shard(self.policy.every_micro_step)

    def zero_grads(self) -> None:
        """After the step: forget every gradient (stages 2-3 free their chunks, as FSDP2's
        ``zero_grad(set_to_none=True)``; stages 0-1 keep the full buffer as the next bucket)."""
        self._arrived = False
        for o in self.owned:
            o.zero_grads(self.policy.every_micro_step)

    def held_tensors(self) -> List[torch.Tensor]:
        """The gradient storage held now: spare buckets, coalesced groups in flight, buckets and results."""
        return self.reductions.held_tensors() + [t for o in self.owned for t in o.grad_tensors()]

    def held_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.held_tensors())


def _recomputing() -> bool:
    """A module's forward runs while autograd executes a backward: only activation checkpointing does that
    (reentrant or not). The same test as FSDP2's ``is_bw``."""
    return torch._C._current_graph_task_id() != -1
