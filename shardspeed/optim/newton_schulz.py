"""Newton-Schulz orthogonalisation of one momentum matrix: the part of Muon that needs the whole matrix.

Two methods, as DeepSpeed 0.19.8 names them (``optimizer.params.ns_method``):

- ``"standard"``: Keller Jordan's quintic iteration, five steps with coefficients (3.4445, -4.7750, 2.0315), in
  bf16. torch.optim.Muon runs the same iteration in bf16 too, but writes ``b*A + c*A@A`` as one ``addmm``; here
  it is two ops as DeepSpeed writes it (the two differ by bf16 rounding only).
- ``"gram"`` (DeepSpeed's default): the same polynomial iterated on the small Gram matrix ``X X^T`` of a wide
  matrix, restarted at step 2; equal to ``"standard"`` in exact arithmetic. It runs in fp16 where the device has
  fast fp16 (CUDA) and in fp32 elsewhere (DeepSpeed's CPU accelerator reports no fp16: fp32).

The update is scaled by ``sqrt(max(1, rows / cols))`` (torch's ``adjust_lr_fn="original"``, DeepSpeed's only
choice), taking rows and cols from the last two dimensions of the parameter's shape; a 4-D (convolution)
parameter is orthogonalised as ``(out, in*kh*kw)``, as DeepSpeed does.
"""
from __future__ import annotations

import math
from typing import Sequence

import torch

__all__ = ["NS_METHODS", "orthogonalize", "compute_dtype"]

#: the quintic's coefficients (Keller Jordan's; torch's and DeepSpeed's defaults)
_A, _B, _C = 3.4445, -4.7750, 2.0315
_STEPS = 5
_EPS = 1e-7
_RESTART = 2
NS_METHODS = ("gram", "standard")


def compute_dtype(ns_method: str, device: torch.device) -> torch.dtype:
    """The dtype the iteration runs in: ``gram`` fp16 on CUDA else fp32, ``standard`` bf16."""
    if ns_method == "standard":
        return torch.bfloat16
    return torch.float16 if device.type == "cuda" else torch.float32


def _quintic(x: torch.Tensor, steps: int) -> torch.Tensor:
    for _ in range(steps):
        a = x @ x.mT
        b = _B * a + _C * a @ a
        x = _A * x + b @ x
    return x


def _gram(x: torch.Tensor, steps: int) -> torch.Tensor:
    """The quintic for a wide ``x`` (rows < cols), iterated on ``R = X X^T``: ``X_k = Q_k X_0`` with ``Q`` the
    accumulated left factor; at step ``_RESTART`` ``X`` is formed and ``R`` recomputed (half-precision drift)."""
    r = x @ x.mT
    q = None
    for i in range(steps):
        if i == _RESTART:
            assert q is not None
            x = q @ x
            r = x @ x.mT
            q = None
        z = _B * r + _C * r @ r
        if q is None:
            q = z.clone()
            q.diagonal(dim1=-2, dim2=-1).add_(_A)
        else:
            q = _A * q + z @ q
        if i < steps - 1 and i + 1 != _RESTART:
            rz = _A * r + z @ r
            r = _A * rz + z @ rz
    assert q is not None
    return q @ x


def _scale(shape: Sequence[int]) -> float:
    rows, cols = int(shape[-2]), int(shape[-1])
    return math.sqrt(rows / cols) if rows > cols else 1.0


def orthogonalize(update: torch.Tensor, shape: Sequence[int], ns_method: str = "gram") -> torch.Tensor:
    """The scaled Newton-Schulz image of ``update`` (the Nesterov momentum of a parameter of ``shape``, any
    layout with that many elements), as fp32 of ``shape``."""
    g = update.reshape(shape)
    if g.dim() == 4:
        g = g.reshape(g.shape[0], -1)
    dtype = compute_dtype(ns_method, g.device)
    wide = g.size(-2) <= g.size(-1)
    x = g if wide else g.mT
    if ns_method == "standard":
        x = x.to(dtype)
        x = _quintic(x / (x.norm(dim=(-2, -1), keepdim=True) + _EPS), _STEPS)
    else:  # normalised in fp32 first: a large fp32 matrix would overflow fp16 before it
        x = x.float()
        x = (x / (x.norm(dim=(-2, -1), keepdim=True) + _EPS)).to(dtype)
        x = _quintic(x, _STEPS) if x.size(-2) == x.size(-1) else _gram(x, _STEPS)
    out = x if wide else x.mT
    return (out.float() * _scale(shape)).reshape(shape)
