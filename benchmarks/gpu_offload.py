"""Train a GPT-style model too large for the device without offload; report tokens/s and peak memory.

    python benchmarks/gpu_offload.py                      # on a GPU: size chosen from its memory
    python benchmarks/gpu_offload.py --dry-run            # anywhere: a tiny model on CPU, 2 steps

The model is sized so that plain mixed-precision AdamW (16 bytes per parameter: bf16 weights and
gradients, fp32 master and two moments) needs ``--oversize`` (default 2) times the device's memory; with
``offload_optimizer`` (cpu or nvme) only the bf16 weights, gradients and activations stay on the device.
Runs single-process (world 1) at ZeRO stage 2 by default (``--stage 3`` also offloads nothing more today:
parameter offload is not implemented yet). Prints one JSON line per run.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import sys
import tempfile
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))


class Block(nn.Module):
    def __init__(self, d: int, heads: int):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.fc, self.out = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)
        self.heads = heads

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, d)
        x = x + self.proj(y)
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class GPT(nn.Module):
    def __init__(self, vocab: int, d: int, layers: int, heads: int, seq: int):
        super().__init__()
        self.wte, self.wpe = nn.Embedding(vocab, d), nn.Embedding(seq, d)
        self.blocks = nn.ModuleList(Block(d, heads) for _ in range(layers))
        self.ln = nn.LayerNorm(d)
        nn.init.normal_(self.wte.weight, std=0.02)

    def forward(self, idx, targets):
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1], device=idx.device))
        for blk in self.blocks:
            x = torch.utils.checkpoint.checkpoint(blk, x, use_reentrant=False) if self.training else blk(x)
        logits = self.ln(x) @ self.wte.weight.t()
        return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1))


def n_params(vocab: int, d: int, layers: int, seq: int) -> int:
    return vocab * d + seq * d + layers * (12 * d * d + 13 * d) + 2 * d


def pick_size(device_bytes: int, oversize: float, d: int, vocab: int, seq: int) -> int:
    """Layers such that 16 bytes/param ≈ oversize × device memory."""
    target = oversize * device_bytes / 16
    return max(1, math.ceil((target - vocab * d - seq * d) / (12 * d * d + 13 * d)))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dry-run", action="store_true", help="tiny model on CPU, 2 steps: proves the script runs")
    ap.add_argument("--device-kind", default="nvme", choices=["cpu", "nvme"], help="offload_optimizer.device")
    ap.add_argument("--nvme-path", default=None)
    ap.add_argument("--stage", type=int, default=2)
    ap.add_argument("--oversize", type=float, default=2.0)
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--layers", type=int, default=None)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--micro-batch", type=int, default=4)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--sub-group-size", type=int, default=100_000_000)
    ap.add_argument("--buffer-count", type=int, default=4)
    args = ap.parse_args(argv)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29533")
    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    os.environ.setdefault("LOCAL_RANK", "0")
    import shardspeed

    vocab = 50304
    if args.dry_run:
        args.hidden, args.heads, args.seq, args.micro_batch, args.steps, vocab = 64, 4, 32, 2, 2, 256
        args.layers, args.sub_group_size = args.layers or 2, 10_000
    cuda = torch.cuda.is_available() and not args.dry_run
    if not cuda and not args.dry_run:
        print("no CUDA device: use --dry-run to check the script on CPU", file=sys.stderr)
        return 2
    dev_bytes = torch.cuda.get_device_properties(0).total_memory if cuda else 0
    layers = args.layers or pick_size(dev_bytes, args.oversize, args.hidden, vocab, args.seq)
    if not args.layers and cuda:  # the offloaded state (12 bytes/param) must fit the host RAM or the disk
        nvme = args.nvme_path or tempfile.gettempdir()
        room = (shutil.disk_usage(nvme).free if args.device_kind == "nvme"
                else os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") - 8 * 2**30 - 4 * 16e9)
        host_layers = pick_size(int(room * 0.85 * 16 / 12), 1.0, args.hidden, vocab, args.seq)
        if host_layers < layers:
            print(f"host {'disk' if args.device_kind == 'nvme' else 'RAM'} holds the state of {host_layers} "
                  f"layers, not {layers}: using {host_layers}", file=sys.stderr)
            layers = host_layers
    psi = n_params(vocab, args.hidden, layers, args.seq)
    torch.manual_seed(0)
    model = GPT(vocab, args.hidden, layers, args.heads, args.seq).to(torch.bfloat16)  # built on the host
    nvme = args.nvme_path or tempfile.mkdtemp(prefix="shardspeed-gpu-offload-")
    cfg = {
        "train_micro_batch_size_per_gpu": args.micro_batch,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": 1.0,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "weight_decay": 0.1}},
        "bf16": {"enabled": True},
        "zero_optimization": {"stage": args.stage, "reduce_bucket_size": int(2e8), "sub_group_size":
                              args.sub_group_size,
                              "offload_optimizer": {"device": args.device_kind, "nvme_path": nvme,
                                                    "buffer_count": args.buffer_count, "pin_memory": True}},
    }
    engine, *_ = shardspeed.initialize(model=model, config=cfg)
    dev = engine.device
    idx = torch.randint(0, vocab, (args.micro_batch, args.seq + 1), device=dev)
    x, y = idx[:, :-1], idx[:, 1:]
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    times = []
    for _ in range(args.steps):
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        loss = engine(x, y)
        engine.backward(loss)
        engine.step()
        if cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    steady = times[1:] or times
    s_step = sorted(steady)[len(steady) // 2]
    out = {
        "device": torch.cuda.get_device_name(0) if cuda else "cpu (dry run)",
        "device_memory_gib": round(dev_bytes / 2**30, 1),
        "params": psi, "layers": layers, "hidden": args.hidden,
        "no_offload_model_states_gib": round(16 * psi / 2**30, 1),
        "too_large_without_offload": bool(cuda and 16 * psi > dev_bytes),
        "offload": args.device_kind, "stage": args.stage,
        "s_per_step": round(s_step, 3),
        "tokens_per_s": round(args.micro_batch * args.seq / s_step, 1),
        "peak_device_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2) if cuda else None,
        "loss": round(float(loss), 4),
        "host_breakdown": {k: v for k, v in engine.master_weights.held_bytes().items()},
    }
    print(json.dumps(out))
    close = getattr(engine.master_weights, "close", None)
    if close:
        close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
