"""A small, clean decoder-only transformer (GPT-2 shape) for examples, tests and benchmarks.

Token + learned position embeddings, pre-LayerNorm blocks (causal self-attention through
``F.scaled_dot_product_attention``, then a GELU MLP), a final LayerNorm and an LM head whose weight is
tied to the token embedding. Blocks live in an ``nn.ModuleList`` of ``Block`` modules so that ZeRO-3 can
treat each block as one parameter unit.

``forward(idx, targets=None)`` returns the mean cross-entropy loss when targets are given, else the
logits ``(B, T, vocab_size)``; the engine calls ``engine(x, y)`` → ``module(x, y)``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from dataclasses import dataclass
from types import MappingProxyType
from typing import Callable, ContextManager, Mapping

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass
class GPTConfig:
    """Shape of a GPT. ``vocab_size`` 256 is the byte-level vocabulary of ``shardspeed.data``."""

    vocab_size: int = 256
    block_size: int = 128  # maximum sequence length (number of learned positions)
    n_layer: int = 4
    n_head: int = 4
    n_embd: int = 256
    dropout: float = 0.0
    bias: bool = True

    def __post_init__(self) -> None:
        if self.n_embd % self.n_head != 0:
            raise ValueError(
                f"n_embd ({self.n_embd}) must be divisible by n_head ({self.n_head})"
            )
        for name in ("vocab_size", "block_size", "n_layer", "n_head", "n_embd"):
            if getattr(self, name) < 1:
                raise ValueError(f"GPTConfig.{name} must be >= 1, got {getattr(self, name)}")

    @classmethod
    def preset(cls, name: str, **overrides) -> GPTConfig:
        """The named preset (see ``PRESETS``), with any field overridden, e.g. ``vocab_size=256``."""
        try:
            base = PRESETS[name]
        except KeyError:
            raise ValueError(
                f"unknown GPT preset {name!r}; choose one of {', '.join(PRESETS)}"
            ) from None
        return dataclasses.replace(base, **overrides)


#: Named shapes. ``tiny`` (~0.2M parameters) is for unit tests, ``small`` (~3.3M) for the example on
#: CPUs; ``gpt2-50m`` and ``gpt2-1.3b`` use GPT-2's 50257-token vocabulary and 1024 positions (the
#: byte-level example overrides ``vocab_size`` to 256).
PRESETS: Mapping[str, GPTConfig] = MappingProxyType({
    "tiny": GPTConfig(vocab_size=256, block_size=64, n_layer=4, n_head=4, n_embd=64),
    "small": GPTConfig(vocab_size=256, block_size=128, n_layer=4, n_head=4, n_embd=256),
    "gpt2-50m": GPTConfig(vocab_size=50257, block_size=1024, n_layer=8, n_head=8, n_embd=512),
    "gpt2-1.3b": GPTConfig(vocab_size=50257, block_size=1024, n_layer=24, n_head=16, n_embd=2048),
})


class CausalSelfAttention(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.n_head = config.n_head
        self.n_embd = config.n_embd
        self.dropout = config.dropout
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd, bias=config.bias)
        self.c_proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.resid_dropout = nn.Dropout(config.dropout)
        #: The RNG context of the attention dropout: tensor parallelism sets its per-rank stream here
        #: (shardspeed.parallel.tp.rng), as this rank then holds n_head / tp of the heads.
        self.rng_fork: Callable[[], ContextManager] = contextlib.nullcontext

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # n_embd and n_head are this rank's under tensor parallelism (the whole model's otherwise)
        q, k, v = self.c_attn(x).split(self.n_embd, dim=2)
        B, T, _ = q.shape
        # (B, T, C) -> (B, n_head, T, head_dim)
        hd = self.n_embd // self.n_head
        q = q.view(B, T, self.n_head, hd).transpose(1, 2)
        k = k.view(B, T, self.n_head, hd).transpose(1, 2)
        v = v.view(B, T, self.n_head, hd).transpose(1, 2)
        p = self.dropout if self.training else 0.0
        # the per-rank stream only where a mask is drawn (swapping generators breaks a torch.compile graph)
        with self.rng_fork() if p > 0 else contextlib.nullcontext():
            y = F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=True)
        y = y.transpose(1, 2).contiguous().view(B, T, self.n_embd)
        return self.resid_dropout(self.c_proj(y))


class MLP(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.c_fc = nn.Linear(config.n_embd, 4 * config.n_embd, bias=config.bias)
        self.gelu = nn.GELU()
        self.c_proj = nn.Linear(4 * config.n_embd, config.n_embd, bias=config.bias)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.c_proj(self.gelu(self.c_fc(x))))


class Block(nn.Module):
    """One pre-LayerNorm transformer block: ``x + attn(ln(x))``, then ``x + mlp(ln(x))``."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.mlp = MLP(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        x = x + self.mlp(self.ln_2(x))
        return x


