"""A rank's local experts as stacked parameters, computed in one batched call.

DeepSpeed's ``Experts`` deep-copies the expert module once per local expert and runs them in a Python loop.
Here each parameter of the expert is stacked over the local experts (``[num_local, *shape]``), registered
under the expert's own module path (``deepspeed_experts.fc1.weight``), and the experts run as one call:
``torch.func.vmap`` over ``functional_call`` of the expert module, which turns an ``nn.Linear``-MLP into
batched matmuls over the experts (a padded ``bmm``: every expert gets the same ``capacity`` slots). An
expert that is a plain MLP (``nn.Sequential`` of ``nn.Linear`` and element-wise activations) skips vmap: one
``bmm`` per linear whose backward gives the weight gradients in the weights' layout (:mod:`.batched`). An
expert that vmap cannot batch (data-dependent control flow, ``.item()``, random ops) runs in a loop over
the stacked slices instead; :attr:`Experts.compute_path` says which ("mlp", "vmap" or "loop"), decided at
the first forward by one trial on the real inputs (under a forked RNG, so the trial draws nothing).

Every local expert starts as a copy of the expert given (as DeepSpeed's deep copies do). ``state_dict()`` and
``load_state_dict()`` speak DeepSpeed's keys: local expert ``i``'s tensors under ``deepspeed_experts.<i>.<name>``
(views of the stacked rows; a state dict with the stacked ``deepspeed_experts.<name>`` still loads). The stacked
parameters carry DeepSpeed's tags (``allreduce = False``, ``group_name = "ep_size_N"``), so
``is_moe_param`` and ``split_params_into_different_moe_groups_for_optimizer`` see them, and ZeRO reduces
and shards them over the expert-data group.
"""
from __future__ import annotations

import copy
from typing import Any, Dict, List, Optional, Tuple

import torch
import torch.nn as nn
from torch import Tensor
from torch.func import functional_call, vmap

from ..parallel.tp.slicing import TPSlice
from .batched import mlp_layers, run_mlp


class _Holder(nn.Module):
    """A module that only holds parameters (the stacked expert's mirror of the expert's module tree)."""

    def forward(self, *args, **kwargs):  # pragma: no cover - never called
        raise RuntimeError("the stacked expert parameters are computed by Experts.forward")


def tag_expert_param(p: nn.Parameter, group_name: str) -> None:
    """DeepSpeed's tags of an expert parameter: reduced over its expert-data group, not the data group."""
    p.allreduce = False  # type: ignore[attr-defined]
    p.group_name = group_name  # type: ignore[attr-defined]


def mark_expert_slice(p: nn.Parameter, ep_rank: int, ep_size: int) -> None:
    """``p`` (``[num_local, ...]``) is rows ``[ep_rank × num_local, (ep_rank + 1) × num_local)`` of the layer's
    ``[num_experts, ...]`` stack: checkpoints key it by global expert id and reshard it to another EP size."""
    full = (p.shape[0] * ep_size, *p.shape[1:])
    p.tp_slice = TPSlice(full_shape=tuple(int(s) for s in full), dim=0, blocks=1,  # type: ignore[attr-defined]
                         rank=ep_rank, size=ep_size)


