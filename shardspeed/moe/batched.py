"""Stacked experts that are a plain MLP (``nn.Sequential`` of ``nn.Linear`` and element-wise activations), computed
as one ``bmm`` per linear with a backward that gives each weight's gradient in the weight's own layout.

Under ``vmap`` a linear over stacked weights ``[e, out, in]`` becomes ``bmm(x, w.transpose(1, 2))``, whose
backward yields the weight's gradient as the transpose of a contiguous ``[e, in, out]`` product. Autograd's
gradient accumulation then copies it into the parameter's ``[e, out, in]`` layout, a strided transpose of every
expert weight on every step: on the benchmark's model half the time of the forward and backward together.
:class:`_BatchedLinear` computes ``gy^T x`` instead, contiguous in the weight's layout (the same products, summed
over the same tokens), so the gradient is taken as it is.
"""
from __future__ import annotations

from typing import Any, Dict, List, Optional, Tuple

import torch
import torch.nn as nn
from torch import Tensor

#: parameterless modules that act element by element, the same on ``[e, tokens, d]`` as on ``[tokens, d]``
_ELEMENTWISE = (nn.GELU, nn.ReLU, nn.SiLU, nn.Tanh, nn.Sigmoid, nn.Identity, nn.LeakyReLU, nn.Mish)


class _BatchedLinear(torch.autograd.Function):
    """``x [e, c, in]`` times each expert's ``w [e, out, in]`` transposed, plus ``b [e, out]``."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, w: Tensor, b: Optional[Tensor]) -> Tensor:
        ctx.save_for_backward(x, w)
        ctx.has_bias = b is not None
        wt = w.transpose(1, 2)
        return torch.baddbmm(b.unsqueeze(1), x, wt) if b is not None else torch.bmm(x, wt)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx: Any, gy: Tensor) -> Tuple[Optional[Tensor], Optional[Tensor], Optional[Tensor]]:
        x, w = ctx.saved_tensors
        gy = gy.contiguous()
        gx = torch.bmm(gy, w) if ctx.needs_input_grad[0] else None
        gw = torch.bmm(gy.transpose(1, 2), x) if ctx.needs_input_grad[1] else None
        gb = gy.sum(1) if ctx.has_bias and ctx.needs_input_grad[2] else None
        return gx, gw, gb


def mlp_layers(expert: nn.Module) -> Optional[List[Tuple[str, nn.Module]]]:
    """The expert's ``(name, module)`` steps when it is an ``nn.Sequential`` of ``nn.Linear`` (exactly that class)
    and element-wise activations (or a lone ``nn.Linear``); None for any other expert (vmap computes those)."""
    if type(expert) is nn.Linear:
        return [("", expert)]
    if type(expert) is not nn.Sequential or len(expert) == 0:
        return None
    steps = list(expert.named_children())
    for _, m in steps:
        if type(m) is not nn.Linear and not isinstance(m, _ELEMENTWISE):
            return None
    return steps


def run_mlp(steps: List[Tuple[str, nn.Module]], params: Dict[str, Tensor], x: Tensor) -> Tensor:
    """The stacked MLP on ``x`` (``[e, tokens, d]``) with the stacked ``params`` (the expert's names)."""
    for name, m in steps:
        if type(m) is nn.Linear:
            prefix = f"{name}." if name else ""
            x = _BatchedLinear.apply(x, params[prefix + "weight"], params.get(prefix + "bias"))
        else:
            x = m(x)
    return x
