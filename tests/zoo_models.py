"""Models we did not write (torch's TransformerEncoder, transformers' DeBERTa-v2, BERT, T5, Llama + PEFT LoRA,
Mixtral) and small custom modules that use their parameters unusually, for tests/test_model_zoo.py.

Every model is built from a tiny config (no downloads) with dropout 0, so training is deterministic. A
:class:`Spec` says how to build one (seeded), how to make its global batches, its hidden size (for
ShardspeedTrainer's "auto" bucket values) and the parameter count of one of its layers (for the "small"
buckets). ``loss_of(module, batch)`` runs any of them on a batch (a dict of tensors) and returns the loss.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Dict, List

import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.utils.checkpoint

VOCAB, SEQ, HIDDEN = 100, 12, 32


class TorchEncoderLM(nn.Module):
    """nn.TransformerEncoder between an embedding and a linear head. Its MultiheadAttention hands
    ``out_proj.weight`` to F.multi_head_attention_forward and never calls ``out_proj``."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, HIDDEN)
        layer = nn.TransformerEncoderLayer(HIDDEN, 4, 2 * HIDDEN, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.head = nn.Linear(HIDDEN, VOCAB)

    def forward(self, input_ids, labels):
        logits = self.head(self.encoder(self.embed(input_ids)))
        return F.cross_entropy(logits.reshape(-1, VOCAB), labels.reshape(-1))


class Block(nn.Module):
    """Linear, GELU, Linear, LayerNorm, residual."""

    def __init__(self, d: int = HIDDEN):
        super().__init__()
        self.fc1 = nn.Linear(d, 2 * d)
        self.fc2 = nn.Linear(2 * d, d)
        self.ln = nn.LayerNorm(d)

    def forward(self, x):
        return x + self.ln(self.fc2(F.gelu(self.fc1(x))))


class SharedCheckpointedBlock(nn.Module):
    """One Block applied three times in one forward, each time under torch.utils.checkpoint."""

    def __init__(self, reentrant: bool, d_in: int = 16, d_out: int = 8):
        super().__init__()
        self.reentrant = reentrant
        self.inp = nn.Linear(d_in, HIDDEN)
        self.block = Block()
        self.head = nn.Linear(HIDDEN, d_out)

    def forward(self, x, y):
        h = torch.tanh(self.inp(x))
        for _ in range(3):
            h = torch.utils.checkpoint.checkpoint(self.block, h, use_reentrant=self.reentrant)
        return F.mse_loss(self.head(h), y)


class Child(nn.Module):
    """Holds parameters; its parent reads them and never calls it."""

    def __init__(self, d_in: int, d_out: int):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(d_out, d_in) / d_in ** 0.5)
        self.bias = nn.Parameter(torch.randn(d_out) * 0.1)

    def forward(self, x):  # never called
        raise AssertionError("Child.forward is not part of the model")


class ParentReadsChild(nn.Module):
    def __init__(self, d_in: int = 16, d_out: int = 8):
        super().__init__()
        self.proj = nn.Linear(d_in, HIDDEN)
        self.child = Child(HIDDEN, HIDDEN)
        self.head = nn.Linear(HIDDEN, d_out)

    def forward(self, x, y):
        h = torch.tanh(self.proj(x))
        h = F.gelu(F.linear(h, self.child.weight, self.child.bias))
        return F.mse_loss(self.head(h), y)


def _deberta():
    from transformers import DebertaV2Config, DebertaV2ForSequenceClassification

    cfg = DebertaV2Config(vocab_size=VOCAB, hidden_size=HIDDEN, num_hidden_layers=2, num_attention_heads=4,
                          intermediate_size=2 * HIDDEN, max_position_embeddings=64, relative_attention=True,
                          position_buckets=8, max_relative_positions=16, pos_att_type=["p2c", "c2p"],
                          hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, pooler_dropout=0.0,
                          pooler_hidden_size=HIDDEN, num_labels=3, pad_token_id=0)
    return DebertaV2ForSequenceClassification._from_config(cfg, attn_implementation="eager")


def _bert():
    from transformers import BertConfig, BertForMaskedLM

    cfg = BertConfig(vocab_size=VOCAB, hidden_size=HIDDEN, num_hidden_layers=2, num_attention_heads=4,
                     intermediate_size=2 * HIDDEN, max_position_embeddings=64, hidden_dropout_prob=0.0,
                     attention_probs_dropout_prob=0.0, pad_token_id=0)
    return BertForMaskedLM._from_config(cfg, attn_implementation="eager")


