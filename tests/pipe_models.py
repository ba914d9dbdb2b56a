"""Pipeline models (layer specs) and a one-process plain-torch reference for the pipeline tests."""
from __future__ import annotations

from typing import Dict, List, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F
from models import master_step

from shardspeed.pipe import LayerSpec, PipelineModule, TiedLayerSpec

VOCAB, D = 32, 16


class Block(nn.Module):
    """A residual MLP block (attention-free: token positions stay independent)."""

    def __init__(self, d: int = D):
        super().__init__()
        self.fc1 = nn.Linear(d, 2 * d)
        self.fc2 = nn.Linear(2 * d, d)

    def forward(self, x):
        return x + self.fc2(F.gelu(self.fc1(x)))


def head_fn(embedding: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return x @ embedding.weight.t()


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, VOCAB).float(), targets.reshape(-1))


def mlp_specs(n_hidden: int = 3) -> List:
    out: List = [LayerSpec(nn.Linear, 16, 32), nn.Tanh()]
    for _ in range(n_hidden - 1):
        out += [LayerSpec(nn.Linear, 32, 32), nn.Tanh()]
    return out + [LayerSpec(nn.Linear, 32, 8)]


def linear_specs(n: int = 8) -> List:
    """``n`` linear layers (every stage of an 8-stage pipeline holds parameters)."""
    return [LayerSpec(nn.Linear, 16, 32)] + [LayerSpec(nn.Linear, 32, 32) for _ in range(n - 2)] + [
        LayerSpec(nn.Linear, 32, 8)]


def tied_specs(blocks: int = 2) -> List:
    return ([TiedLayerSpec("embed", nn.Embedding, VOCAB, D)] + [LayerSpec(Block, D) for _ in range(blocks)]
            + [LayerSpec(nn.LayerNorm, D), TiedLayerSpec("embed", nn.Embedding, VOCAB, D, forward_fn=head_fn)])


def specs(kind: str) -> List:
    return {"mlp": mlp_specs, "mlp8": linear_specs, "tied": tied_specs}[kind]()


def loss_fn(kind: str):
    return lm_loss if kind == "tied" else F.mse_loss


def build(kind: str, num_stages: int, **kwargs) -> PipelineModule:
    return PipelineModule(specs(kind), num_stages=num_stages, loss_fn=loss_fn(kind), seed_layers=True, **kwargs)


def batches(kind: str, steps: int, global_batch: int, seqs: Optional[List[int]] = None, seed: int = 1) -> List[tuple]:
    """``steps`` global batches; for "tied", the sequence length of step i is ``seqs[i % len(seqs)]``."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(steps):
        if kind == "tied":
            s = (seqs or [8])[i % len(seqs or [8])]
            out.append((torch.randint(0, VOCAB, (global_batch, s), generator=g),
                        torch.randint(0, VOCAB, (global_batch, s), generator=g)))
        else:
            out.append((torch.randn(global_batch, 16, generator=g), torch.randn(global_batch, 8, generator=g)))
    return out


def micro_batches(batch: tuple, dp_rank: int, dp: int, gas: int) -> List[tuple]:
    """The ``gas`` micro-batches of data-parallel rank ``dp_rank`` (micro k is piece k·dp + rank)."""
    n = batch[0].shape[0] // (dp * gas)
    return [tuple(t[(k * dp + dp_rank) * n : (k * dp + dp_rank + 1) * n] for t in batch) for k in range(gas)]


def reference(kind: str, data: List[tuple], lr: float, clip: float, dtype: torch.dtype = torch.float32,
              checkpoint_interval: int = 0) -> Dict[str, object]:
    """One process, plain torch: the same layers (num_stages=1), AdamW on fp32 masters, whole batches."""
    model = build(kind, 1, activation_checkpoint_interval=checkpoint_interval).to(dtype)
    named = dict(model.named_parameters())
    masters = {n: p.detach().float().clone() for n, p in named.items()}
    opt = torch.optim.AdamW(list(masters.values()), lr=lr, weight_decay=0.01, foreach=False)
    losses = []
    for x, y in data:
        x = x.to(dtype) if x.is_floating_point() else x
        y = y.to(dtype) if y.is_floating_point() else y
        loss = loss_fn(kind)(model(x), y)
        losses.append(float(loss.detach()))
        loss.backward()
        master_step(named, masters, opt, clip)
    return {"losses": losses, "params": {n: m.clone() for n, m in masters.items()}}


def config(gas: int, stage: int = 0, schedule: str = "1f1b", clip: float = 0.5, lr: float = 1e-2, **extra) -> dict:
    cfg = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": gas, "gradient_clipping": clip,
           "optimizer": {"type": "AdamW", "params": {"lr": lr, "weight_decay": 0.01}},
           "zero_optimization": {"stage": stage}, "pipeline": {"schedule": schedule}}
    cfg.update(extra)
    return cfg


def train(engine, kind: str, steps: int, gas: int, seqs: Optional[List[int]] = None) -> Dict[str, object]:
    """Run ``steps`` train_batch calls on this rank's micro-batches; losses and this rank's parameters."""
    import shardspeed.zero

    dp, r = engine.mpu.get_data_parallel_world_size(), engine.mpu.get_data_parallel_rank()
    losses = [float(engine.train_batch(iter(micro_batches(b, r, dp, gas))))
              for b in batches(kind, steps, 2 * gas * dp, seqs)]
    with shardspeed.zero.GatheredParameters(list(engine.module.parameters())):
        params = {n: p.detach().float().clone() for n, p in engine.module.named_parameters()}
    return {"losses": losses, "params": params}
