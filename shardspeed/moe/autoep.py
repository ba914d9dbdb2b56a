"""AutoEP: Hugging Face MoE models made expert-parallel (the ``expert_parallel`` config block).

transformers 5 keeps a model's experts stacked in one module per MoE block (``block.experts``:
``gate_up_proj [experts, 2 × intermediate, hidden]``, ``down_proj [experts, hidden, intermediate]``,
``act_fn``), called as ``experts(hidden_states, top_k_index, top_k_weights)`` after the block's router
(``block.gate``) has chosen the top-k experts. Mixtral, Qwen3-MoE and DeepSeek-V3 share that layout (GPT-OSS
does not: its experts have biases and a clamped activation, and are refused). The conversion keeps the
router as it is (so top-k softmax routing, its renormalisation and the router logits that the model's
auxiliary loss reads are Hugging Face's own code) and replaces ``block.experts`` by
:class:`ExpertParallelExperts`, which holds this rank's ``experts / ep`` rows of the same two parameters
(the same ``Parameter`` objects, so an optimizer's groups still name them, and the same names, so
checkpoints and ``consolidate`` give Hugging Face's names; the rows are keyed by global expert id).

Its forward computes exactly what the Hugging Face experts compute, with no token dropping: each
(token, route) row is sent to the rank holding its expert (``all_to_all_single`` with the counts
exchanged first), the local experts run as grouped matmuls (:func:`~.experts.grouped_mm`), the results come
back by the reverse all-to-all, and each token sums its routes weighted by the router. Every rank runs the
same collectives whatever its experts receive (an expert with no token computes on zero rows), so ZeRO-3
gathers and reduces every expert unit on every rank: no hang, and idle experts get zero gradients.
"""
from __future__ import annotations

import re
from types import MappingProxyType
from typing import Any, Callable, List, Optional, Tuple

import torch
import torch.distributed as dist
import torch.nn as nn
from torch import Tensor

from ..errors import ConfigError
from .experts import grouped_mm, mark_expert_slice, padded_bmm, tag_expert_param

#: transformers' MoE block classes AutoEP converts, by preset_model
PRESET_BLOCKS = MappingProxyType({"mixtral": "MixtralSparseMoeBlock", "qwen3_moe": "Qwen3MoeSparseMoeBlock",
                 "deepseek_v3": "DeepseekV3MoE"})


class _AllToAllV(torch.autograd.Function):
    """``all_to_all_single`` with per-rank row counts; the gradient goes back with the counts swapped."""

    @staticmethod
    def forward(ctx: Any, group, x: Tensor, send: List[int], recv: List[int]) -> Tensor:
        ctx.group, ctx.send, ctx.recv = group, send, recv
        out = x.new_empty((sum(recv),) + tuple(x.shape[1:]))
        dist.all_to_all_single(out, x.contiguous(), output_split_sizes=recv, input_split_sizes=send, group=group)
        return out

    @staticmethod
    def backward(ctx: Any, grad: Tensor):
        return None, _AllToAllV.apply(ctx.group, grad.contiguous(), ctx.recv, ctx.send), None, None


