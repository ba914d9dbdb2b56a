"""A small equivalent of DeepSpeedExamples' training/HelloDeepSpeed/train_bert_ds.py (not a copy).

It calls DeepSpeed the way that script does: no ``init_distributed`` of its own, the device from
``get_accelerator().device_name()`` and ``--local_rank`` (a ``fire``-style flag, -1 when the launcher
passes none), ``deepspeed.initialize(model=..., model_parameters=model.parameters(), config=ds_config)``
with the script's config (``bf16`` on, ZeRO 1, ``offload_optimizer`` on cpu, Adam lr 1e-4),
``engine(**batch)`` returning the MLM loss, ``engine.backward`` / ``engine.step``,
``save_checkpoint(save_dir=..., client_state={'checkpoint_step': step})`` every ``checkpoint_every`` steps
and at the end, and a second run that resumes with ``load_checkpoint(load_dir=...)``.

Differences, all for a test: a tiny RoBERTa built from a config, fake token sequences instead of
wikitext and a tokenizer (the same masking), argparse instead of ``fire`` (same flag names), no
TensorBoard or git logging, a fixed experiment folder name, and rank 0 prints its per-step losses as one
JSON line (``EXAMPLE_RESULT {...}``).
"""
import deepspeed  # noqa: I001  (a plain import deepspeed, first)
import argparse
import json
import os
import pathlib
import random
from functools import partial
from typing import Dict, List, Tuple

import numpy as np
import torch
import torch.nn as nn
from deepspeed.accelerator import get_accelerator
from torch.utils.data import DataLoader, Dataset
from transformers.models.roberta import RobertaConfig, RobertaModel
from transformers.models.roberta.modeling_roberta import RobertaLMHead, RobertaPreTrainedModel

BOS, PAD, EOS, MASK, VOCAB = 0, 1, 2, 3, 96


def is_rank_0() -> bool:
    return int(os.environ.get("RANK", "0")) == 0


def collate_function(batch: List[Tuple[List[int], List[int]]], pad_token_id: int) -> Dict[str, torch.Tensor]:
    """Pad the masked token ids and the labels to the longest sequence of the batch."""
    width = max(len(ids) for ids, _ in batch)
    src = torch.LongTensor([ids + [pad_token_id] * (width - len(ids)) for ids, _ in batch])
    tgt = torch.LongTensor([lab + [pad_token_id] * (width - len(lab)) for _, lab in batch])
    return {"src_tokens": src, "tgt_tokens": tgt, "attention_mask": src.ne(pad_token_id).type_as(src)}


def masking_function(ids: List[int], mask_prob: float, random_replace_prob: float,
                     unmask_replace_prob: float, max_length: int) -> Tuple[List[int], List[int]]:
    """BERT-style masking of a token sequence with numpy's global RNG, as the example does."""
    tokens = np.array([BOS] + ids[:max_length - 2] + [EOS])
    chosen = np.full(len(tokens), False)
    candidates = np.arange(1, len(tokens) - 1)
    count = max(int(mask_prob * len(candidates) + np.random.rand()), 1)
    chosen[np.random.choice(candidates, count, replace=False)] = True
    labels = np.full(len(tokens), PAD)
    labels[chosen] = tokens[chosen]
    tokens[chosen] = MASK
    either = chosen & (np.random.rand(len(tokens)) < random_replace_prob + unmask_replace_prob)
    keep = either & (np.random.rand(len(tokens)) < unmask_replace_prob / (random_replace_prob + unmask_replace_prob))
    tokens[keep] = labels[keep]
    swap = either & ~keep
    tokens[swap] = np.random.randint(4, VOCAB, int(swap.sum()))
    return tokens.tolist(), labels.tolist()


class FakeTextMLMDataset(Dataset):
    """Random 'sentences' of 6-20 tokens, masked on each access."""

    def __init__(self, n: int, masking) -> None:
        g = torch.Generator().manual_seed(7)
        lengths = torch.randint(6, 21, (n,), generator=g).tolist()
        self.texts = [torch.randint(4, VOCAB, (k,), generator=g).tolist() for k in lengths]
        self.masking = masking

    def __len__(self) -> int:
        return len(self.texts)

    def __getitem__(self, idx: int):
        return self.masking(self.texts[idx])


class InfiniteIterator:
    def __init__(self, iterable) -> None:
        self._iterable = iterable
        self._iterator = iter(self._iterable)

    def __iter__(self):
        return self

    def __next__(self):
        try:
            return next(self._iterator)
        except StopIteration:
            self._iterator = iter(self._iterable)
            return next(self._iterator)


def create_data_iterator(mask_prob, random_replace_prob, unmask_replace_prob, batch_size, max_seq_length=32):
    masking = partial(masking_function, mask_prob=mask_prob, random_replace_prob=random_replace_prob,
                      unmask_replace_prob=unmask_replace_prob, max_length=max_seq_length)
    loader = DataLoader(FakeTextMLMDataset(64, masking), batch_size=batch_size, shuffle=True,
                        collate_fn=partial(collate_function, pad_token_id=PAD))
    return InfiniteIterator(loader)


class RobertaLMHeadWithMaskedPredict(RobertaLMHead):
    def __init__(self, config, embedding_weight=None) -> None:
        super().__init__(config)
        if embedding_weight is not None:
            self.decoder.weight = embedding_weight

    def forward(self, features, masked_token_indices=None, **kwargs):
        if masked_token_indices is not None:
            features = torch.index_select(features.view(-1, features.shape[-1]), 0, masked_token_indices)
        return super().forward(features)


