"""``deepspeed.utils.safe_get_full_fp32_param`` and its siblings: a parameter's full fp32 master weights or
optimizer state, read or written from the parameter alone, at every ZeRO stage.

The engine registers itself (:func:`link_engine`) with the process's one holder, weakly
(:data:`shardspeed.mesh.current.CURRENT`'s ``engines``); a function asks the engines alive whose parameter it
was given (nothing on the tensor points at its engine). A getter assembles the full tensor from the pieces this rank owns (every rank must call it, as in
DeepSpeed: one all-reduce over the data-parallel group when the parameter is sharded); a setter writes this
rank's pieces and, for the weights, refreshes the model's parameters from the masters (a collective too).
``safe_get_full_grad`` reads the reduced gradient the next step will use. Not provided: the gradient setters,
the ``safe_get_local_*`` family, and these
functions with the tiled ``offload_optimizer`` store (Adam/AdamW offload), each with the one-line error.
"""
from __future__ import annotations

from typing import Any, Callable, List, Optional, Tuple

import torch

from ..compat.alias import module_getattr, not_provided
from ..errors import ConfigError
from ..mesh.current import CURRENT


def link_engine(engine: Any) -> None:
    """Let the functions here find ``engine`` from any parameter of its model."""
    CURRENT.engines.add(engine)


def _engine_of(param: torch.Tensor) -> Any:
    """The live engine whose model holds ``param``, else None: a trained parameter through its root's map (one
    look-up), any other (frozen at stages 0-2) by a scan of the model's parameters."""
    engines = list(CURRENT.engines)
    for engine in engines:
        if engine.reducer.unit_of(param) is not None:
            return engine
    for engine in engines:
        if any(p is param for p in engine.module.parameters()):
            return engine
    return None


def _view(param: torch.Tensor, fn: str):
    from ..checkpoint.engine_view import EngineView

    engine = _engine_of(param)
    if engine is None:
        raise ConfigError(f"{fn}: this parameter belongs to no shardspeed engine; call it on a parameter of the "
                          "model passed to initialize()")
    view = EngineView(engine, op=fn)
    if view.tiled is not None:
        raise not_provided(f"deepspeed.utils.{fn} (with offload_optimizer's host store)")
    return view


def _located(view, param: torch.Tensor) -> Optional[Tuple[Any, Tuple[int, ...], List[Any]]]:
    """(unit, full shape, pieces this rank owns) of a trained parameter, or None for one outside the units."""
    name = view.names.get(id(param))
    for unit in view.units:
        for p, shape in zip(unit.params, unit.shapes):
            if p is param:
                pieces = [pc for owned in view.pieces() for pc in owned if pc.name == name]
                return unit, tuple(shape), pieces
    return None


def _assemble(view, unit, shape: Tuple[int, ...], parts: List[Tuple[int, int, torch.Tensor]]) -> torch.Tensor:
    """The full fp32 tensor from this rank's ``(start, end, values)`` parts of it (one all-reduce when the unit
    is sharded: the ranks' parts are disjoint)."""
    numel = 1
    for s in shape:
        numel *= int(s)
    device = parts[0][2].device if parts else unit.shard.device
    full = torch.zeros(numel, dtype=torch.float32, device=device)
    for start, end, values in parts:
        full[start:end] = values.reshape(-1).to(full)
    if unit.layout.world > 1:
        view.comm.all_reduce(full)
    return full.view(shape)


def _get_full(param: torch.Tensor, fn: str, pick: Callable[[Any, Any], Optional[torch.Tensor]]) -> Optional[torch.Tensor]:
    view = _view(param, fn)
    found = _located(view, param)
    if found is None:
        return None
    unit, shape, pieces = found
    parts = [(pc.start, pc.end, pick(view, pc)) for pc in pieces]
    if any(t is None for _, _, t in parts):
        return None
    return _assemble(view, unit, shape, parts)  # type: ignore[arg-type]


def safe_get_full_grad(param: torch.Tensor) -> Optional[torch.Tensor]:
    """The parameter's full gradient as the optimizer step will read it: reduced over the data-parallel ranks
    and averaged, in fp32 (fp16 training: still multiplied by the loss scale, as DeepSpeed's before its step);
    None before a backward at the accumulation boundary has reduced it, or for a parameter not trained."""
    view = _view(param, "safe_get_full_grad")
    found = _located(view, param)
    if found is None:
        return None
    unit, shape, _ = found
    ui = view.units.index(unit)
    grad = view.engine.reducer.grad_shard(ui)
    if grad is None:
        return None
    parts = [(pc.param_start, pc.param_end, grad[pc.chunk_start:pc.chunk_start + pc.numel])
             for pc in view.master.owned_pieces(ui) if unit.params[pc.param_index] is param]
    return _assemble(view, unit, shape, parts)


def _set_full(param: torch.Tensor, value: torch.Tensor, fn: str, put: Callable[[Any, Any, torch.Tensor], None]):
    view = _view(param, fn)
    found = _located(view, param)
    if found is None:
        raise ConfigError(f"{fn}: the parameter is not trained by the engine (frozen or in no optimizer group)")
    _, shape, pieces = found
    if tuple(value.shape) != shape:
        raise ConfigError(f"{fn}: value has shape {tuple(value.shape)}, the parameter {shape}")
    flat = value.detach().reshape(-1)
    for pc in pieces:
        put(view, pc, flat[pc.start:pc.end])
    return view


def safe_get_full_fp32_param(param: torch.Tensor) -> Optional[torch.Tensor]:
    """The parameter's full fp32 master weights (None for a parameter the engine does not train)."""
    return _get_full(param, "safe_get_full_fp32_param", lambda view, pc: pc.master)


def safe_get_full_optimizer_state(param: torch.Tensor, optim_state_key: str) -> Optional[torch.Tensor]:
    """The parameter's full optimizer state ``optim_state_key`` (``"exp_avg"``...), None before the first step."""
    def pick(view, pc):
        return view.optimizer.state.get(pc.master, {}).get(optim_state_key)

    return _get_full(param, "safe_get_full_optimizer_state", pick)


def safe_set_full_fp32_param(param: torch.Tensor, value: torch.Tensor) -> None:
    """Set the parameter's fp32 master weights (and so its low-precision copy) to ``value`` (the full tensor)."""
    view = _set_full(param, value, "safe_set_full_fp32_param", lambda view, pc, v: pc.master.copy_(v.reshape(-1)))
    view.write_back_masters()


def safe_set_full_optimizer_state(param: torch.Tensor, value: torch.Tensor, optim_state_key: str) -> None:
    """Set the parameter's optimizer state ``optim_state_key`` to ``value`` (after the first step: the state exists)."""
    def put(view, pc, v):
        state = view.optimizer.state.get(pc.master, {})
        if optim_state_key not in state:
            raise ConfigError(f"safe_set_full_optimizer_state: no optimizer state {optim_state_key!r} yet "
                              f"(it has {sorted(state)}); take an optimizer step first")
        state[optim_state_key].copy_(v.reshape(state[optim_state_key].shape))

    _set_full(param, value, "safe_set_full_optimizer_state", put)


__getattr__ = module_getattr(__name__)