class ExpertParallelExperts(nn.Module):
    """This rank's rows of a Hugging Face experts module, computed expert-parallel (see the module doc)."""

    gate_up_proj: nn.Parameter
    down_proj: nn.Parameter

    def __init__(self, experts: nn.Module, group, ep_rank: int, ep_size: int, use_grouped_mm: bool = True):
        super().__init__()
        total = int(experts.get_parameter("gate_up_proj").shape[0])
        if total % ep_size:
            raise ConfigError(f"expert_parallel.autoep_size {ep_size} must divide the model's {total} experts")
        self.num_experts, self.num_local_experts = total, total // ep_size
        self.ep_rank, self.ep_size, self.group = ep_rank, ep_size, group
        self.use_grouped_mm = use_grouped_mm
        lo, hi = ep_rank * self.num_local_experts, (ep_rank + 1) * self.num_local_experts
        for name in ("gate_up_proj", "down_proj"):
            p = getattr(experts, name)
            with torch.no_grad():
                p.data = p.data[lo:hi].clone()  # the same Parameter object, this rank's experts only
            tag_expert_param(p, f"ep_size_{ep_size}")
            mark_expert_slice(p, ep_rank, ep_size)
            self.register_parameter(name, p)
        self.act_fn: Callable[[Tensor], Tensor] = getattr(experts, "act_fn")  # noqa: B009 - typed as a callable
        for attr in ("hidden_dim", "intermediate_dim"):
            if hasattr(experts, attr):
                setattr(self, attr, getattr(experts, attr))

    def _mm(self, x: Tensor, w: Tensor, counts: List[int]) -> Tensor:
        return grouped_mm(x, w, counts) if self.use_grouped_mm else padded_bmm(x, w, counts)

    def _local(self, x: Tensor, counts: List[int]) -> Tensor:
        """Rows ``x`` grouped by local expert (``counts`` each) through their expert's gated MLP."""
        h = self._mm(x, torch.transpose(self.gate_up_proj, 1, 2), counts)
        gate, up = h.chunk(2, dim=-1)
        return self._mm(self.act_fn(gate) * up, torch.transpose(self.down_proj, 1, 2), counts)

    def forward(self, hidden_states: Tensor, top_k_index: Tensor, top_k_weights: Tensor) -> Tensor:
        k = top_k_index.shape[-1]
        flat = top_k_index.reshape(-1)
        order = torch.argsort(flat, stable=True)  # routes grouped by global expert
        token = order // k
        rows = hidden_states.index_select(0, token)
        counts = torch.bincount(flat, minlength=self.num_experts)
        if self.ep_size > 1:
            y = self._exchange(rows, counts)
        else:
            y = self._local(rows, counts.tolist())
        weights = top_k_weights.reshape(-1).index_select(0, order).unsqueeze(-1)
        out = torch.zeros_like(hidden_states)
        return out.index_add(0, token, (y * weights).to(out.dtype))

    def _exchange(self, rows: Tensor, counts: Tensor) -> Tensor:
        """Send each route to its expert's rank, compute, and bring the results back (in ``rows``' order)."""
        ep, nl = self.ep_size, self.num_local_experts
        recv_counts = torch.empty_like(counts)
        dist.all_to_all_single(recv_counts, counts, group=self.group)  # [source rank, local expert]; a sync point
        send = counts.view(ep, nl).sum(1).tolist()
        got = recv_counts.view(ep, nl)
        recv = got.sum(1).tolist()
        x = _AllToAllV.apply(self.group, rows, send, recv)
        # received rows are grouped by source rank, then local expert: regroup by local expert
        per = got.reshape(-1).tolist()
        starts = [0]
        for n in per[:-1]:
            starts.append(starts[-1] + n)
        perm = torch.cat([torch.arange(starts[s * nl + e], starts[s * nl + e] + per[s * nl + e], device=x.device)
                          for e in range(nl) for s in range(ep)] or [torch.zeros(0, dtype=torch.long)])
        y = self._local(x.index_select(0, perm), got.sum(0).tolist())
        back = torch.empty_like(y).index_copy(0, perm, y) if y.shape[0] else y
        return _AllToAllV.apply(self.group, back, recv, send)


def moe_blocks(model: nn.Module, preset: Optional[str], layer_pattern: Optional[str], expert_attr: str
               ) -> List[Tuple[str, nn.Module]]:
    """(name, block) of every MoE block to convert: of the preset's class (any known one when None), or whose
    name matches ``layer_pattern``, with stacked experts under ``expert_attr``."""
    if preset is not None and preset not in PRESET_BLOCKS:
        raise ConfigError(f"expert_parallel.preset_model {preset!r}: AutoEP knows {sorted(PRESET_BLOCKS)} (experts "
                         f"stacked as gate_up_proj / down_proj); GPT-OSS's biased experts are not supported")
    classes = {PRESET_BLOCKS[preset]} if preset is not None else set(PRESET_BLOCKS.values())
    found = []
    for name, m in model.named_modules():
        chosen = re.fullmatch(layer_pattern, name) is not None if layer_pattern else type(m).__name__ in classes
        experts = getattr(m, expert_attr, None)
        if chosen and isinstance(experts, nn.Module) and not isinstance(experts, ExpertParallelExperts):
            if not all(hasattr(experts, a) for a in ("gate_up_proj", "down_proj", "act_fn")):
                raise ConfigError(f"expert_parallel: {name}.{expert_attr} ({type(experts).__name__}) does not hold stacked "
                                 f"gate_up_proj / down_proj experts; it cannot be converted")
            found.append((name, m))
    return found


def convert_model(model: nn.Module, cfg: Any, group, ep_rank: int, ep_size: int) -> int:
    """Replace the experts of every MoE block of ``model`` (``cfg``: the ``expert_parallel`` block) by
    :class:`ExpertParallelExperts`; returns how many were converted (a model with none is an error)."""
    preset = cfg.preset_model
    if preset is None:
        model_type = getattr(getattr(model, "config", None), "model_type", None)
        preset = model_type if model_type in PRESET_BLOCKS else None
    attr = cfg.expert_pattern or "experts"
    blocks = moe_blocks(model, preset, cfg.moe_layer_pattern, attr)
    if not blocks:
        raise ConfigError(f"expert_parallel.enabled: no MoE block found in {type(model).__name__} (preset "
                         f"{preset!r}, moe_layer_pattern {cfg.moe_layer_pattern!r})")
    for _, block in blocks:
        setattr(block, attr, ExpertParallelExperts(getattr(block, attr), group, ep_rank, ep_size,
                                                   use_grouped_mm=bool(cfg.use_grouped_mm)))
    return len(blocks)