class GPT(nn.Module):
    """Decoder-only transformer; ``GPT(GPTConfig.preset("small"))``.

    Initialisation is GPT-2's (normal std 0.02, residual projections scaled by 1/sqrt(2·n_layer)) and
    deterministic given ``torch.manual_seed``.
    """

    #: what the library asks of a model without importing it: the blocks activation checkpointing wraps by
    #: default (:func:`shardspeed.checkpointing.wrap.find_blocks`) and the tensor-parallel plan it takes
    #: (:func:`shardspeed.parallel.tp.plan.preset_name`)
    checkpoint_block_types = (Block,)
    tp_preset = "shardspeed_gpt"

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.config = config
        self.wte = nn.Embedding(config.vocab_size, config.n_embd)
        self.wpe = nn.Embedding(config.block_size, config.n_embd)
        self.drop = nn.Dropout(config.dropout)
        self.blocks = nn.ModuleList([Block(config) for _ in range(config.n_layer)])
        self.ln_f = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        # Weight tying: one Parameter shared by the embedding and the head.
        self.lm_head.weight = self.wte.weight

        self.apply(self._init_weights)
        residual_std = 0.02 / math.sqrt(2 * config.n_layer)
        for name, p in self.named_parameters():
            if name.endswith("c_proj.weight"):
                nn.init.normal_(p, mean=0.0, std=residual_std)

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        """``idx``: int64 ``(B, T)`` token ids, ``T <= block_size``.

        Returns the mean cross-entropy loss (a scalar) when ``targets`` (``(B, T)``) is given, else the
        logits ``(B, T, vocab_size)``.
        """
        B, T = idx.shape
        if T > self.config.block_size:
            raise ValueError(
                f"sequence length {T} exceeds block_size {self.config.block_size}; "
                "use shorter windows or a larger block_size"
            )
        pos = torch.arange(T, device=idx.device)
        x = self.drop(self.wte(idx) + self.wpe(pos))
        for block in self.blocks:
            x = block(x)
        if targets is not None and getattr(self.lm_head, "vocab_parallel", False):
            # tensor parallelism: the head returns the loss from vocabulary-parallel logits, never gathered
            return self.lm_head(self.ln_f(x), targets, ignore_index=-1)
        logits = self.lm_head(self.ln_f(x))
        if targets is None:
            return logits
        return F.cross_entropy(
            logits.float().view(-1, logits.size(-1)), targets.reshape(-1), ignore_index=-1
        )

    def num_params(self, non_embedding: bool = False) -> int:
        """Number of distinct parameters (the tied embedding/head weight counted once).

        ``non_embedding=True`` leaves out the position embedding (the token embedding stays in: being
        tied to the LM head, it is used as a matmul weight).
        """
        n = sum(p.numel() for p in self.parameters())  # parameters() de-duplicates tied weights
        if non_embedding:
            n -= self.wpe.weight.numel()
        return n

    def flops_per_token(self, seq_len: int | None = None) -> int:
        """Training FLOPs per token (forward + backward), PaLM appendix B formula.

        ``6·N + 12·L·H·T`` where ``N`` = ``num_params(non_embedding=True)`` (each weight does one
        multiply-add, 2 FLOPs, forward and twice that backward), ``L`` = n_layer, ``H`` = n_embd
        (heads × head_dim) and ``T`` = the sequence length (default ``block_size``): the attention
        scores and the weighted sum, ``2·2·H·T`` per token per layer forward, ×3 for backward.
        Causal masking is not subtracted, as in the usual MFU convention.
        """
        T = self.config.block_size if seq_len is None else seq_len
        cfg = self.config
        return 6 * self.num_params(non_embedding=True) + 12 * cfg.n_layer * cfg.n_embd * T
