"""ALST's tiled compute: a layer run over sequence tiles, so only one tile's intermediates exist at a time.

- :class:`TiledMLP` (DeepSpeed's name and call): the MLP per tile under no_grad in forward, recomputed tile
  by tile in backward;
- :class:`SequenceTiledCompute` / :func:`sequence_tiled_compute`: the same for any function of
  ``[batch, seq, ...]`` keyword tensors;
- :class:`TiledFusedLogitsLoss`: logits and loss per tile, gradients computed in forward, so the full
  ``[seq, vocab]`` logits never exist.

Unlike DeepSpeed's, the parameters a tile uses are inputs of the autograd function: their gradient, summed
over the tiles, arrives once per call, as from an untiled layer, so gradient hooks (ZeRO's reducer) need no
per-tile flags. At ZeRO stage 3 they are gathered (:func:`~shardspeed.zero.gathered.gathered_for_compute`)
before the function is applied (autograd records their whole shapes), held across the tiles of the forward,
and gathered again for the backward's recompute.
"""
from __future__ import annotations

import math
from typing import Any, Callable, Dict, Iterable, List, Optional, Sequence, Tuple

import torch
import torch.nn as nn

from ...errors import ConfigError
from ...zero.gathered import gathered_for_compute


def trainable(module: Optional[nn.Module], params: Optional[Iterable[torch.Tensor]]) -> List[torch.Tensor]:
    """The distinct trainable tensors among ``params`` (default: ``module``'s parameters)."""
    if params is None:
        params = module.parameters() if module is not None else ()
    seen, out = set(), []
    for p in params:
        if p is not None and p.requires_grad and id(p) not in seen:
            seen.add(id(p))
            out.append(p)
    return out


def tile_bounds(length: int, tiles: int) -> List[Tuple[int, int]]:
    """``(start, size)`` of ``tiles`` tiles of ceil(length / tiles) (the last shorter; none empty)."""
    if tiles < 1:
        raise ConfigError(f"tiles (shards) must be >= 1, got {tiles}")
    step = math.ceil(length / tiles)
    return [(a, min(step, length - a)) for a in range(0, length, step)]


class _Tiles(torch.autograd.Function):
    """``call(x_tile, (start, size))`` per tile of ``x`` on ``x_dim``; outputs concatenated on ``out_dim``
    (None: stacked). Backward recomputes each tile with gradients on."""

    @staticmethod
    def forward(ctx: Any, call: Callable, bounds: List[Tuple[int, int]], x_dim: int, out_dim: Optional[int],
                x: torch.Tensor, *params: torch.Tensor) -> torch.Tensor:
        ctx.call, ctx.bounds, ctx.dims, ctx.params = call, bounds, (x_dim, out_dim), params
        ctx.save_for_backward(x)
        with torch.no_grad():
            outs = [call(x.narrow(x_dim, a, n), (a, n)) for a, n in bounds]
        return torch.stack(outs) if out_dim is None else torch.cat(outs, dim=out_dim)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor):
        (x,) = ctx.saved_tensors
        x_dim, out_dim = ctx.dims
        params = list(ctx.params)
        gx = torch.zeros_like(x) if ctx.needs_input_grad[4] else None
        gp: List[Optional[torch.Tensor]] = [None] * len(params)
        with gathered_for_compute(params):  # stage 3: the recompute differentiates against whole weights
            for i, (a, n) in enumerate(ctx.bounds):
                xs = x.narrow(x_dim, a, n).detach().requires_grad_(gx is not None)
                with torch.enable_grad():
                    out = ctx.call(xs, (a, n))
                g = grad[i] if out_dim is None else grad.narrow(out_dim, a, n)
                inputs = ([xs] if gx is not None else []) + params
                grads = list(torch.autograd.grad(out, inputs, g, allow_unused=True))
                if gx is not None:
                    gx.narrow(x_dim, a, n).copy_(grads.pop(0))
                _accumulate(gp, grads)
        return (None, None, None, None, gx, *gp)


def _accumulate(total: List[Optional[torch.Tensor]], grads: Sequence[Optional[torch.Tensor]]) -> None:
    """``total[j] += grads[j]`` where ``grads[j]`` is not None (a None total takes it)."""
    for j, gj in enumerate(grads):
        if gj is not None:
            prev = total[j]
            total[j] = gj if prev is None else prev + gj


class TiledMLP(torch.autograd.Function):
    """``TiledMLP.apply(fn, module, x, shards, compute_params)``: ``fn(module, x_tile)`` per tile of ``x`` on
    dimension -2 (``[batch, seq, hidden]`` or ``[tokens, hidden]``), DeepSpeed's call. ``compute_params``
    (default: the module's parameters) are the weights ``fn`` uses."""

    @classmethod
    def apply(cls, fn: Callable, module: nn.Module, x: torch.Tensor, shards: int,
              compute_params: Optional[Sequence[torch.Tensor]] = None) -> torch.Tensor:
        bounds = tile_bounds(x.shape[-2], int(shards))
        params = trainable(module, compute_params)
        with gathered_for_compute(params):
            return _Tiles.apply(lambda xs, _b: fn(module, xs), bounds, x.dim() - 2, x.dim() - 2, x, *params)


