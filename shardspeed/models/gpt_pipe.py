"""`shardspeed.models.GPT` as pipeline layers: an embedding layer, the same `Block` s, a head layer.

``gpt_layer_specs(config, pipe)`` gives the ``layers`` of a ``PipelineModule`` (``pipe`` is
``shardspeed.pipe`` or ``deepspeed.pipe``: the layers are plain modules, so one script runs under both).
The module names inside the layers are GPT's (``wte``, ``attn.c_attn``, ``mlp.c_fc``, ``lm_head``, ...),
so the ``shardspeed_gpt`` tensor-parallel preset splits them as it splits ``GPT``.

With ``tied=True`` the LM head reuses the token embedding through a `TiedLayerSpec` (one key, ``"embed"``),
as GPT ties ``lm_head.weight`` to ``wte.weight``; the head's matmul is then :func:`tied_head`.
"""
from __future__ import annotations

from types import ModuleType
from typing import Any, List

import torch
import torch.nn as nn
import torch.nn.functional as F

from .gpt import GPT, Block, GPTConfig


class GPTEmbedding(nn.Module):
    """Token + position embeddings and dropout: token ids ``(B, T)`` -> hidden states ``(B, T, C)``."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.wte = nn.Embedding(config.vocab_size, config.n_embd)
        self.wpe = nn.Embedding(config.block_size, config.n_embd)
        self.drop = nn.Dropout(config.dropout)
        self.apply(GPT._init_weights)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(idx.shape[1], device=idx.device)
        return self.drop(self.wte(idx) + self.wpe(pos))


class GPTHead(nn.Module):
    """The final LayerNorm and the LM head: hidden states -> logits ``(B, T, vocab)`` (gathered over the
    tensor-parallel group when the head is split by vocabulary)."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.ln_f = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        self.apply(GPT._init_weights)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.ln_f(x))


def tied_head(embedding: GPTEmbedding, x: torch.Tensor) -> torch.Tensor:
    """The LM head as a use of the tied embedding: logits ``x @ wte.weight.T`` (split by vocabulary under
    tensor parallelism: the slices' logits are gathered)."""
    from ..parallel.tp.layers import VocabParallelEmbedding

    if isinstance(embedding.wte, VocabParallelEmbedding):
        return embedding.wte.logits(x)
    return x @ embedding.wte.weight.t()


def gpt_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross entropy (fp32), as `GPT` computes it."""
    return F.cross_entropy(logits.float().reshape(-1, logits.size(-1)), targets.reshape(-1), ignore_index=-1)


#: The parameters the two uses of the tied embedding share (the head leaves wpe unused).
TIED = ("wte.weight", "wpe.weight")


def gpt_layer_specs(config: GPTConfig, pipe: ModuleType, tied: bool = False) -> List[Any]:
    """The layers of a ``pipe.PipelineModule``: embedding, ``n_layer`` blocks, head (see the module doc)."""
    blocks = [pipe.LayerSpec(Block, config) for _ in range(config.n_layer)]
    if not tied:
        return [pipe.LayerSpec(GPTEmbedding, config), *blocks, pipe.LayerSpec(GPTHead, config)]
    return [pipe.TiedLayerSpec("embed", GPTEmbedding, config, tied_weight_attr=TIED), *blocks,
            pipe.LayerSpec(nn.LayerNorm, config.n_embd, bias=config.bias),
            pipe.TiedLayerSpec("embed", GPTEmbedding, config, forward_fn=tied_head, tied_weight_attr=TIED)]


__all__ = ["GPTEmbedding", "GPTHead", "gpt_layer_specs", "gpt_loss", "tied_head"]
