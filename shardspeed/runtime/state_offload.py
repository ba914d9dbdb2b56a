"""``engine.offload_states()`` / ``reload_states()``: DeepSpeed's way to free the device memory of the training
states between uses (while the same device generates, or runs a reference model) and to bring them back.

What moves (DeepSpeed's ``OffloadStateTypeEnum`` names, or the same strings):
- ``optim_states``: the optimizer's state tensors (Adam's moments);
- ``hp_params``: the fp32 master weights, where they are not the module's own parameters (fp32 training
  updates those in place: they are ``lp_params``);
- ``lp_grads`` and ``contiguous_grad_buffer``: the gradient buffers the reducer holds (shardspeed keeps both
  kinds in the one reducer, so either name moves all of them).
``lp_params`` (the module's parameters, views of the flat ZeRO buffers) is not provided: named explicitly it
fails with the one line; ``include=None`` moves everything else. States on the engine's device move into fresh
host buffers (pinned when ``pin_memory`` and the device is an accelerator); states already elsewhere (an
``offload_optimizer`` block's) stay where they are. Each tensor keeps its identity (its ``.data`` is replaced),
so the optimizer and the reducer need no rebuilding. Call both between optimizer steps, on every rank.
"""
from __future__ import annotations

import logging
from typing import Any, Callable, Container, List, Optional, Set, Tuple

import torch

from ..compat.alias import not_provided
from ..errors import ShardspeedError
from ..zero.master import MasterWeights
from ..zero.root import ZeroRoot

logger = logging.getLogger("shardspeed")

STATE_KINDS = ("optim_states", "hp_params", "lp_params", "lp_grads", "contiguous_grad_buffer")
_GRADS = ("lp_grads", "contiguous_grad_buffer")


def _value(x: Any) -> str:
    """An enum member of DeepSpeed's (``str`` enums) or a plain string, as its string."""
    return str(getattr(x, "value", x))


def _kinds(include: Optional[Container[Any]]) -> Set[str]:
    if include is None:
        return set(STATE_KINDS) - {"lp_params"}
    kinds = {_value(x) for x in include}  # type: ignore[attr-defined]
    unknown = sorted(kinds - set(STATE_KINDS))
    if unknown:
        raise ShardspeedError(f"offload_states(include=...): unknown state {unknown[0]!r}; use {', '.join(STATE_KINDS)}")
    if "lp_params" in kinds:
        raise not_provided("deepspeed.runtime.engine.DeepSpeedEngine.offload_states(include=[lp_params]): the "
                           "module's parameters stay on the device")
    return kinds


def _copier(device: torch.device, pin: bool, non_blocking: bool) -> Callable[[torch.Tensor], torch.Tensor]:
    def copy(t: torch.Tensor) -> torch.Tensor:
        if pin and device.type == "cpu" and t.device.type != "cpu":
            out = torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=True)
            return out.copy_(t, non_blocking=non_blocking)
        return t.to(device, non_blocking=non_blocking, copy=True)
    return copy


class StateOffload:
    """What :meth:`offload` moved, each tensor with the device it came from, so that :meth:`reload` puts it back."""

    def __init__(self, device: torch.device):
        self.device = device  # the engine's device: only states held there move
        self.moved: List[Tuple[torch.Tensor, torch.device]] = []  # optimizer states, gradient buffers
        self.masters: List[Tuple[torch.Tensor, torch.device]] = []  # fp32 masters (their views follow them)

    @property
    def offloaded(self) -> bool:
        return bool(self.moved or self.masters)

    def _copy_out(self, t: torch.Tensor, copy: Callable[[torch.Tensor], torch.Tensor],
                  record: List[Tuple[torch.Tensor, torch.device]]) -> Optional[torch.Tensor]:
        """The data to move ``t`` into, recording where it came from; None: it stays (held elsewhere, empty, or
        moved already)."""
        if t.device != self.device or t.numel() == 0 or any(t is m for m, _ in self.moved + self.masters):
            return None
        record.append((t, t.device))
        return copy(t.data)

    def offload(self, master: MasterWeights, reducer: ZeroRoot, include: Optional[Container[Any]],
                device: Any, pin_memory: bool, non_blocking: bool) -> None:
        target = _value(device)
        kinds = _kinds(include)
        if target == "none":
            logger.warning("offload_states(device='none'): no device given, nothing moved")
            return
        if target != "cpu":
            raise ValueError(f"offload_states(device={target!r}): only 'cpu' is supported (as in DeepSpeed)")
        copy = _copier(torch.device("cpu"), pin_memory and self.device.type != "cpu", non_blocking)
        if "hp_params" in kinds:
            master.move_masters(lambda m: self._copy_out(m, copy, self.masters))
        tensors: List[torch.Tensor] = []
        if "optim_states" in kinds:
            tensors += [v for st in master.optimizer.state.values() for v in st.values()
                        if torch.is_tensor(v) and v.dim() > 0]
        if kinds & set(_GRADS):
            tensors += reducer.held_tensors()
        for t in tensors:
            data = self._copy_out(t, copy, self.moved)
            if data is not None:
                t.data = data

    def reload(self, master: MasterWeights, non_blocking: bool) -> None:
        for t, dev in self.moved:
            t.data = t.data.to(dev, non_blocking=non_blocking, copy=True)
        back = {id(m): dev for m, dev in self.masters}
        master.move_masters(lambda m: m.data.to(back[id(m)], non_blocking=non_blocking, copy=True)
                            if id(m) in back else None)
        self.moved, self.masters = [], []
        if non_blocking and self.device.type == "cuda":
            torch.cuda.current_stream().synchronize()  # the host buffers may be freed after this returns
