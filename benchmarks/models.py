"""Models and data for the benchmarks: a small MLP, a GPT-style transformer and a Llama-style causal LM.

The GPT comes from ``shardspeed.models.gpt`` when the library has it; until then a local definition of the
same shape (pre-LN blocks in an ``nn.ModuleList`` named ``blocks``, tied embedding / LM head) is used.
The Llama is transformers' ``LlamaForCausalLM`` built from a ``LlamaConfig`` (random weights, nothing
downloaded), optionally wrapped with a PEFT LoRA adapter (``HFCausalLM``; its ``blocks`` are the decoder layers).
Every model takes ``(x, y)`` and returns the mean loss, so every system calls it the same way.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Dict, Tuple

import torch
import torch.nn as nn
import torch.nn.functional as F


class MLP(nn.Module):
    """``depth`` Linear+GELU layers of width ``hidden`` and a regression head (MSE loss)."""

    def __init__(self, d_in: int = 512, hidden: int = 1024, depth: int = 6, d_out: int = 512):
        super().__init__()
        dims = [d_in] + [hidden] * depth
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(a, b), nn.GELU()) for a, b in zip(dims[:-1], dims[1:]))
        self.head = nn.Linear(hidden, d_out)

    def forward(self, x, y):
        for b in self.blocks:
            x = b(x)
        return F.mse_loss(self.head(x), y)


# ---- GPT ---------------------------------------------------------------------------------------------
try:  # the library's example model, once it is on main
    from shardspeed.models.gpt import GPT as _LibGPT, GPTConfig as _LibGPTConfig  # type: ignore

    HAVE_LIB_GPT = True
except Exception:  # pragma: no cover - depends on the branch
    HAVE_LIB_GPT = False


@dataclass
class GPTShape:
    vocab_size: int = 8192
    block_size: int = 128
    n_layer: int = 6
    n_head: int = 8
    n_embd: int = 512


class _Attn(nn.Module):
    def __init__(self, c: GPTShape):
        super().__init__()
        self.n_head, self.n_embd = c.n_head, c.n_embd
        self.c_attn = nn.Linear(c.n_embd, 3 * c.n_embd)
        self.c_proj = nn.Linear(c.n_embd, c.n_embd)

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in self.c_attn(x).split(C, 2))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.c_proj(y.transpose(1, 2).contiguous().view(B, T, C))


class _Block(nn.Module):
    def __init__(self, c: GPTShape):
        super().__init__()
        self.ln_1, self.attn, self.ln_2 = nn.LayerNorm(c.n_embd), _Attn(c), nn.LayerNorm(c.n_embd)
        self.mlp = nn.Sequential(nn.Linear(c.n_embd, 4 * c.n_embd), nn.GELU(), nn.Linear(4 * c.n_embd, c.n_embd))

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class LocalGPT(nn.Module):
    """Fallback GPT-2-shaped model (same structure as ``shardspeed.models.gpt.GPT``)."""

    def __init__(self, c: GPTShape):
        super().__init__()
        self.wte, self.wpe = nn.Embedding(c.vocab_size, c.n_embd), nn.Embedding(c.block_size, c.n_embd)
        self.blocks = nn.ModuleList(_Block(c) for _ in range(c.n_layer))
        self.ln_f = nn.LayerNorm(c.n_embd)
        self.lm_head = nn.Linear(c.n_embd, c.vocab_size, bias=False)
        self.lm_head.weight = self.wte.weight
        for m in self.modules():
            if isinstance(m, (nn.Linear, nn.Embedding)):
                nn.init.normal_(m.weight, std=0.02)
                if getattr(m, "bias", None) is not None:
                    nn.init.zeros_(m.bias)
        for n, p in self.named_parameters():
            if n.endswith("c_proj.weight") or n.endswith("mlp.2.weight"):
                nn.init.normal_(p, std=0.02 / math.sqrt(2 * c.n_layer))

    def forward(self, idx, targets):
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1], device=idx.device))
        for b in self.blocks:
            x = b(x)
        logits = self.lm_head(self.ln_f(x))
        return F.cross_entropy(logits.float().view(-1, logits.size(-1)), targets.reshape(-1))


# ---- Llama (transformers), optionally with LoRA (peft) --------------------------------------------------


class HFCausalLM(nn.Module):
    """A transformers causal LM behind the suite's ``forward(x, y) -> loss``. ``y`` is ``x`` shifted already
    (``make_batch``), so it goes in as ``shift_labels`` (transformers would shift ``labels`` once more)."""

    def __init__(self, lm: nn.Module):
        super().__init__()
        self.lm = lm

    @property
    def blocks(self) -> nn.ModuleList:
        """The decoder layers (not registered twice: read through the wrapped model)."""
        m = self.lm
        if hasattr(m, "get_base_model"):  # a PeftModel
            m = m.get_base_model()
        return m.model.layers

    def forward(self, x, y):
        return self.lm(input_ids=x, labels=y, shift_labels=y).loss


def build_llama(vocab_size: int, block_size: int, n_layer: int, n_head: int, n_embd: int, intermediate: int,
                lora_r: int = 0) -> HFCausalLM:
    """``LlamaForCausalLM`` (fp32, eager attention, untied head, no KV cache); with ``lora_r`` > 0 wrapped by
    PEFT LoRA (rank ``lora_r``, alpha 2r, on q_proj and v_proj, dropout 0): only the adapters train."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=vocab_size, hidden_size=n_embd, intermediate_size=intermediate,
                      num_hidden_layers=n_layer, num_attention_heads=n_head, num_key_value_heads=n_head,
                      max_position_embeddings=block_size, tie_word_embeddings=False, use_cache=False,
                      attn_implementation="eager")
    lm = LlamaForCausalLM(cfg).float()
    if lora_r:
        from peft import LoraConfig, get_peft_model

        lm = get_peft_model(lm, LoraConfig(r=lora_r, lora_alpha=2 * lora_r, lora_dropout=0.0,
                                           target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM"))
    return HFCausalLM(lm)


#: Benchmark model specs: name -> (kind, kwargs). Sizes chosen so the full suite fits in 15 min on 2 cores.
MODELS: Dict[str, dict] = {
    "mlp": dict(kind="mlp", d_in=512, hidden=1024, depth=6, d_out=512, batch=64, timing=(3, 8, 2)),  # ~6.3M params
    "gpt": dict(kind="gpt", vocab_size=8192, block_size=128, n_layer=6, n_head=8, n_embd=512, batch=4,
                timing=(2, 6, 1)),  # ~23M params; timing = (warm-up, blocks, timed steps per block)
    "gpt-quick": dict(kind="gpt", vocab_size=4096, block_size=64, n_layer=4, n_head=4, n_embd=256, batch=8),  # ~4.2M
    "mlp-quick": dict(kind="mlp", d_in=256, hidden=512, depth=4, d_out=256, batch=32),
    "gpt-50m": dict(kind="gpt", vocab_size=16384, block_size=128, n_layer=8, n_head=8, n_embd=640, batch=2,
                    timing=(1, 3, 1)),  # ~50M params (bench_zero: memory first, 3 interleaved rounds of timing)
    # issue 21: Llama-style, 12 layers x 768, 12 heads, MLP 2048, vocabulary 16384, untied head: 109.9M params;
    # "-lora": PEFT LoRA r=8 on q_proj/v_proj (0.29M trainable, the rest frozen)
    "llama-110m": dict(kind="llama", vocab_size=16384, block_size=256, n_layer=12, n_head=12, n_embd=768,
                       intermediate=2048, batch=2),
    "llama-110m-lora": dict(kind="llama", vocab_size=16384, block_size=256, n_layer=12, n_head=12, n_embd=768,
                            intermediate=2048, lora_r=8, batch=2),
}


def build_model(name: str, seed: int = 0) -> nn.Module:
    spec = dict(MODELS[name])
    kind = spec.pop("kind")
    spec.pop("batch")
    spec.pop("timing", None)
    torch.manual_seed(seed)
    if kind == "mlp":
        return MLP(**spec)
    if kind == "llama":
        return build_llama(**spec)
    if HAVE_LIB_GPT:
        cfg = _LibGPTConfig(vocab_size=spec["vocab_size"], block_size=spec["block_size"], n_layer=spec["n_layer"],
                            n_head=spec["n_head"], n_embd=spec["n_embd"])
        return _LibGPT(cfg)
    return LocalGPT(GPTShape(**spec))


def global_batch(name: str, world: int) -> int:
    return MODELS[name]["batch"] * world


def tokens_per_step(name: str, world: int) -> int:
    spec = MODELS[name]
    per_sample = spec["block_size"] if spec["kind"] in ("gpt", "llama") else 1
    return global_batch(name, world) * per_sample


def make_batch(name: str, step: int, world: int, rank: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """Rank ``rank``'s slice of the global batch of step ``step`` (deterministic, independent of the system)."""
    spec = MODELS[name]
    g = torch.Generator().manual_seed(1000 + step)
    gb = global_batch(name, world)
    if spec["kind"] in ("gpt", "llama"):
        data = torch.randint(0, spec["vocab_size"], (gb, spec["block_size"] + 1), generator=g)
        x, y = data[:, :-1], data[:, 1:]
    else:
        x = torch.randn(gb, spec["d_in"], generator=g)
        y = torch.randn(gb, spec["d_out"], generator=g)
    n = gb // world
    return x[rank * n:(rank + 1) * n].contiguous(), y[rank * n:(rank + 1) * n].contiguous()


def num_params(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def num_trainable_params(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters() if p.requires_grad)
