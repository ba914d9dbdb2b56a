"""Dense 16-bit (bf16/fp16) tensor-core peaks of common accelerators, from the vendors' data sheets.

``peak_flops(device, dtype)`` gives FLOP/s per device, or None where unknown: on CPU, for fp32 training (its
peak depends on TF32 and is not one number), for a dtype the chip has no tensor cores for (bf16 on V100/T4),
and for unlisted devices. Sparse ("with sparsity") figures are never used: MFU is quoted against dense peaks.
"""
from __future__ import annotations

from typing import Optional, Tuple, Union

import torch

T = 1e12
#: (substring of the device name, bf16 dense FLOP/s, fp16 dense FLOP/s); the first match wins, so the more
#: specific names come first.
PEAK_TABLE: Tuple[Tuple[str, Optional[float], Optional[float]], ...] = (
    ("GH200", 989 * T, 989 * T),
    ("H100 PCIe", 756 * T, 756 * T),
    ("H100 NVL", 835 * T, 835 * T),
    ("H100", 989 * T, 989 * T),  # SXM
    ("H200", 989 * T, 989 * T),
    ("H800", 989 * T, 989 * T),
    ("GB200", 2500 * T, 2500 * T),
    ("B200", 2250 * T, 2250 * T),
    ("A100", 312 * T, 312 * T),
    ("A800", 312 * T, 312 * T),
    ("L40S", 362 * T, 362 * T),
    ("L40", 181 * T, 181 * T),
    ("L4", 121 * T, 121 * T),
    ("V100", None, 125 * T),
    ("T4", None, 65 * T),
    ("MI325X", 1307 * T, 1307 * T),
    ("MI300X", 1307 * T, 1307 * T),
    ("MI250X", 383 * T, 383 * T),
)


def peak_flops_for_name(name: str, dtype: torch.dtype = torch.bfloat16) -> Optional[float]:
    """The table's dense peak for a device called ``name`` (e.g. ``"NVIDIA H100 80GB HBM3"``) in ``dtype``."""
    if dtype not in (torch.bfloat16, torch.float16):
        return None
    for key, bf16, fp16 in PEAK_TABLE:
        if key.lower() in name.lower():
            return bf16 if dtype == torch.bfloat16 else fp16
    return None


def peak_flops(device: Union[torch.device, str, None] = None, dtype: torch.dtype = torch.bfloat16) -> Optional[float]:
    """Dense peak FLOP/s of ``device`` (default: the current CUDA device) in ``dtype``; None if unknown."""
    device = torch.device(device) if device is not None else (
        torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu"))
    if device.type != "cuda" or not torch.cuda.is_available():
        return None
    return peak_flops_for_name(torch.cuda.get_device_name(device), dtype)
