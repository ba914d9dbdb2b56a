"""ZeRO++'s quantized collectives over :class:`~shardspeed.comm.collectives.Collectives`.

- :func:`quantized_all_gather` (qwZ): each rank encodes its piece (int8 or int4 codes, an fp32 scale per
  block); codes and scales are all-gathered and decoded into the output when the handle is waited on.
- :func:`quantized_reduce_scatter` (qgZ): each rank encodes its whole input as ``world`` rows (row ``r``
  is the chunk rank ``r`` receives), one ``all_to_all_single`` exchanges the rows, and the receiver
  decodes the ``world`` contributions to its chunk and sums them in fp32 into the output. One hop: the
  two-hop form (within a node, then across) needs a node level in the mesh, which a single machine lacks.

Both log each collective they hand to ``torch.distributed`` with its real (coded) bytes, so the comms log
and a counter at ``torch.distributed`` agree.
"""
from __future__ import annotations

from typing import Callable, List, Optional

import torch

from .collectives import Collectives, CommHandle
from .quantize import BlockCodec


class DecodedHandle(CommHandle):
    """The collectives of one coded operation: ``wait()`` waits for them, then decodes (once)."""

    __slots__ = ("_parts", "_finish")

    def __init__(self, tensor: torch.Tensor, parts: List[CommHandle], finish: Callable[[], None]):
        self.tensor = tensor
        self._parts: Optional[List[CommHandle]] = parts
        self._finish = finish

    def is_completed(self) -> bool:
        return self._parts is None or all(p.is_completed() for p in self._parts)

    def wait(self) -> torch.Tensor:
        if self._parts is not None:
            for p in self._parts:
                p.wait()
            self._parts = None
            self._finish()
        return self.tensor


def quantized_all_gather(comm: Collectives, output: torch.Tensor, input: torch.Tensor, codec: BlockCodec,
                         async_op: bool = False) -> CommHandle:
    """Every rank's ``input`` (n values), coded, into ``output`` (world × n values) in rank order (one rank:
    copied, nothing is on a wire)."""
    if comm.world == 1:
        return comm.all_gather(output, input, async_op=async_op)
    n, world = input.numel(), comm.world
    codes, scales = codec.encode(input.reshape(1, n))
    all_codes = torch.empty(world, codes.shape[1], dtype=codes.dtype, device=codes.device)
    all_scales = torch.empty(world, scales.shape[1], dtype=scales.dtype, device=scales.device)
    parts = [comm.all_gather(all_codes.view(-1), codes.view(-1), async_op=True),
             comm.all_gather(all_scales.view(-1), scales.view(-1), async_op=True)]

    def finish() -> None:
        codec.decode(all_codes, all_scales, output.view(world, n))

    handle = DecodedHandle(output, parts, finish)
    if not async_op:
        handle.wait()
    return handle


def quantized_reduce_scatter(comm: Collectives, output: torch.Tensor, input: torch.Tensor, codec: BlockCodec,
                             async_op: bool = False) -> CommHandle:
    """The sum over ranks of chunk ``rank`` of ``input`` (world × n values) into ``output`` (n values), each
    contribution coded on the wire and summed in fp32 (one rank: copied)."""
    if comm.world == 1:
        return comm.reduce_scatter(output, input, async_op=async_op)
    world = comm.world
    n = input.numel() // world
    codes, scales = codec.encode(input.view(world, n))
    got_codes, got_scales = torch.empty_like(codes), torch.empty_like(scales)
    parts = [comm.all_to_all_single(got_codes, codes, async_op=True),
             comm.all_to_all_single(got_scales, scales, async_op=True)]

    def finish() -> None:
        total = torch.zeros(1, n, dtype=torch.float32, device=output.device)
        for r in range(world):
            codec.decode(got_codes[r : r + 1], got_scales[r : r + 1], total, accumulate=True)
        output.copy_(total.view(-1))

    handle = DecodedHandle(output, parts, finish)
    if not async_op:
        handle.wait()
    return handle


class QuantizedGather:
    """``Collectives.all_gather``'s signature over :func:`quantized_all_gather` (what a stage-3 unit is given to
    gather with under qwZ)."""

    def __init__(self, comm: Collectives, codec: BlockCodec):
        self.comm = comm
        self.codec = codec
        self.world = comm.world

    def all_gather(self, output: torch.Tensor, input: torch.Tensor, async_op: bool = False) -> CommHandle:
        return quantized_all_gather(self.comm, output, input, self.codec, async_op=async_op)
