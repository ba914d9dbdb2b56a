"""The stacked experts' compute paths in one process: an MLP expert (``nn.Sequential`` of ``nn.Linear`` and
activations, the "mlp" path's batched linears) and the same MLP written as a module of its own (vmap) give what
each expert computes alone, in outputs and in every parameter's and the input's gradient."""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from shardspeed.moe.experts import Experts

D, HID, E = 8, 16, 3


class OwnMLP(nn.Module):
    """The same function as the Sequential MLP, not a Sequential: vmap computes it."""

    def __init__(self, bias: bool):
        super().__init__()
        self.fc1 = nn.Linear(D, HID, bias=bias)
        self.fc2 = nn.Linear(HID, D, bias=bias)

    def forward(self, x):
        return self.fc2(F.silu(self.fc1(x)))


def _sequential(bias: bool) -> nn.Module:
    return nn.Sequential(nn.Linear(D, HID, bias=bias), nn.SiLU(), nn.Linear(HID, D, bias=bias))


def _by_expert(experts: Experts, x: torch.Tensor, fn) -> torch.Tensor:
    """Expert i alone on its rows: ``fn(params of expert i, rows)``, stacked (the reference)."""
    stacked = experts.stacked()
    return torch.stack([fn({n: t[i] for n, t in stacked.items()}, x[:, i]) for i in range(E)], dim=1)


def _check(experts: Experts, fn, path: str) -> None:
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for p in experts.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    x = torch.randn(2, E, 5, D, generator=g, requires_grad=True)  # [groups, local experts, rows, d]
    gy = torch.randn(2, E, 5, D, generator=g)
    out = experts(x)
    assert experts.compute_path == path
    grads = torch.autograd.grad((out * gy).sum(), [x] + [p for p in experts.parameters() if p.requires_grad])
    x_ref = x.detach().clone().requires_grad_(True)
    ref = _by_expert(experts, x_ref, fn)
    ref_grads = torch.autograd.grad((ref * gy).sum(), [x_ref] + [p for p in experts.parameters() if p.requires_grad])
    torch.testing.assert_close(out, ref, rtol=1e-6, atol=1e-6)
    assert len(grads) == len(ref_grads)
    for a, b in zip(grads, ref_grads):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("bias", [True, False])
def test_mlp_and_vmap_paths_equal_each_expert_alone(bias):
    def seq_fn(p, rows):
        h = F.silu(F.linear(rows, p["0.weight"], p.get("0.bias")))
        return F.linear(h, p["2.weight"], p.get("2.bias"))

    def own_fn(p, rows):
        h = F.silu(F.linear(rows, p["fc1.weight"], p.get("fc1.bias")))
        return F.linear(h, p["fc2.weight"], p.get("fc2.bias"))

    _check(Experts(_sequential(bias), E), seq_fn, "mlp")
    _check(Experts(OwnMLP(bias), E), own_fn, "vmap")


def test_mlp_path_lone_linear_and_frozen_weight():
    lone = Experts(nn.Linear(D, D), E)
    _check(lone, lambda p, rows: F.linear(rows, p["weight"], p["bias"]), "mlp")
    frozen = Experts(_sequential(True), E)
    frozen.deepspeed_experts.get_parameter("0.weight").requires_grad_(False)

    def seq_fn(p, rows):
        return F.linear(F.silu(F.linear(rows, p["0.weight"], p["0.bias"])), p["2.weight"], p["2.bias"])

    _check(frozen, seq_fn, "mlp")
