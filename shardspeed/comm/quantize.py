"""Block-wise symmetric integer quantization (ZeRO++'s codec), in plain torch ops.

A row of ``n`` values is cut into blocks of ``block`` values (the last one shorter when ``block`` does not
divide ``n``); each block gets one fp32 scale, ``absmax / qmax``, and its values are rounded to the nearest
integer in ``[-qmax, qmax]`` (int8: 127; int4: 7, two values packed per byte). Decoding multiplies back.
The error of a value is at most half its block's scale: ``absmax / (2 * qmax)`` (:meth:`BlockCodec.bound`).

Every operation works on 2-D ``(rows, n)`` views so one call encodes a rank's shard (one row) or a bucket's
per-rank chunks (``world`` rows), and the ops are elementwise and reductions that fuse well on a GPU.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Tuple

import torch

from ..errors import ConfigError


@dataclass(frozen=True)
class BlockCodec:
    """``bits``: 8 or 4; ``block``: values per scale."""

    bits: int = 8
    block: int = 256

    def __post_init__(self) -> None:
        if self.bits not in (4, 8):
            raise ConfigError(f"quantization bits must be 8 or 4, not {self.bits}")
        if self.block < 2 or self.block % 2:
            raise ConfigError(f"quantization block must be an even number of values >= 2, not {self.block}")

    @property
    def qmax(self) -> int:
        return 127 if self.bits == 8 else 7

    def blocks(self, n: int) -> int:
        """Scales per row of ``n`` values."""
        return -(-n // self.block)

    def code_bytes(self, n: int) -> int:
        """Bytes of codes per row of ``n`` values (int4: two per byte, a last odd value padded)."""
        return n if self.bits == 8 else (n + 1) // 2

    def wire_bytes(self, n: int) -> int:
        """Bytes one row of ``n`` values takes on the wire: codes plus fp32 scales."""
        return self.code_bytes(n) + 4 * self.blocks(n)

    def bound(self, x: torch.Tensor) -> torch.Tensor:
        """The largest error decoding may make on each block of the rows of ``x``: half a step."""
        return _absmax(x.float(), self.block) / (2 * self.qmax)

    def encode(self, x: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        """``x`` (rows, n), any float dtype → codes (rows, code_bytes(n)) uint8 or int8, scales (rows, blocks) fp32."""
        rows, n = x.shape
        xf = x.float()
        scales = _absmax(xf, self.block).div_(self.qmax)
        inv = torch.where(scales > 0, scales.reciprocal(), torch.zeros_like(scales))
        q = _per_block(xf, inv, self.block).round_().clamp_(-self.qmax, self.qmax)
        if self.bits == 8:
            return q.to(torch.int8), scales
        nib = q.add_(8).to(torch.uint8)  # 1..15
        if n % 2:
            nib = torch.cat([nib, torch.full((rows, 1), 8, dtype=torch.uint8, device=x.device)], dim=1)
        pairs = nib.view(rows, -1, 2)
        return pairs[..., 0] | (pairs[..., 1] << 4), scales

    def decode(self, codes: torch.Tensor, scales: torch.Tensor, out: torch.Tensor, accumulate: bool = False) -> None:
        """Write (or with ``accumulate`` add) the decoded rows into ``out`` (rows, n), any float dtype."""
        rows, n = out.shape
        if self.bits == 8:
            values = codes.float()
        else:
            lo = (codes & 0xF).to(torch.int8) - 8
            hi = (codes >> 4).to(torch.int8) - 8
            values = torch.stack([lo, hi], dim=-1).view(rows, -1)[:, :n].float()
        decoded = _per_block(values, scales, self.block)
        if accumulate:
            out.add_(decoded)
        else:
            out.copy_(decoded)


def _absmax(x: torch.Tensor, block: int) -> torch.Tensor:
    """(rows, blocks) fp32: the largest magnitude in each block of each row."""
    rows, n = x.shape
    full = n // block
    parts = []
    if full:
        parts.append(x[:, : full * block].reshape(rows, full, block).abs().amax(dim=2))
    if n % block:
        parts.append(x[:, full * block :].abs().amax(dim=1, keepdim=True))
    return torch.cat(parts, dim=1) if len(parts) > 1 else parts[0].clone()


def _per_block(x: torch.Tensor, factor: torch.Tensor, block: int) -> torch.Tensor:
    """``x`` (rows, n) times ``factor`` (rows, blocks), one factor per block: a new fp32 tensor."""
    rows, n = x.shape
    full = n // block
    out = torch.empty(rows, n, dtype=torch.float32, device=x.device)
    if full:
        torch.mul(x[:, : full * block].reshape(rows, full, block), factor[:, :full, None],
                  out=out[:, : full * block].view(rows, full, block))
    if n % block:
        torch.mul(x[:, full * block :], factor[:, full:], out=out[:, full * block :])
    return out
