"""The Muon tests' shared parts (tests/test_muon.py, tests/test_muon_parallel.py): the one-process reference,
DeepSpeed's routing by hand, the configs, data and the training loop the engines run.

The reference: torch.optim.Muon over the parameters DeepSpeed's ``use_muon`` sends to Muon (2+ dimensions, not
named ``embed`` / ``lm_head``), torch.optim.AdamW over the rest, one process, the whole global batch. torch runs
Newton-Schulz in bf16 only; ``fp32=True`` runs torch's own iteration (its ops, its order) in fp32, against the
default ``ns_method: "gram"``, which runs in fp32 on CPU as DeepSpeed's does. It also records DeepSpeed's ZeRO
1-3 gradient norm: the global L2 norm over the orthogonalised Muon updates (scaled by ``sqrt(max(1, rows /
cols))``, torch's ``adjust_lr_fn="original"``) and the AdamW gradients, taken from torch's own step.
"""
from __future__ import annotations

import math
from typing import Dict, List, Optional, Sequence, Tuple

import pytest
import torch

LR, ADAM_LR = 0.02, 0.01
Batch = Tuple[torch.Tensor, torch.Tensor]


def _fp32_newton_schulz(grad, ns_coefficients, ns_steps, eps):
    """torch.optim.Muon's iteration (its ops, its order) in fp32 instead of bf16."""
    a, b, c = ns_coefficients
    x = grad.float()
    tall = grad.size(0) > grad.size(1)
    x = x.T if tall else x
    x = x / x.norm().clamp(min=eps)
    for _ in range(ns_steps):
        gram = x @ x.T
        x = torch.addmm(x, torch.addmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    return x.T if tall else x


def routed_to_muon(model: torch.nn.Module) -> Dict[str, bool]:
    """DeepSpeed's ``use_muon``, written out: per parameter name, whether Muon steps it."""
    return {n: p.dim() >= 2 and "embed" not in n and "lm_head" not in n for n, p in model.named_parameters()}


def reference(model: torch.nn.Module, batches: Sequence[Batch], fp32: bool) -> Dict[str, List[float]]:
    """Losses and DeepSpeed's ZeRO 1-3 gradient norm per step of the one-process reference."""
    routed = routed_to_muon(model)
    hidden = [p for n, p in model.named_parameters() if routed[n]]
    rest = [p for n, p in model.named_parameters() if not routed[n]]
    muon = torch.optim.Muon(hidden, lr=LR, weight_decay=0.0, momentum=0.95, adjust_lr_fn="original")
    adam = torch.optim.AdamW(rest, lr=ADAM_LR, betas=(0.9, 0.95), eps=1e-10, weight_decay=0.0)
    inner = _fp32_newton_schulz if fp32 else torch.optim._muon._zeropower_via_newtonschulz
    sq: List[float] = []

    def recorded(grad, *args):
        out = inner(grad, *args)
        sq.append(float(out.float().pow(2).sum()) * max(1.0, grad.size(0) / grad.size(1)))
        return out

    losses, norms = [], []
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(torch.optim._muon, "_zeropower_via_newtonschulz", recorded)
        for x, y in batches:
            loss = model(x, y)
            losses.append(float(loss.detach()))
            loss.backward()
            sq.clear()
            muon.step()
            adam_sq = sum(float(p.grad.pow(2).sum()) for p in rest if p.grad is not None)
            norms.append(math.sqrt(sum(sq) + adam_sq))
            adam.step()
            muon.zero_grad()
            adam.zero_grad()
    return {"losses": losses, "norms": norms}


def muon_config(stage: int, micro: int, ns_method: str = "gram", **extra) -> dict:
    """Muon at ZeRO ``stage`` without clipping (stage 3 with ``reduce_scatter: false``: DeepSpeed refuses Muon
    with it on)."""
    zero: Dict = {"stage": stage}
    if stage == 3:
        zero["reduce_scatter"] = False
    return {"train_micro_batch_size_per_gpu": micro, "gradient_accumulation_steps": 1, "gradient_clipping": 0.0,
            "zero_optimization": zero,
            "optimizer": {"type": "Muon", "params": {"lr": LR, "adam_lr": ADAM_LR, "ns_method": ns_method}}, **extra}


def gpt_batches(steps: int, global_batch: int, vocab: int = 64, seq: int = 16, seed: int = 1) -> List[Batch]:
    """Random tokens, each to be followed by the next id (learnable: the loss falls)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        x = torch.randint(0, vocab, (global_batch, seq), generator=g)
        out.append((x, (x + 1) % vocab))
    return out


def train(engine, batches: Sequence[Batch], gas: int = 1,
          data: Optional[Tuple[int, int]] = None) -> Dict[str, List[float]]:
    """Each step's global mean loss and the engine's ``get_global_grad_norm()``; this rank's part of the batch
    (``data``: its data-parallel (rank, size), default the world's: under tensor parallelism every rank of a
    model group takes the same part)."""
    import torch.distributed as dist

    rank, world = data if data is not None else (dist.get_rank(), dist.get_world_size())
    losses, norms = [], []
    for b in batches:
        total = torch.zeros(())
        n = b[0].shape[0] // (world * gas)
        for k in range(gas):
            i = k * world + rank
            loss = engine(*(t[i * n:(i + 1) * n] for t in b))
            engine.backward(loss)
            engine.step()
            total += loss.detach().float()
        dist.all_reduce(total)  # tensor-parallel peers hold equal losses: the world mean is the data mean
        losses.append(float(total) / (dist.get_world_size() * gas))
        norm = engine.get_global_grad_norm()
        norms.append(float(norm) if norm is not None else float("nan"))
    return {"losses": losses, "norms": norms}


def deepspeed_engine(config: dict):
    """The real DeepSpeed's engine for the "tied" test model under ``config``, its Muon step eager (the same
    math, no minutes of CPU compilation), the process group started once, DeepSpeed's log quiet."""
    import logging

    import deepspeed
    import torch._dynamo
    from models import make_model

    torch._dynamo.config.disable = True
    if not deepspeed.comm.is_initialized():
        deepspeed.init_distributed(dist_backend="gloo")
    deepspeed.utils.logger.setLevel(logging.WARNING)
    model = make_model("tied")
    return deepspeed.initialize(model=model, config=config, model_parameters=model.parameters())[0]