class RobertaMLMModel(RobertaPreTrainedModel):
    def __init__(self, config, encoder) -> None:
        super().__init__(config)
        self.encoder = encoder
        self.lm_head = RobertaLMHeadWithMaskedPredict(config, self.encoder.embeddings.word_embeddings.weight)
        self.lm_head.apply(self._init_weights)

    def forward(self, src_tokens, attention_mask, tgt_tokens):
        sequence_output, *_ = self.encoder(input_ids=src_tokens, attention_mask=attention_mask, return_dict=False)
        masked = torch.nonzero((tgt_tokens != self.config.pad_token_id).view(-1)).view(-1)
        scores = self.lm_head(sequence_output, masked)
        target = torch.index_select(tgt_tokens.view(-1), 0, masked)
        return nn.CrossEntropyLoss(ignore_index=-1)(scores.view(-1, self.config.vocab_size), target)


def create_model(num_layers, num_heads, ff_dim, h_dim, dropout):
    config = RobertaConfig.from_dict({
        "attention_probs_dropout_prob": dropout, "bos_token_id": BOS, "eos_token_id": EOS, "hidden_act": "gelu",
        "hidden_dropout_prob": dropout, "hidden_size": h_dim, "initializer_range": 0.02,
        "intermediate_size": ff_dim, "layer_norm_eps": 1e-05, "max_position_embeddings": 66,
        "model_type": "roberta", "num_attention_heads": num_heads, "num_hidden_layers": num_layers,
        "pad_token_id": PAD, "type_vocab_size": 1, "vocab_size": VOCAB})
    return RobertaMLMModel(config, RobertaModel(config))


def train(checkpoint_dir=None, load_checkpoint_dir=None, mask_prob=0.15, random_replace_prob=0.1,
          unmask_replace_prob=0.1, max_seq_length=32, num_layers=2, num_heads=4, ff_dim=64, h_dim=32,
          dropout=0.1, batch_size=4, num_iterations=5, checkpoint_every=2, local_rank=-1, dtype="bf16"):
    device = (torch.device(get_accelerator().device_name(), local_rank)
              if local_rank > -1 and get_accelerator().is_available() else torch.device("cpu"))
    if checkpoint_dir:
        exp_dir = pathlib.Path(checkpoint_dir) / "bert_pretrain.example"
        if is_rank_0():
            exp_dir.mkdir(parents=True, exist_ok=False)
            (exp_dir / "hparams.json").write_text(json.dumps({"num_iterations": num_iterations}))
    else:
        exp_dir = pathlib.Path(load_checkpoint_dir)
        hparams = json.loads((exp_dir / "hparams.json").read_text())
        num_iterations = max(num_iterations, hparams["num_iterations"])
    data_iterator = create_data_iterator(mask_prob, random_replace_prob, unmask_replace_prob, batch_size,
                                         max_seq_length)
    model = create_model(num_layers, num_heads, ff_dim, h_dim, dropout)
    assert dtype == "fp16" or dtype == "bf16"
    ds_config = {
        "train_micro_batch_size_per_gpu": batch_size,
        "optimizer": {"type": "Adam", "params": {"lr": 1e-4}},
        dtype: {"enabled": True},
        "zero_optimization": {"stage": 1, "offload_optimizer": {"device": "cpu"}},
    }
    model, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=ds_config)
    start_step = 1
    if load_checkpoint_dir is not None:
        _, client_state = model.load_checkpoint(load_dir=load_checkpoint_dir)
        start_step = client_state["checkpoint_step"] + 1
    model.train()
    losses = []
    for step, batch in enumerate(data_iterator, start=start_step):
        if step >= num_iterations:
            break
        for key, value in batch.items():
            batch[key] = value.to(device)
        loss = model(**batch)
        model.backward(loss)
        model.step()
        losses.append(loss.item())
        if step % checkpoint_every == 0:
            model.save_checkpoint(save_dir=exp_dir, client_state={"checkpoint_step": step})
    if step % checkpoint_every != 0:
        model.save_checkpoint(save_dir=exp_dir, client_state={"checkpoint_step": step})
    return exp_dir, losses


def _flags():
    parser = argparse.ArgumentParser(description="HelloDeepSpeed (fire-style flags)")
    parser.add_argument("--checkpoint_dir", required=True)
    parser.add_argument("--num_iterations", type=int, default=5)
    parser.add_argument("--resume_iterations", type=int, default=9,
                        help="then train again from the saved checkpoint up to this many iterations")
    parser.add_argument("--local_rank", type=int, default=-1)
    parser.add_argument("--dtype", default="bf16")
    parser.add_argument("--dropout", type=float, default=0.1)
    return parser.parse_args()


if __name__ == "__main__":
    torch.manual_seed(42)
    np.random.seed(0)
    random.seed(0)
    flags = _flags()
    common = dict(local_rank=flags.local_rank, dtype=flags.dtype, dropout=flags.dropout)
    exp_dir, first = train(checkpoint_dir=flags.checkpoint_dir, num_iterations=flags.num_iterations, **common)
    _, resumed = train(load_checkpoint_dir=str(exp_dir), num_iterations=flags.resume_iterations, **common)
    if is_rank_0():
        tags = sorted(p.name for p in exp_dir.iterdir() if p.name.startswith("global_step"))
        latest = (exp_dir / "latest").read_text().strip()
        print("EXAMPLE_RESULT " + json.dumps({"losses": first, "resumed": resumed, "tags": tags,
                                              "latest": latest}), flush=True)
