"""ZeRO stage 3: parameters live as shards and are gathered per unit around their use.

- Units (:func:`~shardspeed.zero.stage3_units.select_units`): the largest called modules that fit under a
  size cap (transformer blocks, typically); the root takes what is left.
- :class:`ParamManager` registers forward pre/post hooks on each unit's module (and on any other module
  that directly holds one of its parameters, e.g. a tied LM head) that gather and release the unit
  (reference-counted), and a gradient hook on those modules' outputs that re-gathers the unit before its
  backward. Correctness does not depend on which module's forward runs: every module holding a unit's
  parameter has its reads watched (:mod:`.hooks`), and a released parameter read during a forward or a
  backward is gathered first; in a forward its unit joins the innermost running hooked module's units, so
  from the next forward on it is gathered (and prefetched) with them.
- A unit is released in backward once autograd is done with it: a unit of trainable parameters when all
  of its gradients have arrived (the reducer says so, then reduce-scatters them: see
  :class:`~.reducer.GradientReducer`), a unit of frozen parameters (units never mix the two) when the
  backward of every forward call of its modules has computed their inputs' gradients (a post-backward
  hook), or at the end of the backward.
- Prefetch: the order units are gathered in is recorded per phase on the first step and replayed: when a
  unit is needed, the next unit (``PREFETCH_UNITS``, within ``prefetch_bucket_size`` elements, units
  already gathered ahead counting) is all-gathered asynchronously.
- Units smaller than ``param_persistence_threshold`` elements stay gathered after first use.
- Gather and release are per use, not per phase: a unit released after its forward frees its gathered
  storage at once even though autograd saved views of it, and the same storage is re-filled before the
  unit's backward (:class:`~.unit.ShardedParamUnit`). Forward of micro-batch k+1 may therefore run before
  backward of micro-batch k (1F1B); each backward ends by itself (an autograd end-of-backward callback).
- ZeRO++: with ``weight_codec`` (qwZ) the gathers of the chosen units carry block-quantized codes (the shards
  and the fp32 masters stay exact); with ``secondary`` (hpZ) a unit released keeps this rank's part of it
  within its node, and every later gather until the parameters change (the step, an edit) runs inside the
  node from those parts, on the values the forward used.
- :meth:`ParamManager.set_reshard_after_forward` keeps chosen units gathered across every forward and
  backward of a step (FSDP2's ``reshard_after_forward=False``), for pipeline stages.
"""
from __future__ import annotations

import logging
from typing import Callable, Dict, List, Optional, Sequence

import torch
import torch.nn as nn
from torch.utils._python_dispatch import _disable_current_modes

from ..comm.collectives import Collectives
from ..comm.quantize import BlockCodec
from ..comm.quantized import QuantizedGather
from .agreement import GatherAgreements
from .hooks import Undo, flatten_tensors, holders, register_post_backward, watch_parameter_reads, within
from .init import warn_sharded_state_dict
from .tags import unit_of
from .unit import ShardedParamUnit, UnitState

logger = logging.getLogger(__name__)


#: units all-gathered ahead of their use at most: with one collective stream, a deeper window overlaps no
#: more communication, it only holds more gathered parameters (DeepSpeed's default 5e7-element prefetch
#: bucket would otherwise keep several transformer blocks gathered)
PREFETCH_UNITS = 1