class Experts(nn.Module):
    """``num_local_experts`` copies of ``expert``, stacked; ``forward([groups, num_local, tokens, d])``."""

    def __init__(self, expert: nn.Module, num_local_experts: int = 1, expert_group_name: Optional[str] = None):
        super().__init__()
        self.num_local_experts = num_local_experts
        self.expert_group_name = expert_group_name or "ep_size_1"
        template = copy.deepcopy(expert)
        names = [n for n, _ in template.named_parameters()]
        holder = _Holder()
        for name in names:
            src = template.get_parameter(name)
            stacked = nn.Parameter(src.detach().unsqueeze(0).repeat(num_local_experts, *([1] * src.dim())),
                                   requires_grad=src.requires_grad)
            tag_expert_param(stacked, self.expert_group_name)
            _register(holder, name, stacked)
        self.deepspeed_experts = holder
        self._names = names
        # the expert's code, outside the module tree (its parameters are the stacked ones above, passed in)
        for mod in template.modules():  # its own copies are not needed: meta placeholders (buffers stay)
            for pname, prm in list(mod._parameters.items()):
                if prm is not None:
                    mod._parameters[pname] = nn.Parameter(torch.empty_like(prm, device="meta"), prm.requires_grad)
        self._template: Tuple[nn.Module, ...] = (template,)
        self._mlp = mlp_layers(template)
        self.compute_path: Optional[str] = "mlp" if self._mlp is not None else None
        self.register_state_dict_post_hook(Experts._per_expert_keys)
        self.register_load_state_dict_pre_hook(Experts._stack_expert_keys)

    def _per_expert_keys(self, state_dict: Dict[str, Any], prefix: str, local_metadata: Any) -> None:
        """state_dict: each stacked ``deepspeed_experts.<name>`` ([num_local, ...]) becomes DeepSpeed's
        ``deepspeed_experts.<i>.<name>``, local expert by local expert. A sharded placeholder (ZeRO-3, no rows)
        keeps its stacked key."""
        base = prefix + "deepspeed_experts."
        n = self.num_local_experts
        rows = [(name, state_dict.pop(base + name)) for name in self._names
                if base + name in state_dict and state_dict[base + name].dim() > 0
                and state_dict[base + name].shape[0] == n]
        for i in range(n):
            for name, t in rows:
                state_dict[f"{base}{i}.{name}"] = t[i]

    def _stack_expert_keys(self, state_dict: Dict[str, Any], prefix: str, local_metadata: Any, strict: bool,
                           missing_keys: List[str], unexpected_keys: List[str], error_msgs: List[str]) -> None:
        """load_state_dict: DeepSpeed's per-expert ``deepspeed_experts.<i>.<name>`` stacked into the parameter's
        ``deepspeed_experts.<name>``; a stacked key (our earlier state dicts) loads as it is."""
        base = prefix + "deepspeed_experts."
        for name in self._names:
            keys = [f"{base}{i}.{name}" for i in range(self.num_local_experts)]
            found = [k for k in keys if k in state_dict]
            if not found:
                continue
            if len(found) < len(keys):
                for k in found:
                    state_dict.pop(k)
                error_msgs.append(f"MoE experts {base[:-1]!r}: the state dict holds {len(found)} of this layer's "
                                  f"{len(keys)} local experts for {name!r} (missing {sorted(set(keys) - set(found))[0]!r})"
                                  f"; a state dict saved at another ep_size needs the checkpoint loader "
                                  f"(engine.load_checkpoint), which reshards experts by global id")
                continue
            state_dict[base + name] = torch.stack([state_dict.pop(k) for k in keys])

    def stacked(self) -> Dict[str, Tensor]:
        """The stacked parameters by the expert's parameter names (read here: ZeRO-3 gathers them)."""
        return {n: self.deepspeed_experts.get_parameter(n) for n in self._names}

    def set_expert_slice(self, ep_rank: int, ep_size: int) -> None:
        for p in self.deepspeed_experts.parameters():
            mark_expert_slice(p, ep_rank, ep_size)

    def _one(self, params: Dict[str, Tensor], x: Tensor) -> Tensor:
        out = functional_call(self._template[0], params, (x,), strict=False)
        return out[0] if isinstance(out, tuple) else out

    def _vmapped(self, params: Dict[str, Tensor], x: Tensor) -> Tensor:
        return vmap(self._one, in_dims=(0, 0))(params, x)

    def _looped(self, params: Dict[str, Tensor], x: Tensor) -> Tensor:
        return torch.stack([self._one({n: t[i] for n, t in params.items()}, x[i])
                            for i in range(self.num_local_experts)])

    def _choose_path(self, params: Dict[str, Tensor], x: Tensor) -> str:
        devices: List[torch.device] = [x.device] if x.device.type == "cuda" else []
        try:
            with torch.random.fork_rng(devices=devices), torch.no_grad():
                self._vmapped(params, x)
        except Exception:  # noqa: BLE001 - any failure of vmap on this expert means: run it in a loop
            return "loop"
        return "vmap"

    def forward(self, inputs: Tensor) -> Tensor:
        """``inputs``: ``[groups, num_local, tokens, d]`` (groups: the ranks the tokens came from); the same
        shape back with the experts' output dimension."""
        g, e, c, d = inputs.shape
        x = inputs.transpose(0, 1).reshape(e, g * c, d)
        params = self.stacked()
        if self.compute_path is None:
            self.compute_path = self._choose_path(params, x)
        if self._mlp is not None:
            y = run_mlp(self._mlp, params, x)
        else:
            y = self._vmapped(params, x) if self.compute_path == "vmap" else self._looped(params, x)
        return y.reshape(e, g, c, -1).transpose(0, 1)


def _register(root: nn.Module, dotted: str, p: nn.Parameter) -> None:
    *path, leaf = dotted.split(".")
    mod = root
    for part in path:
        if not hasattr(mod, part):
            mod.add_module(part, _Holder())
        mod = getattr(mod, part)
    mod.register_parameter(leaf, p)


def grouped_mm(x: Tensor, w: Tensor, counts: List[int]) -> Tensor:
    """Rows of ``x`` (``[sum(counts), k]``, grouped by expert) times their expert's ``w`` (``[e, k, n]``):
    one ``torch._grouped_mm`` where the build has it for these dtypes (CPU: fp32; CUDA: bf16), else a padded
    ``bmm`` (each group padded to the largest; also when the kernel refuses the shapes). Returns
    ``[sum(counts), n]``."""
    kernel_dtype = {"cpu": torch.float32, "cuda": torch.bfloat16}.get(x.device.type)
    if hasattr(torch, "_grouped_mm") and x.dtype == w.dtype == kernel_dtype and x.numel():
        offs = torch.tensor(counts, dtype=torch.int32, device=x.device).cumsum(0, dtype=torch.int32)
        try:
            out = torch._grouped_mm(x.contiguous(), w.contiguous(), offs=offs)
        except RuntimeError:  # e.g. strides not a multiple of 16 bytes: the padded bmm computes the same
            return padded_bmm(x, w, counts)
        if out.requires_grad:  # its CPU backward needs a dense gradient (an expanded one has zero strides)
            out.register_hook(lambda g: g.contiguous())
        return out
    return padded_bmm(x, w, counts)


def padded_bmm(x: Tensor, w: Tensor, counts: List[int]) -> Tensor:
    """:func:`grouped_mm` as one ``bmm`` over groups padded to the largest count."""
    e, width = len(counts), max(counts) if counts else 0
    if width == 0:  # no rows: still tied to x and w, so that autograd runs this rank's backward collectives
        return x.new_zeros(0, w.shape[-1]) + 0 * w.sum() + 0 * x.sum()
    rows = torch.cat([torch.arange(n, device=x.device) + i * width for i, n in enumerate(counts)])
    padded = x.new_zeros(e * width, x.shape[-1]).index_copy(0, rows, x)
    out = torch.bmm(padded.view(e, width, -1), w)
    return out.reshape(e * width, -1).index_select(0, rows)
