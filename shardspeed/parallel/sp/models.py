"""Tiling applied to a model: the MLPs of a transformer (any module with gate/up/down projections or a class
named ``*MLP``) computed in sequence tiles, and a causal LM's head and loss fused per tile."""
from __future__ import annotations

import math
from typing import Any, Callable, List, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from ...errors import ConfigError
from .loss import combine_shard_losses
from .shard import IGNORE_INDEX
from .tiled import TiledFusedLogitsLoss, TiledMLP

_TILED = "_shardspeed_untiled_forward"


def _is_mlp(module: nn.Module) -> bool:
    has_proj = all(hasattr(module, n) for n in ("gate_proj", "up_proj", "down_proj"))
    return has_proj or type(module).__name__.endswith("MLP")


def enable_tiled_mlp(model: nn.Module, shards: Optional[int] = None) -> List[nn.Module]:
    """Every MLP of ``model`` computes in tiles: ``shards`` tiles, or (None) ceil(seq / hidden) as
    DeepSpeed's example picks. The forward is replaced on the instance (hooks, names and state dicts stay).
    Returns the MLPs."""
    mlps = [m for m in model.modules() if _is_mlp(m) and not any(_is_mlp(c) for c in m.children())]
    if not mlps:
        raise ConfigError(f"enable_tiled_mlp: {type(model).__name__} has no MLP module (gate_proj/up_proj/"
                          f"down_proj, or a class named *MLP)")
    for m in mlps:
        if _TILED in m.__dict__:
            continue
        original: Callable = m.forward
        m.__dict__[_TILED] = original

        def tiled(x: torch.Tensor, _orig: Callable = original, _m: nn.Module = m) -> torch.Tensor:
            n = shards if shards is not None else max(1, math.ceil(x.shape[-2] / x.shape[-1]))
            return TiledMLP.apply(lambda _self, xs: _orig(xs), _m, x, n, None)

        m.forward = tiled
    return mlps


def disable_tiled_mlp(model: nn.Module) -> None:
    """Undo :func:`enable_tiled_mlp`."""
    for m in model.modules():
        if _TILED in m.__dict__:
            del m.__dict__["forward"]
            del m.__dict__[_TILED]


def _head(model: nn.Module) -> nn.Module:
    get = getattr(model, "get_output_embeddings", None)
    head = get() if callable(get) else getattr(model, "lm_head", None)
    if not isinstance(head, nn.Module):
        raise ConfigError(f"{type(model).__name__} has no output embedding (lm_head) for the fused loss")
    return head


def causal_lm_loss(model: nn.Module, hidden_states: torch.Tensor, shift_labels: torch.Tensor, group: Any,
                   shards: int = 1, ignore_index: int = IGNORE_INDEX) -> torch.Tensor:
    """The group's mean token loss of a causal LM from its last hidden states ``[b, s, h]`` (this rank's
    tokens) and ``shift_labels``: the head and cross entropy per tile (``shards`` > 1: the full logits never
    exist), summed, then combined over the sequence group by token count."""
    head = _head(model)

    def tile_loss(module: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        logits = module(x).float()
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1), ignore_index=ignore_index,
                               reduction="sum")

    labels = shift_labels.to(hidden_states.device)
    if shards > 1:
        loss_sum = TiledFusedLogitsLoss.apply(tile_loss, head, hidden_states, labels, None, shards, None, "sum")
    else:
        loss_sum = tile_loss(head, hidden_states, labels)
    return combine_shard_losses(loss_sum, labels, group, ignore_index)