def _t5():
    from transformers import T5Config, T5ForConditionalGeneration

    cfg = T5Config(vocab_size=VOCAB, d_model=HIDDEN, d_kv=8, d_ff=2 * HIDDEN, num_layers=2, num_decoder_layers=2,
                   num_heads=4, relative_attention_num_buckets=8, relative_attention_max_distance=16,
                   dropout_rate=0.0, pad_token_id=0, eos_token_id=1, decoder_start_token_id=0)
    return T5ForConditionalGeneration._from_config(cfg, attn_implementation="eager")


def _llama_lora():
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=2 * HIDDEN, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                      attention_dropout=0.0, tie_word_embeddings=False, pad_token_id=0, bos_token_id=1,
                      eos_token_id=2)
    base = LlamaForCausalLM._from_config(cfg, attn_implementation="eager")
    lora = LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["q_proj", "v_proj"], bias="none")
    model = get_peft_model(base, lora)
    # LoRA's B starts at zero, so its A would get no gradient at the first step: start B small instead
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.normal_(0.0, 0.02)
    return model


def _mixtral():
    from transformers import MixtralConfig, MixtralForCausalLM

    cfg = MixtralConfig(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=2 * HIDDEN, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                        num_local_experts=4, num_experts_per_tok=2, output_router_logits=False,
                        router_aux_loss_coef=0.0, router_jitter_noise=0.0, attention_dropout=0.0,
                        tie_word_embeddings=False, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    return MixtralForCausalLM._from_config(cfg, attn_implementation="eager", experts_implementation="eager")


def _tokens(g, n):
    return torch.randint(3, VOCAB, (n, SEQ), generator=g)


def _lm_batch(g, n):
    x = _tokens(g, n)
    return {"input_ids": x, "labels": x.clone()}


def _mlm_batch(g, n):
    return {"input_ids": _tokens(g, n), "labels": _tokens(g, n)}


def _cls_batch(g, n):
    return {"input_ids": _tokens(g, n), "labels": torch.randint(0, 3, (n,), generator=g)}


def _seq2seq_batch(g, n):
    return {"input_ids": _tokens(g, n), "labels": _tokens(g, n)}


def _dense_batch(g, n):
    return {"x": torch.randn(n, SEQ, 16, generator=g), "y": torch.randn(n, SEQ, 8, generator=g)}


@dataclass(frozen=True)
class Spec:
    build: Callable[[], nn.Module]
    batch: Callable[[torch.Generator, int], Dict[str, torch.Tensor]]
    layer: Callable[[nn.Module], nn.Module]  # one layer: its parameter count sizes the "small" buckets
    hidden: int = HIDDEN
    needs: str = ""  # a package the model needs beyond torch


SPECS: Dict[str, Spec] = {
    "torch_encoder": Spec(TorchEncoderLM, _lm_batch, lambda m: m.encoder.layers[0]),
    "deberta_v2": Spec(_deberta, _cls_batch, lambda m: m.deberta.encoder.layer[0], needs="transformers"),
    "bert": Spec(_bert, _mlm_batch, lambda m: m.bert.encoder.layer[0], needs="transformers"),
    "t5": Spec(_t5, _seq2seq_batch, lambda m: m.encoder.block[0], needs="transformers"),
    "llama_lora": Spec(_llama_lora, _lm_batch, lambda m: m.base_model.model.model.layers[0], needs="peft"),
    "mixtral": Spec(_mixtral, _lm_batch, lambda m: m.model.layers[0], needs="transformers"),
    "shared_ckpt_reentrant": Spec(lambda: SharedCheckpointedBlock(True), _dense_batch, lambda m: m.block),
    "shared_ckpt_nonreentrant": Spec(lambda: SharedCheckpointedBlock(False), _dense_batch, lambda m: m.block),
    "parent_reads_child": Spec(ParentReadsChild, _dense_batch, lambda m: m.child),
}


def build(name: str, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return SPECS[name].build()


def batches(name: str, steps: int, global_batch: int, seed: int = 1) -> List[Dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [SPECS[name].batch(g, global_batch) for _ in range(steps)]


def shard(batch: Dict[str, torch.Tensor], rank: int, world: int) -> Dict[str, torch.Tensor]:
    """Rank ``rank``'s equal slice of a global batch."""
    n = next(iter(batch.values())).shape[0] // world
    return {k: v[rank * n:(rank + 1) * n] for k, v in batch.items()}


def loss_of(module, batch: Dict[str, torch.Tensor]) -> torch.Tensor:
    out = module(**batch)
    return out if isinstance(out, torch.Tensor) else out.loss


def layer_numel(name: str, model: nn.Module) -> int:
    return sum(p.numel() for p in SPECS[name].layer(model).parameters())
