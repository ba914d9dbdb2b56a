"""Copies between the training device and the host, asynchronous where the device allows.

On CUDA a dedicated copy stream carries every device↔host copy, host buffers are pinned, and each copy
returns an event to wait on: a gradient tile's copy to the host overlaps the step of the previous tile,
an updated tile's copy back overlaps the next step. On a CPU-only machine the same calls copy at once and
return ``None`` (nothing to wait for): one code path, with streams only where they exist.
"""
from __future__ import annotations

from typing import List, Optional

import torch


class HostCopier:
    def __init__(self, device: torch.device, out_dtype: torch.dtype, tile_elems: int, pin_memory: bool):
        self.device = device
        self.cuda = device.type == "cuda"
        pin = pin_memory and self.cuda
        self.stream = torch.cuda.Stream(device) if self.cuda else None
        # two slots: tile k+1's gradient arrives while tile k steps
        self.grad_slots = [torch.empty(tile_elems, dtype=torch.float32, pin_memory=pin) for _ in range(2)]
        # low-precision copies of updated tiles on their way back (only when a cast is needed on a device)
        self.cast_out = self.cuda and out_dtype != torch.float32
        self.out_slots = ([torch.empty(tile_elems, dtype=out_dtype, pin_memory=pin) for _ in range(2)]
                          if self.cast_out else [])
        self.out_events: List[Optional[torch.cuda.Event]] = [None, None]

    @property
    def buffer_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.grad_slots + self.out_slots)

    def begin(self) -> None:
        """The copy stream waits for the gradients the compute stream produced."""
        if self.stream is not None:  # CUDA
            self.stream.wait_stream(torch.cuda.current_stream(self.device))

    def end(self) -> None:
        """The compute stream waits for the updated weights (before the all-gather reads them)."""
        if self.stream is not None:  # CUDA
            torch.cuda.current_stream(self.device).wait_stream(self.stream)

    def grad_to_host(self, slot: int, src: Optional[torch.Tensor], n: int):
        """fp32 host copy of a gradient tile in ``grad_slots[slot]``; returns (tensor, event or None)."""
        dst = self.grad_slots[slot][:n]
        if src is None:
            dst.zero_()
            return dst, None
        if not self.cuda:
            dst.copy_(src)
            return dst, None
        with torch.cuda.stream(self.stream):
            dst.copy_(src, non_blocking=True)  # a device-side cast (if any), then the D2H copy
            ev = torch.cuda.Event()
            ev.record(self.stream)
        return dst, ev

    def to_device(self, slot: int, dst: torch.Tensor, master: torch.Tensor):
        """Copy an updated fp32 master tile into the (low-precision) device shard; returns an event
        after which ``master`` may be overwritten, or None."""
        if not self.cuda:
            dst.copy_(master)
            return None
        src = master
        if self.cast_out:
            prev = self.out_events[slot]
            if prev is not None:
                prev.synchronize()  # the slot's previous copy has left
            src = self.out_slots[slot][: master.numel()]
            src.copy_(master)  # cast on the host: half the bytes cross the bus
        with torch.cuda.stream(self.stream):
            dst.copy_(src, non_blocking=True)
            ev = torch.cuda.Event()
            ev.record(self.stream)
        if self.cast_out:
            self.out_events[slot] = ev
            return None  # master itself was only read on the host, synchronously
        return ev
