"""Splitting a batch on the sequence: pure tensor arithmetic, no process group.

A batch is a dict of ``[batch, seq, ...]`` tensors (``input_ids``, ``labels``, ``position_ids``, masks).
:func:`shard_batch` gives rank ``r`` of ``P`` its part:

- ``labels`` become ``shift_labels`` (shifted by one *before* sharding, -100 at the end): each rank's last
  token predicts the first token of the next rank's shard;
- ``position_ids`` are added when absent (0, 1, ... per sample), so rotary embeddings see global positions;
- a length P does not divide is padded at the end (``pad_token_id``, -100 labels, positions continuing,
  zero masks): under a causal mask the real tokens never see the padding, and its labels count nowhere;
- ``layout="contiguous"``: rank r holds tokens ``[r·S/P, (r+1)·S/P)`` (Ulysses); ``"zigzag"``: the sequence
  is cut in 2P chunks and rank r holds chunks r and 2P-1-r (ring attention's causal load balance: every rank
  then has the same number of visible query-key chunk pairs).
"""
from __future__ import annotations

from typing import Any, Dict, List

import torch

from ...errors import ConfigError

IGNORE_INDEX = -100
LAYOUTS = ("contiguous", "zigzag")


def chunks_per_rank(layout: str) -> int:
    if layout not in LAYOUTS:
        raise ConfigError(f"sequence layout must be one of {LAYOUTS}, got {layout!r}")
    return 1 if layout == "contiguous" else 2


def padded_length(seq_len: int, world: int, layout: str = "contiguous") -> int:
    """The length the sequence is padded to: a multiple of P (contiguous) or 2P (zigzag)."""
    unit = world * chunks_per_rank(layout)
    return -(-seq_len // unit) * unit


def rank_chunks(rank: int, world: int, layout: str = "contiguous") -> List[int]:
    """The chunk indices rank ``rank`` holds, in order (of P chunks, or 2P for zigzag)."""
    return [rank] if chunks_per_rank(layout) == 1 else [rank, 2 * world - 1 - rank]


def _pad(key: str, t: torch.Tensor, extra: int, pad_token_id: int) -> torch.Tensor:
    if extra == 0:
        return t
    if key == "position_ids":
        last = t[:, -1:]
        steps = torch.arange(1, extra + 1, dtype=t.dtype, device=t.device).view(1, -1)
        return torch.cat([t, last + steps], dim=1)
    value = {"input_ids": pad_token_id, "shift_labels": IGNORE_INDEX, "labels": IGNORE_INDEX}.get(key, 0)
    pad = torch.full((t.shape[0], extra, *t.shape[2:]), value, dtype=t.dtype, device=t.device)
    return torch.cat([t, pad], dim=1)


def prepare_full(batch: Dict[str, Any], world: int, layout: str = "contiguous",
                 pad_token_id: int = 0) -> Dict[str, Any]:
    """The whole batch as every rank will see it before taking its part: ``shift_labels`` from ``labels``,
    ``position_ids`` added, every sequence tensor padded to :func:`padded_length`."""
    if "input_ids" not in batch:
        raise ConfigError("a sequence-parallel batch needs input_ids (a [batch, seq] tensor)")
    out = dict(batch)
    ids = out["input_ids"]
    seq = ids.shape[1]
    if "labels" in out:
        labels = out.pop("labels")
        out["shift_labels"] = torch.nn.functional.pad(labels, (0, 1), value=IGNORE_INDEX)[:, 1:].contiguous()
    if "position_ids" not in out:
        out["position_ids"] = torch.arange(seq, device=ids.device).unsqueeze(0).expand(ids.shape[0], -1)
    extra = padded_length(seq, world, layout) - seq
    for key, t in out.items():
        if torch.is_tensor(t) and t.dim() >= 2 and t.shape[1] == seq:
            out[key] = _pad(key, t, extra, pad_token_id)
    return out


def take_shard(full: Dict[str, Any], rank: int, world: int, layout: str = "contiguous") -> Dict[str, Any]:
    """Rank ``rank``'s part of a batch :func:`prepare_full` made."""
    seq = full["input_ids"].shape[1]
    n = world * chunks_per_rank(layout)
    size = seq // n
    out: Dict[str, Any] = {}
    for key, t in full.items():
        if torch.is_tensor(t) and t.dim() >= 2 and t.shape[1] == seq:
            parts = [t[:, c * size:(c + 1) * size] for c in rank_chunks(rank, world, layout)]
            out[key] = (parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)).contiguous()
        else:
            out[key] = t
    return out


def shard_batch(batch: Dict[str, Any], rank: int, world: int, layout: str = "contiguous",
                pad_token_id: int = 0) -> Dict[str, Any]:
    """Rank ``rank``'s part of ``batch`` (see the module docstring)."""
    return take_shard(prepare_full(batch, world, layout, pad_token_id), rank, world, layout)


def unshard(parts: List[torch.Tensor], layout: str = "contiguous") -> torch.Tensor:
    """The whole sequence from every rank's part (in rank order) on dimension 1: the inverse of
    :func:`take_shard` for one tensor (padding kept)."""
    world = len(parts)
    if chunks_per_rank(layout) == 1:
        return torch.cat(parts, dim=1)
    half = parts[0].shape[1] // 2
    chunks: List[Any] = [None] * (2 * world)
    for r, t in enumerate(parts):
        a, b = rank_chunks(r, world, layout)
        chunks[a], chunks[b] = t[:, :half], t[:, half:]
    return torch.cat(chunks, dim=1)
