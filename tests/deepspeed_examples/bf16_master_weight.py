"""A small equivalent of DeepSpeedExamples' training/bf16_master_weight/train.py (not a copy).

It calls DeepSpeed the way that script does: its own ``--deepspeed_config`` (a path, read by the script
for ``torch_autocast`` and passed as ``config=``, not through ``args``) and ``--local_rank``;
``deepspeed.init_distributed()``; ``deepspeed.comm.get_rank()`` / ``get_world_size()``;
``get_accelerator().device_name(local_rank)``; ``deepspeed.initialize(model=...,
model_parameters=model.parameters(), config=path)``; the forward under ``torch.autocast`` when the config
enables ``torch_autocast``; the PyTorch-style ``loss.backward()`` then ``engine.step()``; and
``engine.destroy()``. Its configs (ZeRO 3, bf16; then ``bf16_master_weights_and_grads``; then also
``bf16_optimizer_states``) are written by the test.

Differences, all for a test: a tiny model, ``get_accelerator()`` for ``torch.cuda.set_device`` /
``reset_peak_memory_stats`` and the autocast device (CPU), and rank 0 prints its per-step losses as one
JSON line (``EXAMPLE_RESULT {...}``).
"""
import deepspeed  # noqa: I001  (a plain import deepspeed, first)
import argparse
import json

import torch
import torch.nn as nn
from deepspeed.accelerator import get_accelerator


class SimpleTransformerBlock(nn.Module):
    def __init__(self, hidden_dim, num_heads=8, ff_dim=None):
        super().__init__()
        ff_dim = ff_dim or hidden_dim * 4
        self.attention = nn.MultiheadAttention(hidden_dim, num_heads, batch_first=True)
        self.norm1 = nn.LayerNorm(hidden_dim)
        self.norm2 = nn.LayerNorm(hidden_dim)
        self.ff = nn.Sequential(nn.Linear(hidden_dim, ff_dim), nn.GELU(), nn.Linear(ff_dim, hidden_dim))

    def forward(self, x):
        attn_out, _ = self.attention(x, x, x)
        x = self.norm1(x + attn_out)
        return self.norm2(x + self.ff(x))


class SimpleTransformerModel(nn.Module):
    def __init__(self, vocab_size, hidden_dim, num_layers, num_heads, max_seq_len):
        super().__init__()
        self.embedding = nn.Embedding(vocab_size, hidden_dim)
        self.pos_embedding = nn.Embedding(max_seq_len, hidden_dim)
        self.layers = nn.ModuleList([SimpleTransformerBlock(hidden_dim, num_heads) for _ in range(num_layers)])
        self.output_proj = nn.Linear(hidden_dim, vocab_size)

    def forward(self, input_ids):
        batch_size, seq_len = input_ids.shape
        positions = torch.arange(seq_len, device=input_ids.device).unsqueeze(0).expand(batch_size, -1)
        x = self.embedding(input_ids) + self.pos_embedding(positions)
        for layer in self.layers:
            x = layer(x)
        return self.output_proj(x)


def get_args():
    parser = argparse.ArgumentParser(description="BF16 Low-Precision Master Weights Demo")
    parser.add_argument("--hidden_dim", type=int, default=32)
    parser.add_argument("--num_layers", type=int, default=2)
    parser.add_argument("--num_heads", type=int, default=4)
    parser.add_argument("--vocab_size", type=int, default=64)
    parser.add_argument("--batch_size", type=int, default=2)
    parser.add_argument("--seq_length", type=int, default=16)
    parser.add_argument("--num_steps", type=int, default=5)
    parser.add_argument("--deepspeed_config", type=str, required=True, nargs="+",
                        help="Path to DeepSpeed config (one engine per path)")
    parser.add_argument("--local_rank", type=int, default=-1)
    parser.add_argument("--seed", type=int, default=42)
    return parser.parse_args()


def main(args, config_path):
    deepspeed.init_distributed()
    local_rank = args.local_rank
    if local_rank == -1:
        local_rank = int(deepspeed.comm.get_rank())
    device = get_accelerator().device_name(local_rank)
    get_accelerator().set_device(local_rank)
    torch.manual_seed(args.seed)
    get_accelerator().manual_seed_all(args.seed)
    get_accelerator().reset_peak_memory_stats()

    model = SimpleTransformerModel(args.vocab_size, args.hidden_dim, args.num_layers, args.num_heads,
                                   args.seq_length)
    with open(config_path) as f:
        ds_config = json.load(f)
    use_autocast = ds_config.get("torch_autocast", {}).get("enabled", False)
    autocast_dtype = torch.bfloat16 if "bfloat16" in ds_config.get("torch_autocast", {}).get(
        "dtype", "torch.bfloat16") else torch.float16
    model_engine, optimizer, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                                         config=config_path)
    model_engine.train()
    loss_fn = nn.CrossEntropyLoss()
    losses = []
    for _step in range(args.num_steps):
        input_ids = torch.randint(0, args.vocab_size, (args.batch_size, args.seq_length), device=device)
        labels = torch.randint(0, args.vocab_size, (args.batch_size, args.seq_length), device=device)
        if use_autocast:
            with torch.autocast(device_type=get_accelerator().device_name(), dtype=autocast_dtype):
                logits = model_engine(input_ids)
                loss = loss_fn(logits.view(-1, args.vocab_size), labels.view(-1))
        else:
            logits = model_engine(input_ids)
            loss = loss_fn(logits.view(-1, args.vocab_size), labels.view(-1))
        loss.backward()
        model_engine.step()
        losses.append(loss.item())
    model_engine.destroy()
    return losses


if __name__ == "__main__":
    args = get_args()
    results = {path.rsplit("/", 1)[-1]: main(args, path) for path in args.deepspeed_config}
    if deepspeed.comm.get_rank() == 0:
        print("EXAMPLE_RESULT " + json.dumps(results), flush=True)
