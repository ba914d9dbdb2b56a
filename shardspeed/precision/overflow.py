"""Overflow (inf/NaN) detection over many gradient tensors without a host sync per tensor."""

from __future__ import annotations

from typing import Iterable, Optional

import torch

__all__ = ["has_inf_or_nan"]


def has_inf_or_nan(
    tensors: Iterable[Optional[torch.Tensor]], device: Optional[torch.device] = None
) -> torch.Tensor:
    """A 0-dim float32 tensor: 1.0 if any element of ``tensors`` is inf or NaN, else 0.0.

    Local to this process (no collective) and without a host-device sync: the tensors are grouped by
    device; per device, one ``torch._foreach_norm(..., inf)`` (the max-abs of each tensor; NaN propagates
    through the max, an inf stays inf, and unlike a sum it cannot overflow on finite values) and one
    ``isfinite`` over the stacked norms. The per-device flags are moved to the first tensor's device and
    combined with a max. The result is float (not bool) so a caller can all-reduce it with MAX (gloo has
    no bool reduction). ``None`` entries and empty tensors are skipped; for an empty input the result is
    0.0 on ``device`` (default CPU).

    The engine itself does not call this: it detects fp16 overflow from a non-finite global gradient
    norm (:meth:`shardspeed.zero.master.MasterWeights.step`).
    """
    ts = [t for t in tensors if t is not None and t.numel() > 0]
    if not ts:
        return torch.zeros((), dtype=torch.float32, device=device)
    out_device = ts[0].device
    by_device: dict = {}
    for t in ts:
        by_device.setdefault(t.device, []).append(t)
    flags = []
    for dev_tensors in by_device.values():
        norms = torch._foreach_norm(dev_tensors, float("inf"))
        finite = torch.isfinite(torch.stack([n.float() for n in norms])).all()
        flags.append((~finite).float().to(out_device, non_blocking=True))
    return flags[0] if len(flags) == 1 else torch.stack(flags).amax()