class ParamManager:
    """Gathers and releases stage-3 units around forward and backward; prefetches in traced order."""

    def __init__(self, units: Sequence[ShardedParamUnit], owners: Sequence[nn.Module], collectives: Collectives,
                 *, prefetch_numel: int, persistence_numel: int, max_live_numel: int, root: nn.Module,
                 weight_codec: Optional[BlockCodec] = None, quantize_frozen_only: bool = False,
                 secondary: Optional[Collectives] = None):
        self.units = list(units)
        self.comm = collectives
        # ZeRO++: qwZ's gather for the units it quantizes (all, or those without trainable parameters)
        self._quantized = QuantizedGather(collectives, weight_codec) if weight_codec is not None else None
        self._quantize = {u.index for u in self.units if not (quantize_frozen_only and u.grad_params)}
        self._secondary = secondary if secondary is not None and secondary.world > 1 else None
        self.prefetch_numel = int(prefetch_numel)
        self.persistent = {u.index for u in self.units if u.numel < persistence_numel}
        self.max_live_numel = int(max_live_numel)
        self._refs: Dict[int, int] = {u.index: 0 for u in self.units}
        self._trace: Dict[str, List[int]] = {}
        self._tracing: Dict[str, List[int]] = {"forward": [], "backward": []}
        self._pos: Dict[str, int] = {"forward": 0, "backward": 0}
        self._phase = "forward"
        self._in_backward = False
        self._grad_done: set = set()
        self._keep: set = set()  # units kept gathered until the step (reshard_after_forward=False)
        self.hooks: list = []  # the registered hooks' handles (remove() each to take a hook off)
        # told when a unit's shard is rewritten outside the optimizer (GatheredParameters' edits): the masters
        self._shard_listeners: List[Callable[[int], None]] = []
        self._root = root
        self._fwd_uses: List[int] = []  # unit uses in order (with repeats) of the first training forward
        self._recording_uses = True
        self._replan = False  # a forward found a unit read outside the modules that gather it: trace again
        self._uses_seen = 0
        self.gather_count = 0
        self._in_files = any(u.placement.in_file for u in self.units)  # offload_param nvme: read ahead
        self.read_gathers = 0  # gathers started by a parameter read (a unit its hooks did not gather)
        self._owners = list(owners)
        # every rank gathers the same units: one small all-reduce per batch of gathers, checked before use
        self._agreements = GatherAgreements(collectives, self._module_name)
        self._stack: List[nn.Module] = []  # hooked modules whose (non-recompute) forward is running
        # frozen units (no trainable parameter: no gradient says when autograd is done with them) are
        # released by their modules' post-backward; forward calls whose post-backward is still to come
        self._frozen = {u.index for u in self.units if not u.grad_params}
        self._bwd_pending: Dict[int, int] = {i: 0 for i in self._frozen}
        self._needs = self._modules_needing_units(root, owners)
        self._trace_invalid = False  # invalidate_trace() ran and no forward has started recording again
        self.install_hooks()

    def install_hooks(self) -> None:
        """(Re-)register the hooks that gather and release units: forward pre/post hooks on the modules that
        need units, the read watchers, the root's state-dict warning. Hooks already registered are removed
        first, so they never run twice. Each module gathers what it learned to need (``_needs``)."""
        self.remove_hooks()
        root = self._root
        self.hooks.append(root.register_forward_pre_hook(lambda module, args: self.begin_forward()))
        for m, idx in self._needs.items():
            self.hooks.append(m.register_forward_pre_hook(self._make_pre_forward(idx), with_kwargs=True))
            self.hooks.append(m.register_forward_hook(self._make_post_forward(idx)))
        for m in holders(root, self.units):
            self.hooks.append(Undo(watch_parameter_reads(m, self._on_read)))
        self.hooks.append(root.register_state_dict_post_hook(warn_sharded_state_dict))

    def external_parameters(self, module: nn.Module) -> List[nn.Parameter]:
        """Parameters ``module``'s hooks gather that it does not hold (DeepSpeed's external parameters)."""
        own = {id(p) for p in module.parameters()}
        return [p for i in self._needs.get(module, []) for p in self.units[i].params if id(p) not in own]

    def _modules_needing_units(self, root: nn.Module, owners: Sequence[nn.Module]) -> Dict[nn.Module, List[int]]:
        """Which units each hooked module gathers: its own units, the units of parameters it holds directly
        from elsewhere (a tied LM head), and none for the root (hooked to track the forward). A read of a
        released parameter during a forward adds its unit to the innermost running module's list."""
        unit_of = {id(p): u.index for u in self.units for p in u.params}
        needs: Dict[nn.Module, List[int]] = {root: []}
        for u, m in zip(self.units, owners):
            needs.setdefault(m, []).append(u.index)
        for m in root.modules():
            for mp in m._parameters.values():
                i = unit_of.get(id(mp)) if mp is not None else None
                if i is None or within(m, owners[i]):
                    continue
                if i not in needs.setdefault(m, []):
                    needs[m].append(i)
        return needs

    # ---- gather / release ------------------------------------------------------------------------
    def _gather(self, index: int) -> None:
        u = self.units[index]
        tr = self._tracing.get(self._phase)
        if tr is not None and index not in tr:
            tr.append(index)
        start = [] if u.state is UnitState.GATHERED or u.gathering else [index]
        if not self._prefetch_waits_for_grad(index):
            start += self._prefetch_plan(index, start)
        if not start and u.state is UnitState.GATHERED:
            return
        # how many gathers (and their small tensors) a hook issues depends on what is gathered already, which
        # differs between a forward and its recompute: keep them out of any dispatch mode (torch's selective
        # activation checkpointing counts the ops it sees and requires the recompute to repeat them)
        with _disable_current_modes():
            self._start_gathers(start, index)
            if u.state is not UnitState.GATHERED:
                self._agreements.check_before_use(index)
                u.finish_gather()

    def _start_gathers(self, start: List[int], needed: int) -> None:
        """Agree with the other ranks on ``start`` (the units about to be gathered for ``needed``), then
        launch their all-gathers."""
        self._agreements.start(start, needed, self._phase, self.units[needed].device)
        for i in start:
            comm = self._quantized if self._quantized is not None and i in self._quantize else self.comm
            own = self.units[i].comm  # an expert unit: gathered over its expert-data group, exact
            self.units[i].start_gather(own if own is not None else comm, self._secondary if own is None else None)
            self.gather_count += 1
        if self._in_files:
            self._read_ahead()

    def _read_ahead(self) -> None:
        """offload_param nvme: start reading the shard of the next unit in traced order not gathered yet, in
        the background, so its gather finds it read (and its checksum checked) instead of reading then."""
        order = self._trace.get(self._phase)
        for nxt in (order or [])[self._pos[self._phase] + 1 :]:
            u = self.units[nxt]
            if u.state is not UnitState.GATHERED and not u.gathering:
                u.placement.read_ahead()
                return

    def _prefetch_plan(self, index: int, starting: List[int]) -> List[int]:
        """The units to all-gather ahead of use after ``index``, from the traced order: the window ahead of
        ``index`` holds at most ``PREFETCH_UNITS`` units and ``prefetch_bucket_size`` elements, units already
        gathered ahead counting in it (the bucket is one fixed buffer, as DeepSpeed's), and stays within
        ``stage3_max_live_parameters`` (``starting`` counted as live)."""
        order = self._trace.get(self._phase)
        if not order or self.prefetch_numel <= 0:
            return []
        try:
            pos = order.index(index, self._pos[self._phase])
        except ValueError:  # a use past its traced position (a tied weight used again): prefetch nothing
            return []  # (each forward and each backward starts its position at 0 again)
        self._pos[self._phase] = pos
        live = sum(u.numel for u in self.units if u.state is UnitState.GATHERED or u.gathering)
        live += sum(self.units[i].numel for i in starting)
        budget = min(self.prefetch_numel, self.max_live_numel - live)  # stage3_max_live_parameters
        plan: List[int] = []
        ahead = 0
        for nxt in order[pos + 1 :]:
            u = self.units[nxt]
            held = u.state is UnitState.GATHERED or u.gathering
            if nxt in starting or nxt in plan or (held and nxt in self.persistent):
                continue  # a persistent unit once gathered stays: not part of the window
            if ahead >= PREFETCH_UNITS or u.numel > budget:
                break
            budget -= u.numel
            ahead += 1
            if not held:
                plan.append(nxt)
        return plan

    def _prefetch_waits_for_grad(self, index: int) -> bool:
        """In backward, the window ahead of a unit with trainable parameters opens at its first gradient
        (:meth:`on_unit_started`), once the previous unit's reduction has finished: a reduction in flight and
        a unit gathered ahead never hold memory at once. Frozen units open it at use."""
        return self._phase == "backward" and index not in self._frozen

    def on_unit_started(self, index: int) -> None:
        """Called by the reducer when the first gradient of unit ``index`` in this backward is collected (into
        the bucket that replaced the previous unit's): all-gather the prefetch window ahead of it."""
        if self._phase != "backward" or index in self._frozen:
            return
        plan = self._prefetch_plan(index, [])
        if plan:
            with _disable_current_modes():
                self._start_gathers(plan, index)

    def _module_name(self, index: int) -> str:
        owner = self._owners[index]
        for name, m in self._root.named_modules():
            if m is owner:
                return f"module '{name}'" if name else "the root module"
        return type(owner).__name__

    def backward_order_guess(self) -> List[int]:
        """The order a backward will likely finish units in, before one has: the reverse of the last forward's
        first uses (a unit is done when the backward reaches its first use), then the units not used."""
        used = list(reversed(self._tracing.get("forward") or self._trace.get("forward", [])))
        seen = set(used)
        return used + [i for i in range(len(self.units) - 1, -1, -1) if i not in seen]

    def _release(self, index: int) -> None:
        if index in self.persistent or index in self._keep:
            return
        if self._secondary is not None and self.units[index].comm is None:  # hpZ: dense units only
            self.units[index].keep_secondary(self._secondary.topology.shard_rank, self._secondary.world)
        self.units[index].release()

    def set_reshard_after_forward(self, reshard: bool, modules: Optional[Sequence[nn.Module]] = None) -> None:
        """``reshard=False``: keep the units owned by ``modules`` (default: all) gathered from their first use
        until the optimizer step, across every micro-batch's forward and backward (FSDP2's
        ``reshard_after_forward=False``: fewer all-gathers for a pipeline stage, at the cost of holding its
        parameters whole). ``True`` restores per-use gathering."""
        chosen = {u.index for u, m in zip(self.units, self._owners)
                  if modules is None or any(within(m, x) for x in modules)}
        if reshard:
            self._keep -= chosen
            for i in chosen:
                if self._refs[i] == 0:
                    self._release(i)
        else:
            self._keep |= chosen

    # ---- hooks -------------------------------------------------------------------------------------
    def _make_pre_forward(self, indices: List[int]):
        """``indices`` is the module's list in ``_needs`` (read at each call: reads may add to it)."""
        def hook(module, args, kwargs):
            if _recomputing():
                return self._pre_recompute(module, indices, args, kwargs)
            self._stack.append(module)
            for i in indices:
                self._refs[i] += 1
                self._uses_seen += 1
                if self._recording_uses:
                    self._fwd_uses.append(i)
                self._gather(i)
            if torch.is_grad_enabled() and any(i in self._frozen for i in indices):
                wrapped, args, kwargs = register_post_backward(args, kwargs, lambda: self._post_backward(indices))
                if wrapped:
                    for i in indices:
                        if i in self._frozen:
                            self._bwd_pending[i] += 1
                    return args, kwargs
            return None

        return hook

    def _needed_again_soon(self, index: int, module: nn.Module) -> bool:
        """Keep a unit gathered after its module's forward when gathering it again would be waste: the root
        (its backward comes next) and units the traced forward uses again later (a tied LM head)."""
        if not torch.is_grad_enabled():
            return False
        if module is self._root:
            return True
        return not self._recording_uses and index in self._fwd_uses[self._uses_seen :]

    def _make_post_forward(self, indices: List[int]):
        def hook(module, args, output):
            if _recomputing():
                return output  # the unit stays gathered for the backward that follows (released by it)
            if self._stack and self._stack[-1] is module:
                self._stack.pop()
            for i in indices:
                self._refs[i] -= 1
                if self._refs[i] == 0 and not self._needed_again_soon(i, module):
                    self._release(i)
            if torch.is_grad_enabled() and indices:
                tensors = [t for t in flatten_tensors(output) if t.requires_grad]
                if tensors:
                    torch.autograd.graph.register_multi_grad_hook(
                        tensors, lambda grads: self._pre_backward(indices), mode="any"
                    )
            return output

        return hook

    def _on_read(self, param: nn.Parameter) -> None:
        """A released parameter is read (``module.weight``). In a forward, its unit joins the innermost running
        hooked module's units (that module gathers it from now on, before its forward and its backward, and
        releases it after); in a backward (a recompute, a custom backward) it is gathered and released as the
        backward's units are. Outside both it stays a placeholder: a read there is not collective (use
        GatheredParameters)."""
        tag = unit_of(param)
        if tag is None or tag.manager is not self:
            return
        index = tag.unit.index
        if self._stack and not _recomputing():
            needs = self._needs[self._stack[-1]]
            if index not in needs:
                needs.append(index)
                self._refs[index] += 1  # dropped by that module's post-forward, as its other units' are
                self._replan = True  # this forward's traces miss the new use: record them again
            self.read_gathers += 1
            self._gather(index)
        elif self._in_backward or _recomputing():
            if not self._in_backward:
                self.begin_backward()
            self.read_gathers += 1
            self._gather(index)

    def _pre_recompute(self, module: nn.Module, indices: List[int], args, kwargs):
        """A forward hook inside a backward: activation checkpointing recomputes the module. Gather what is not
        gathered yet (the unit's pre-backward hook usually did) and count nothing: the recompute is not a use
        of the forward's plan, holds no reference, and may stop before the module's end (torch's early stop),
        so its post-forward hook may never run. The unit is released as in any backward, once its gradients
        are in (or at the end of the backward); frozen units when the recomputed module's inputs have their
        gradients (reentrant checkpointing runs the recomputed graph's own backward)."""
        if not self._in_backward:
            self.begin_backward()
        for i in indices:
            self._gather(i)
        if torch.is_grad_enabled() and any(i in self._frozen for i in indices):
            wrapped, args, kwargs = register_post_backward(args, kwargs, lambda: self._post_backward(indices))
            if wrapped:
                return args, kwargs
        return None

    def _pre_backward(self, indices: List[int]) -> None:
        if not self._in_backward:
            self.begin_backward()
        for i in indices:
            if i not in self._grad_done:
                self._gather(i)

    def _post_backward(self, indices: List[int]) -> None:
        """The gradients of a module's inputs are computed: its frozen units are not needed by this call's
        backward. Released once every forward call that registered a post-backward has had it (a call from a
        recompute registers none: its forward call's post-backward counted, or never ran with grad)."""
        for i in indices:
            if i not in self._frozen:
                continue
            if self._bwd_pending[i] > 0:
                self._bwd_pending[i] -= 1
            if self._bwd_pending[i] == 0 and self._refs[i] == 0:
                self._release(i)

    def add_shard_listener(self, listener: Callable[[int], None]) -> None:
        """``listener(unit_index)`` runs after a unit's shard was rewritten from outside the optimizer (the
        fp32 masters copy it: ``MasterWeights.refresh_from_shard``)."""
        self._shard_listeners.append(listener)

    def shard_written(self, index: int) -> None:
        """Unit ``index``'s shard was rewritten (by ``GatheredParameters(modifier_rank=...)``)."""
        self.units[index].drop_secondary()
        for listener in self._shard_listeners:
            listener(index)

    def on_unit_grads_ready(self, index: int) -> None:
        """Called by the reducer when autograd is done with a unit in this backward (its gradients are in)."""
        self._grad_done.add(index)
        self._release(index)

    # ---- phases (driven by the hooks) --------------------------------------------------------------
    def begin_forward(self) -> None:
        """The root module's forward starts (a pre-forward hook)."""
        self._phase = "forward"
        self._pos["forward"] = 0
        self._uses_seen = 0
        self._trace_invalid = False
        self._stack.clear()  # a forward that raised left its modules on the stack
        if self._replan:  # the last forward read units its modules did not gather: trace this one afresh
            self._replan = False
            self._trace.pop("forward", None)
            self._tracing["forward"] = []
            self._fwd_uses, self._recording_uses = [], True

    def invalidate_trace(self) -> None:
        """Forget the recorded gather order (prefetch replays nothing until it is recorded again): the next
        forward and backward record it afresh, as after the engine was built."""
        self._trace, self._tracing = {}, {"forward": [], "backward": []}
        self._fwd_uses, self._recording_uses = [], True
        self._trace_invalid = True

    @property
    def trace_invalid(self) -> bool:
        """:meth:`invalidate_trace` ran and no forward has begun recording since."""
        return self._trace_invalid

    def begin_backward(self) -> None:
        """The first unit of a backward is needed: queue this backward's end on autograd's engine."""
        self._in_backward = True
        self._phase = "backward"
        self._pos["backward"] = 0
        self._grad_done.clear()
        torch.autograd.Variable._execution_engine.queue_callback(self.end_backward)

    def end_backward(self) -> None:
        """End of a backward (autograd's final callback): release every unit still gathered (except those
        kept until the step) and freeze the traces after the first full step."""
        self._in_backward = False
        self._agreements.check_all()
        for u in self.units:
            if u.gathering:
                u.finish_gather()
            if self._refs[u.index] == 0:
                self._release(u.index)
        for i in self._bwd_pending:  # calls whose post-backward did not run (their inputs' gradients unused)
            self._bwd_pending[i] = 0
        for phase, tr in list(self._tracing.items()):
            if tr and phase not in self._trace:
                self._trace[phase] = list(tr)
        if "forward" in self._trace and "backward" in self._trace:
            self._tracing = {}
        if self._fwd_uses:
            self._recording_uses = False  # the first training forward's sequence of unit uses is the plan
        self._phase = "forward"

    def after_step(self) -> None:
        """Parameters changed: drop every gathered copy, persistent ones included (they are stale)."""
        self._agreements.check_all()
        for u in self.units:
            if u.gathering:
                u.finish_gather()
            self._refs[u.index] = 0
            u.release()
            u.drop_secondary()

    # ---- whole for a computation that takes parameters as tensors (zero.gathered.gathered_for_compute) -----
    def hold(self, index: int) -> None:
        """Gather unit ``index`` and hold it, reference-counted as a running module's forward holds its units,
        until :meth:`unhold`."""
        self._refs[index] += 1
        self._gather(index)

    def unhold(self, index: int) -> None:
        self._refs[index] -= 1
        if self._refs[index] == 0:
            self._release(index)

    def hold_until_gradient(self, index: int) -> None:
        """End a :meth:`hold` without releasing unit ``index``: it stays gathered until the backward has its
        gradients (:meth:`on_unit_grads_ready`), or the backward or the step ends."""
        self._refs[index] -= 1

    def gather_for_backward(self, indices: List[int]) -> None:
        """Gather ``indices`` as the running backward's units (released when their gradients are in)."""
        self._pre_backward(indices)

    def remove_hooks(self) -> None:
        for h in self.hooks:
            h.remove()
        self.hooks.clear()


def _recomputing() -> bool:
    """A module's forward runs while autograd executes a backward: only activation checkpointing does that
    (reentrant or not). The same test as FSDP2's ``is_bw``."""
    return torch._C._current_graph_task_id() != -1
