"""Models, data and a plain-torch reference for the tensor-parallel tests (tests/test_tp.py)."""
from __future__ import annotations

import functools
from typing import Dict, List, Tuple

import torch
from models import master_step

VOCAB, SEQ, GLOBAL_BATCH = 64, 16, 8
LR, CLIP, EPS, STEPS = 1e-2, 0.05, 1e-6, 5


class CustomLM(torch.nn.Module):
    """A model no preset knows: split only by ``CUSTOM_PLAN`` (embedding and head stay replicated)."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(VOCAB, 32)
        self.up = torch.nn.Linear(32, 64)
        self.down = torch.nn.Linear(64, 32)
        self.head = torch.nn.Linear(32, VOCAB)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = self.emb(x)
        h = h + self.down(torch.nn.functional.gelu(self.up(h)))
        logits = self.head(h)
        return torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB), y.reshape(-1))


CUSTOM_PLAN = {"layer_specs": [{"patterns": [".*up\\.weight$"], "partition_type": "column"},
                               {"patterns": [".*down$"], "partition_type": "row"}],
               "use_default_specs": False}


def make_tp_model(kind: str, seed: int = 0, **overrides) -> torch.nn.Module:
    """``gpt`` (shardspeed.models.GPT), ``hf`` (Hugging Face GPT-2 from GPT2Config) or ``llama`` (tiny,
    grouped-query attention); dropout 0 unless overridden."""
    torch.manual_seed(seed)
    if kind == "gpt":
        from shardspeed.models.gpt import GPT, GPTConfig

        cfg = dict(vocab_size=VOCAB, block_size=SEQ, n_layer=2, n_head=4, n_embd=32)
        return GPT(GPTConfig(**{**cfg, **overrides}))
    if kind == "custom":
        return CustomLM()
    if kind == "hf":
        from transformers import GPT2Config, GPT2LMHeadModel

        cfg = dict(vocab_size=VOCAB, n_positions=SEQ, n_embd=32, n_layer=2, n_head=4, resid_pdrop=0.0,
                   embd_pdrop=0.0, attn_pdrop=0.0)
        return GPT2LMHeadModel(GPT2Config(**{**cfg, **overrides}))
    if kind == "llama":
        from transformers import LlamaConfig, LlamaForCausalLM

        return LlamaForCausalLM(LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=SEQ,
                                            tie_word_embeddings=False))
    raise ValueError(kind)


def tp_batches(steps: int = STEPS, seed: int = 1) -> List[Tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [(torch.randint(0, VOCAB, (GLOBAL_BATCH, SEQ), generator=g),
             torch.randint(0, VOCAB, (GLOBAL_BATCH, SEQ), generator=g)) for _ in range(steps)]


def lm_loss(kind: str, model, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return model(x, y) if kind in ("gpt", "custom") else model(input_ids=x, labels=y).loss


@functools.cache
def tp_reference(kind: str, dtype: torch.dtype = torch.float32) -> Dict[str, object]:
    """One process: AdamW (eps 1e-6) on fp32 masters of the model computing in ``dtype``, clipping (computed
    once per model and dtype; callers must not modify the result)."""
    model = make_tp_model(kind).to(dtype)
    masters = {n: p.detach().float().clone() for n, p in model.named_parameters()}
    named = dict(model.named_parameters())
    opt = torch.optim.AdamW(list(masters.values()), lr=LR, weight_decay=0.01, eps=EPS, foreach=False)
    losses = []
    for x, y in tp_batches():
        loss = lm_loss(kind, model, x, y)
        losses.append(float(loss.detach()))
        loss.backward()
        master_step(named, masters, opt, CLIP)
    return {"losses": losses, "params": {n: p.detach().float().clone() for n, p in model.named_parameters()}}


def tp_config(tp: int, stage: int, dtype: str = "fp32", sp: bool = False, **extra) -> dict:
    cfg = {"train_batch_size": GLOBAL_BATCH, "gradient_clipping": CLIP,
           "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.01, "eps": EPS}},
           "zero_optimization": {"stage": stage, "reduce_bucket_size": 2000, "stage3_param_persistence_threshold": 0},
           "tensor_parallel": {"autotp_size": tp, "sequence_parallel": sp, **extra}}
    if dtype == "bf16":
        cfg["bf16"] = {"enabled": True}
    if dtype == "fp16":
        cfg["fp16"] = {"enabled": True, "initial_scale_power": 8}
    return cfg


def train_tp(engine, kind: str) -> Tuple[List[float], List[float]]:
    """Five steps of the shared batches, each data-parallel rank its part of the global batch (every rank
    of a tensor-parallel group the same); returns the global mean losses and the gradient norms."""
    import torch.distributed as dist

    dp, r = engine.dp_world_size, engine.mpu.get_data_parallel_rank()
    n = GLOBAL_BATCH // dp
    losses, norms = [], []
    for x, y in tp_batches():
        loss = lm_loss(kind, engine, x[r * n:(r + 1) * n], y[r * n:(r + 1) * n])
        engine.backward(loss)
        engine.step()
        total = loss.detach().float().clone()
        dist.all_reduce(total)  # the tensor-parallel ranks hold equal losses: the world mean is the data mean
        losses.append(float(total) / dist.get_world_size())
        norms.append(float(engine.get_global_grad_norm()))
    return losses, norms


def local_params(engine) -> Dict[str, tuple]:
    """Each parameter's local value (stage 3: gathered over data) and its tensor-parallel slice (or None)."""
    import shardspeed.zero

    with shardspeed.zero.GatheredParameters(list(engine.module.parameters())):
        return {n: (p.detach().float().clone(), getattr(p, "tp_slice", None))
                for n, p in engine.module.named_parameters()}


def full_params(per_rank: List[Dict[str, tuple]], tp: int) -> Dict[str, torch.Tensor]:
    """The full parameters from the local ones of global ranks 0..tp-1 (data rank 0's model group)."""
    from shardspeed.parallel.tp import assemble

    out = {}
    for name, (value, sl) in per_rank[0].items():
        out[name] = value if sl is None else assemble([per_rank[m][name][0] for m in range(tp)], sl)
    return out
