"""``engine.optimizer.parameter_offload``: DeepSpeed's handle on ZeRO-3's module hooks, over shardspeed's own.

Code written against DeepSpeed takes stage 3's hooks off a model and puts them back through
``engine.optimizer.parameter_offload`` (a ``DeepSpeedZeRoOffload``): TRL generates with a ZeRO-3 model that
way (``trl.models.utils.unwrap_model_for_generation``): inside ``GatheredParameters(model.parameters())`` it
``remove()``-s every handle in ``forward_hooks`` and ``backward_hooks``, empties both lists, generates with
plain torch modules, then calls ``param_coordinator._invalidate_trace()`` and
``_register_deepspeed_module(module)`` to hook the model again. :class:`ParameterOffload` gives those names
their meaning on a :class:`~shardspeed.zero.root.ZeroRoot`:

- ``forward_hooks`` is the manager's list of hook handles (forward pre/post hooks, parameter-read watchers):
  removing them really takes the hooks off, and assigning a list replaces the manager's.
- ``backward_hooks`` is empty: stage 3 registers its backward hooks per forward call, from its forward hooks,
  on that call's outputs, so there is no standing backward hook to remove.
- ``_register_deepspeed_module(module)`` (the engine's module only) registers the manager's hooks again,
  after removing any still registered, and invalidates the gather-order trace as DeepSpeed's does.
- ``param_coordinator.is_invalid_trace()`` / ``_invalidate_trace()``: the manager's traced gather order, which
  prefetch replays; invalidated, the next forward and backward record it afresh.

:func:`attach_parameter_offload` also gives every module of the model DeepSpeed's
``module.ds_external_parameters()``: the ``(name, parameter)`` pairs its hooks gather that it does not hold.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Iterator, List, Optional, Tuple

import torch.nn as nn

from ..errors import ShardspeedError

if TYPE_CHECKING:
    from .root import ZeroRoot

#: the attribute on the engine's optimizer (DeepSpeed's stage-3 optimizer has it)
OFFLOAD_ATTR = "parameter_offload"


class TraceCoordinator:
    """DeepSpeed's ``param_coordinator``, as far as its trace state: over the manager's gather-order trace."""

    def __init__(self, manager: ZeroRoot):
        self._manager = manager

    def is_invalid_trace(self) -> bool:
        return self._manager.trace_invalid

    def _invalidate_trace(self) -> None:
        if self._manager.trace_invalid:  # DeepSpeed refuses the same
            raise RuntimeError("attempted to invalidate already invalid trace")
        self._manager.invalidate_trace()


class ParameterOffload:
    """See the module docstring. ``module`` is the engine's model (the module the hooks are on)."""

    def __init__(self, manager: ZeroRoot, module: nn.Module):
        self._manager = manager
        self.module = module
        self.param_coordinator = TraceCoordinator(manager)
        self._backward_hooks: List[Any] = []

    @property
    def forward_hooks(self) -> list:
        return self._manager.hooks

    @forward_hooks.setter
    def forward_hooks(self, handles: list) -> None:
        self._manager.hooks = list(handles)

    @property
    def backward_hooks(self) -> list:
        return self._backward_hooks

    @backward_hooks.setter
    def backward_hooks(self, handles: list) -> None:
        self._backward_hooks = list(handles)

    def _register_deepspeed_module(self, module: nn.Module) -> None:
        if module is not self.module:
            raise ShardspeedError("parameter_offload._register_deepspeed_module: only the engine's own module can "
                                  "be hooked again (shardspeed's ZeRO-3 hooks are per engine)")
        if not self._manager.trace_invalid:
            self._manager.invalidate_trace()
        self._manager.install_hooks()


class _ExternalParameters:
    """``module.ds_external_parameters()``: the (name, parameter) pairs the module's hooks gather that the
    module does not hold (a tied weight, a parameter its forward reads from elsewhere). A copy or a pickle of
    the module gets an empty one (the copy is not hooked, as its parameter dict is not)."""

    def __init__(self, manager: Optional[ZeroRoot], module: Optional[nn.Module]):
        self._manager, self._module = manager, module

    def __call__(self) -> Iterator[Tuple[int, nn.Parameter]]:
        if self._manager is None or self._module is None:
            return iter(())
        return ((id(p), p) for p in self._manager.external_parameters(self._module))  # DeepSpeed keys by id

    def __deepcopy__(self, memo) -> _ExternalParameters:
        return _ExternalParameters(None, None)  # a copied module is not hooked (no manager comes with it)

    def __reduce__(self):
        return _ExternalParameters, (None, None)


def attach_parameter_offload(optimizer: Any, manager: ZeroRoot, module: nn.Module) -> None:
    """Give ``optimizer`` (the engine's) its ``parameter_offload`` and every module of ``module`` its
    ``ds_external_parameters()``. A forward-only engine (no optimizer) has no ``parameter_offload``."""
    for m in module.modules():
        m.ds_external_parameters = _ExternalParameters(manager, m)  # type: ignore[assignment]
    if optimizer is not None:
        setattr(optimizer, OFFLOAD_ATTR, ParameterOffload(manager, module))
