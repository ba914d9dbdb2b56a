"""Small models and a plain-torch reference training loop shared by the parity tests."""
from __future__ import annotations

from typing import Dict, List

import torch
import torch.nn as nn
import torch.nn.functional as F


class TinyMLP(nn.Module):
    def __init__(self, d_in=16, hidden=32, d_out=8, n_layers=3, frozen_first=False, unused=False):
        super().__init__()
        dims = [d_in] + [hidden] * (n_layers - 1) + [d_out]
        self.layers = nn.ModuleList(nn.Linear(a, b) for a, b in zip(dims[:-1], dims[1:]))
        if frozen_first:
            self.layers[0].requires_grad_(False)
        self.unused = nn.Linear(4, 4) if unused else None

    def forward(self, x, y):
        for i, layer in enumerate(self.layers):
            x = layer(x)
            if i < len(self.layers) - 1:
                x = torch.tanh(x)
        return F.mse_loss(x, y)


class TiedLM(nn.Module):
    """Embedding, one attention-free mixing block, LayerNorm, and an LM head tied to the embedding."""

    def __init__(self, vocab=32, d=16, seq=8):
        super().__init__()
        self.wte = nn.Embedding(vocab, d)
        self.wpe = nn.Embedding(seq, d)
        self.block = nn.Sequential(nn.Linear(d, 2 * d), nn.GELU(), nn.Linear(2 * d, d))
        self.ln = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)
        self.head.weight = self.wte.weight

    def forward(self, idx, targets):
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.wte(idx) + self.wpe(pos)
        x = x + self.block(x)
        logits = self.head(self.ln(x))
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), targets.reshape(-1))


def make_model(kind: str, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    if kind == "mlp":
        return TinyMLP()
    if kind == "mlp_frozen":
        return TinyMLP(frozen_first=True)
    if kind == "mlp_unused":
        return TinyMLP(unused=True)
    if kind == "tied":
        return TiedLM()
    raise ValueError(kind)


def make_batches(kind: str, steps: int, global_batch: int, seed: int = 1) -> List[tuple]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        if kind == "tied":
            x = torch.randint(0, 32, (global_batch, 8), generator=g)
            y = torch.randint(0, 32, (global_batch, 8), generator=g)
        else:
            x = torch.randn(global_batch, 16, generator=g)
            y = torch.randn(global_batch, 8, generator=g)
        out.append((x, y))
    return out


def micro_batch(batch: tuple, rank: int, world: int, micro: int, gas: int) -> tuple:
    """Micro-batch ``micro`` of ``rank``: the global batch is cut into world × gas equal pieces."""
    n = batch[0].shape[0] // (world * gas)
    i = micro * world + rank
    return tuple(t[i * n : (i + 1) * n] for t in batch)


def master_step(named: Dict[str, torch.nn.Parameter], masters: Dict[str, torch.Tensor], opt: torch.optim.Optimizer,
                clip: float) -> None:
    """The references' optimizer step: move the model's gradients onto the fp32 masters (a parameter without a
    gradient counts as a zero gradient, as in ZeRO's flat buffers), clip, step, copy the masters back."""
    for n, m in masters.items():
        g = named[n].grad
        m.grad = torch.zeros_like(m) if g is None else g.float()
        named[n].grad = None
    if clip > 0:
        torch.nn.utils.clip_grad_norm_(list(masters.values()), clip)
    opt.step()
    opt.zero_grad()
    with torch.no_grad():
        for n, m in masters.items():
            named[n].copy_(m)


def reference_train(kind: str, batches: List[tuple], lr: float, clip: float, dtype: torch.dtype = torch.float32,
                    weight_decay: float = 0.01, seed: int = 0) -> Dict[str, object]:
    """One process, plain torch: AdamW on fp32 master weights, the model computing in ``dtype``."""
    model = make_model(kind, seed).to(dtype)
    masters = {n: p.detach().float().clone() for n, p in model.named_parameters() if p.requires_grad}
    opt = torch.optim.AdamW(list(masters.values()), lr=lr, weight_decay=weight_decay, foreach=False)
    named = dict(model.named_parameters())
    losses = []
    for x, y in batches:
        x, y = (t.to(dtype) if t.is_floating_point() else t for t in (x, y))
        loss = model(x, y)
        losses.append(float(loss.detach()))
        loss.backward()
        master_step(named, masters, opt, clip)
    return {"losses": losses, "params": {n: p.detach().float().clone() for n, p in model.named_parameters()}}


def train_global_losses(engine, kind: str, steps: int, gas: int) -> List[float]:
    """Drive ``engine`` through ``steps`` optimizer steps of the shared batches (this rank's micro-batches)
    and return each step's global mean loss (averaged over ranks and micro-batches)."""
    import torch.distributed as dist

    world, rank = dist.get_world_size(), dist.get_rank()
    losses = []
    for batch in make_batches(kind, steps, 2 * gas * world):
        total = torch.zeros(())
        for k in range(gas):
            x, y = micro_batch(batch, rank, world, k, gas)
            loss = engine(x, y)
            engine.backward(loss)
            engine.step()
            total += loss.detach().float()
        dist.all_reduce(total)
        losses.append(float(total) / (gas * world))
    return losses


def gathered_params(engine) -> Dict[str, torch.Tensor]:
    """fp32 copies of the engine's full parameters (stage 3: gathered, not placeholders)."""
    import shardspeed.zero

    with shardspeed.zero.GatheredParameters(list(engine.module.parameters())):
        return {n: p.detach().float().clone() for n, p in engine.module.named_parameters()}
