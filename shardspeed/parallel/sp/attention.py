"""Attention over a sequence split across the sequence group, in transformers' attention-function form.

``fn(module, query, key, value, attention_mask, **kwargs) -> (output, weights)`` with query ``[b, H, s, d]``
and key/value ``[b, Hk, s, d]`` of this rank's ``s`` tokens; the output is ``[b, s, H, d]``.

- :func:`ulysses_attention`: one all-to-all turns [s/P tokens, H heads] into [all tokens, H/P heads], the
  core attention (sdpa, flash...) runs on whole sequences, a second all-to-all turns it back. P must divide
  H; KV heads are split too, or, with P > Hk, replicated so each rank holds the one its queries use.
- :func:`ring_attention`: every rank keeps all heads; the KV blocks of the group are gathered and each
  query chunk is merged over the key chunks it may see with an online softmax (running max and
  log-sum-exp), so P is bounded by nothing but the sequence. Tokens are in the zigzag layout
  (:mod:`.shard`): chunk r and 2P-1-r on rank r, the same causal work on every rank. Each block is
  recomputed in backward (a block's scores are c x c per head; kept for every block they would be the
  rank's whole share of the attention matrix).
"""
from __future__ import annotations

from typing import Any, Callable, List, Optional, Tuple

import torch
import torch.distributed as dist
from torch.utils.checkpoint import checkpoint

from ...errors import ConfigError
from .comm import all_gather_stacked, all_to_all
from .shard import rank_chunks


class LocalHeads:
    """``module`` as the core attention sees it after the all-to-all: its attributes, but the local
    ratio of query to KV heads (the module itself is left as it is)."""

    def __init__(self, module: Any, num_key_value_groups: int):
        self._module = module
        self.num_key_value_groups = num_key_value_groups

    def __getattr__(self, name: str) -> Any:
        return getattr(self._module, name)


#: set in a module's ``__dict__`` when its attention went through a sequence-parallel function (what the
#: engine's first-forward check reads, see shardspeed.runtime.sequence_parallel.attention_check)
SP_MARK = "_shardspeed_sequence_parallel_attention"


def mark_sequence_parallel(module: Any) -> None:
    """Record that ``module``'s attention ran through a sequence-parallel function."""
    if isinstance(module, torch.nn.Module):
        module.__dict__[SP_MARK] = True


def check_heads(heads: int, kv_heads: int, world: int) -> None:
    """Ulysses' constraint: P divides the query heads, and P divides the KV heads or they divide P."""
    if heads % world:
        raise ConfigError(f"sequence_parallel_size {world} does not divide the {heads} attention heads (Ulysses "
                          f"splits heads); use a divisor of {heads}, or ring attention (no head limit)")
    if kv_heads % world and world % kv_heads:
        raise ConfigError(f"sequence_parallel_size {world} and the {kv_heads} KV heads: one must divide the other")


def ulysses_attention(core: Callable, module: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                      group, **kwargs: Any) -> Tuple[torch.Tensor, None]:
    """Ulysses attention (see the module docstring); ``core`` is transformers' attention function."""
    mark_sequence_parallel(module)
    world = dist.get_world_size(group)
    heads, kv_heads = query.shape[1], key.shape[1]
    check_heads(heads, kv_heads, world)
    if kv_heads < world:  # replicate: KV head j serves the ranks whose queries use it
        key = key.repeat_interleave(world // kv_heads, dim=1)
        value = value.repeat_interleave(world // kv_heads, dim=1)
    q, k, v = (all_to_all(t, 1, 2, group) for t in (query, key, value))  # [b, H/P, S, d]
    if "position_ids" in kwargs and kwargs["position_ids"] is not None:
        with torch.no_grad():
            kwargs["position_ids"] = torch.cat(all_gather_stacked(kwargs["position_ids"], group).unbind(0), dim=1)
    kwargs.pop("is_causal", None)
    out, _ = core(LocalHeads(module, q.shape[1] // k.shape[1]), q, k, v, None, **kwargs)  # [b, S, H/P, d]
    return all_to_all(out, 1, 2, group), None  # [b, s, H, d]


def _block(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
           causal: bool) -> Tuple[torch.Tensor, torch.Tensor]:
    """Attention of query chunk q ``[b, Hk, g, c, d]`` over one key chunk ``[b, Hk, 1, c, d]``: the output
    normalised within the block and its log-sum-exp ``[b, Hk, g, c, 1]``."""
    scores = torch.matmul(q, k.transpose(-1, -2)).float() * scale
    if causal:
        n = scores.shape[-1]
        mask = torch.ones(n, n, dtype=torch.bool, device=scores.device).triu(1)
        scores = scores.masked_fill(mask, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1, keepdim=True)
    probs = torch.exp(scores - lse).to(v.dtype)
    return torch.matmul(probs, v), lse


def _merge(acc: Optional[Tuple[torch.Tensor, torch.Tensor]], out: torch.Tensor,
           lse: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """The online-softmax merge of two blocks' normalised outputs by their log-sum-exps."""
    if acc is None:
        return out.float(), lse
    a_out, a_lse = acc
    new = torch.logaddexp(a_lse, lse)
    return a_out * torch.exp(a_lse - new) + out.float() * torch.exp(lse - new), new


def ring_attention(module: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, group,
                   scaling: Optional[float] = None, dropout: float = 0.0,
                   **kwargs: Any) -> Tuple[torch.Tensor, None]:
    """Exact attention over the group's zigzag-sharded sequence, all heads on every rank."""
    mark_sequence_parallel(module)
    if dropout:
        raise ConfigError("ring attention: attention dropout is not supported (set attention_dropout to 0)")
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    b, heads, s, d = query.shape
    kv_heads = key.shape[1]
    scale = scaling if scaling is not None else d ** -0.5
    causal = bool(getattr(module, "is_causal", True))
    c = s // 2
    kv = all_gather_stacked(torch.stack([key, value]), group)  # [P, 2, b, Hk, s, d]
    chunk_kv: List[Any] = [None] * (2 * world)
    for src in range(world):
        for half, chunk in enumerate(rank_chunks(src, world, "zigzag")):
            chunk_kv[chunk] = kv[src, :, :, :, half * c:(half + 1) * c].unsqueeze(3)  # [2, b, Hk, 1, c, d]
    q = query.reshape(b, kv_heads, heads // kv_heads, s, d)
    outs = []
    for half, chunk in enumerate(rank_chunks(rank, world, "zigzag")):
        qc = q[:, :, :, half * c:(half + 1) * c]
        acc = None
        for other in range(chunk + 1 if causal else 2 * world):
            # recomputed in backward: autograd keeps the block's inputs, not its c x c scores and probabilities
            # (kept, they made the memory O(s x S x H) per rank, the whole attention matrix's share)
            out, lse = checkpoint(_block, qc, chunk_kv[other][0], chunk_kv[other][1], scale,
                                  causal and other == chunk, use_reentrant=False)
            acc = _merge(acc, out, lse)
        assert acc is not None
        outs.append(acc[0])
    out = torch.cat(outs, dim=3).to(query.dtype).view(b, heads, s, d)
    return out.transpose(1, 2).contiguous(), None