class SequenceTiledCompute(torch.autograd.Function):
    """DeepSpeed's generic tiled compute: ``SequenceTiledCompute.apply(fn, seqlen, shards, keys_to_shard,
    keys_to_pass, grad_requiring_tensor_key, compute_params, output_unshard_dimension, output_reduction,
    *args_to_shard, *args_to_pass)``; see :func:`sequence_tiled_compute`."""

    @classmethod
    def apply(cls, fn: Callable, seqlen: int, shards: int, keys_to_shard: Sequence[str],
              keys_to_pass: Sequence[str], grad_requiring_tensor_key: str,
              compute_params: Optional[Sequence[torch.Tensor]], output_unshard_dimension: int,
              output_reduction: Optional[str], *args: Any) -> torch.Tensor:
        if output_reduction not in (None, "mean", "sum"):
            raise ConfigError(f"output_reduction must be None, 'mean' or 'sum', got {output_reduction!r}")
        sharded = dict(zip(keys_to_shard, args[:len(keys_to_shard)]))
        passed = dict(zip(keys_to_pass, args[len(keys_to_shard):]))
        if grad_requiring_tensor_key not in sharded:
            raise ConfigError(f"grad_requiring_tensor_key {grad_requiring_tensor_key!r} is not among the sharded "
                              f"keys {list(keys_to_shard)}")
        x = sharded.pop(grad_requiring_tensor_key)

        def call(xs: torch.Tensor, bound: Tuple[int, int]) -> torch.Tensor:
            a, n = bound
            tiles: Dict[str, Any] = {k: v.narrow(1, a, n) for k, v in sharded.items()}
            return fn(**{grad_requiring_tensor_key: xs}, **tiles, **passed)

        out_dim = None if output_unshard_dimension == 0 else output_unshard_dimension
        params = trainable(None, compute_params or ())
        with gathered_for_compute(params):
            out = _Tiles.apply(call, tile_bounds(int(seqlen), int(shards)), 1, out_dim, x, *params)
        if output_reduction == "mean":
            return out.mean()
        return out.sum() if output_reduction == "sum" else out


def sequence_tiled_compute(fn: Callable, seqlen: int, shards: int, kwargs_to_shard: Dict[str, torch.Tensor],
                           kwargs_to_pass: Dict[str, Any], grad_requiring_tensor_key: str,
                           compute_params: Optional[Sequence[torch.Tensor]] = None,
                           output_unshard_dimension: int = 1, output_reduction: Optional[str] = "mean"):
    """``fn(**kwargs)`` over ``shards`` tiles of the ``kwargs_to_shard`` tensors (``[batch, seq, ...]``, cut
    on dimension 1); ``kwargs_to_pass`` go to every call as they are. Only ``grad_requiring_tensor_key``'s
    tensor and ``compute_params`` get gradients. Outputs are concatenated on ``output_unshard_dimension``
    (0: stacked, e.g. per-tile losses), then reduced by ``output_reduction`` (None, "mean", "sum")."""
    return SequenceTiledCompute.apply(fn, seqlen, shards, list(kwargs_to_shard), list(kwargs_to_pass),
                                      grad_requiring_tensor_key, compute_params, output_unshard_dimension,
                                      output_reduction, *kwargs_to_shard.values(), *kwargs_to_pass.values())


class _FusedLoss(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, call: Callable, bounds: List[Tuple[int, int]], weight: float, x: torch.Tensor,
                *params: torch.Tensor) -> torch.Tensor:
        gx = torch.zeros_like(x) if x.requires_grad else None
        gp: List[Optional[torch.Tensor]] = [None] * len(params)
        total = torch.zeros((), dtype=torch.float32, device=x.device)
        for a, n in bounds:
            xs = x.narrow(1, a, n).detach().requires_grad_(gx is not None)
            with torch.enable_grad():
                loss = call(xs, (a, n)) * weight
                inputs = ([xs] if gx is not None else []) + list(params)
                grads = list(torch.autograd.grad(loss, inputs, allow_unused=True)) if inputs else []
            total += loss.detach().float()
            if gx is not None:
                gx.narrow(1, a, n).copy_(grads.pop(0))
            _accumulate(gp, grads)
        ctx.grads = (gx, gp)
        return total

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor):
        gx, gp = ctx.grads
        ctx.grads = None
        scale = lambda g: None if g is None else g * grad.to(g.dtype)  # noqa: E731
        return (None, None, None, scale(gx), *(scale(g) for g in gp))


class TiledFusedLogitsLoss(torch.autograd.Function):
    """``TiledFusedLogitsLoss.apply(fn, module, x, y, mask, shards, compute_params, output_reduction)``:
    ``fn(module, x_tile, y_tile[, mask_tile])`` per tile of ``x`` ``[batch, seq, hidden]`` and ``y`` (and
    ``mask`` unless None) on dimension 1; "mean" averages the tiles' results, "sum" adds them (use "sum" with
    an ``fn`` that sums token losses, then divide by the token count: exact with uneven tiles)."""

    @classmethod
    def apply(cls, fn: Callable, module: nn.Module, x: torch.Tensor, y: torch.Tensor,
              mask: Optional[torch.Tensor], shards: int, compute_params: Optional[Sequence[torch.Tensor]] = None,
              output_reduction: str = "mean") -> torch.Tensor:
        if output_reduction not in ("mean", "sum"):
            raise ConfigError(f"output_reduction must be 'mean' or 'sum', got {output_reduction!r}")
        bounds = tile_bounds(x.shape[1], int(shards))

        def call(xs: torch.Tensor, bound: Tuple[int, int]) -> torch.Tensor:
            a, n = bound
            extra = () if mask is None else (mask.narrow(1, a, n),)
            return fn(module, xs, y.narrow(1, a, n), *extra)

        weight = 1.0 / len(bounds) if output_reduction == "mean" else 1.0
        params = trainable(module, compute_params)
        # stage 3: the gradients are computed here, against whole weights, and handed to autograd in the
        # backward, which accumulates them into the parameters: whole until then
        with gathered_for_compute(params, until_gradient=torch.is_grad_enabled()):
            return _FusedLoss.apply(call, bounds, weight, x, *params)
