"""NVMe swap files: whole-buffer I/O and the checksums that verify every read.

- :func:`_rw_all`: read or write all of a buffer at an offset (``os.preadv``/``os.pwritev``, which release
  the GIL), looping over short transfers, optionally checksumming the bytes chunk by chunk as they pass.
- :func:`block_sums`: one int64 per :data:`SUM_BLOCK` bytes of swap data, kept in memory by the writer;
  :func:`check_sums` compares what a read found against it and raises :func:`swap_corrupted`, an error
  naming the file, what was read and the first bad byte.

Used by the optimizer state store (:mod:`.store`) and the parameter file (:mod:`.param_file`).
"""
from __future__ import annotations

import os
from typing import Optional

import torch

from ..errors import ShardspeedError

#: Bytes per checksummed block of swap data (a page): one int64 of checksum in memory per block.
SUM_BLOCK = 4096
_SUM_WORDS = SUM_BLOCK // 8


#: Bytes per ``preadv``/``pwritev`` call when the data is checksummed on the way: each chunk is summed just
#: after it is read (before it is written), while it is still in the CPU cache: about 2.5 times cheaper than
#: summing the whole buffer after (or before) one big transfer.
_IO_CHUNK = 4 << 20


def _rw_all(fn, fd: int, buf: torch.Tensor, offset: int, what: str, path: str = "",
            checksum: bool = False) -> Optional[torch.Tensor]:
    """Read or write all of ``buf`` (contiguous) at ``offset`` of ``path`` (``fn`` is ``os.preadv`` or
    ``os.pwritev``), looping over short transfers; a transfer of nothing is a full disk or a truncated file.
    ``checksum``: also return the :func:`block_sums` of the bytes read or written, computed chunk by chunk
    as they pass."""
    if not buf.is_contiguous():  # reshape would copy, and a read would land in the copy
        raise ValueError("NVMe I/O needs a contiguous buffer")
    data = buf.reshape(-1).view(torch.uint8)  # a uint8 view works for bf16/fp16 too
    view = memoryview(data.numpy()).cast("B")  # type: ignore[arg-type]  # ndarray is a buffer
    total = len(view)
    reading = fn is os.preadv
    sums = torch.empty(n_blocks(total), dtype=torch.int64) if checksum else None
    full = total - total % SUM_BLOCK
    words = None  # the whole blocks as rows of int64 words, summed a chunk at a time
    if sums is not None and full and data.storage_offset() % 8 == 0:
        words = data[:full].view(torch.int64).view(-1, _SUM_WORDS)
    step = _IO_CHUNK if words is not None else max(total, 1)

    def sum_chunk(c0: int, c1: int) -> None:
        assert sums is not None
        if words is None:  # unaligned (or under one block): one pass, from an aligned copy
            sums.copy_(block_sums(data))
            return
        b0, b1 = c0 // SUM_BLOCK, min(c1, full) // SUM_BLOCK
        if b1 > b0:
            _sum_blocks(words[b0:b1], sums[b0:b1])
        if c1 == total > full:  # the last, partial block
            sums[-1] = block_sums(data[full:])[0]

    for c0 in range(0, total, step):
        c1 = min(c0 + step, total)
        if sums is not None and not reading:
            sum_chunk(c0, c1)
        done = c0
        while done < c1:
            n = fn(fd, [view[done:c1]], offset + done)
            if n <= 0:
                where = f" of {path}" if path else ""
                raise ShardspeedError(f"NVMe offload: short {what} at byte {offset + done}{where} (disk full or "
                                      f"file truncated?)")
            done += n
        if sums is not None and reading:
            sum_chunk(c0, c1)
    return sums


# ---- swap integrity ----------------------------------------------------------------------------------
def n_blocks(nbytes: int) -> int:
    """Checksummed blocks of ``nbytes`` bytes of swap data."""
    return -(-nbytes // SUM_BLOCK)


def _sum_blocks(words: torch.Tensor, out: torch.Tensor) -> None:
    """``out[i]``: the wrapping int64 sum of row ``i`` of ``words`` (one block per row). All checksum work
    goes through here (``benchmarks/bench_nvme_checksum.py`` times it)."""
    torch.sum(words, dim=1, out=out)


def block_sums(data: torch.Tensor) -> torch.Tensor:
    """The checksum of a CPU tensor's bytes: for each :data:`SUM_BLOCK`-byte block (the last one zero-padded)
    the wrapping int64 sum of its 8-byte words, an int64 tensor of :func:`n_blocks` entries.

    Any change to one word changes its block's sum; random bytes, a NaN or a finite overwrite leave it by
    chance only (2**-64 per block); blocks moved to other places change both sums. Words permuted within one
    4 KiB block are not seen. It runs at memory speed (one vectorised reduction, the GIL released), about
    four times faster than ``zlib.crc32``/``adler32`` (``benchmarks/bench_nvme_checksum.py``). Same bytes,
    same sums, wherever they lie in memory."""
    b = data.reshape(-1).view(torch.uint8)
    n = b.numel()
    if b.storage_offset() % 8:  # the int64 view needs 8-byte alignment: an aligned copy
        b = b.clone()
    full = n - n % SUM_BLOCK
    sums = torch.empty(n_blocks(n), dtype=torch.int64)
    if full:
        _sum_blocks(b[:full].view(torch.int64).view(-1, _SUM_WORDS), sums[: full // SUM_BLOCK])
    if n > full:
        tail = torch.zeros(SUM_BLOCK, dtype=torch.uint8)
        tail[: n - full] = b[full:]
        sums[-1] = tail.view(torch.int64).sum()
    return sums


def swap_corrupted(path: str, what: str, file_byte: int, expected: torch.Tensor,
                   found: torch.Tensor) -> ShardspeedError:
    """The error for swap data that differs from what this process wrote: names the file, what was read
    (``what``: the tile or region), the first bad byte and both checksums."""
    bad = (expected != found).nonzero().reshape(-1)
    k = int(bad[0])
    mask = (1 << 64) - 1
    first = file_byte + k * SUM_BLOCK
    return ShardspeedError(
        f"NVMe swap corrupted: {path}, {what}: {bad.numel()} of {expected.numel()} {SUM_BLOCK}-byte blocks differ "
        f"from what this process wrote there, the first is bytes [{first}, {first + SUM_BLOCK}) of the file "
        f"(checksum expected {int(expected[k]) & mask:#018x}, found {int(found[k]) & mask:#018x}). The file changed "
        f"on disk (a disk or filesystem fault, or another process writing under nvme_path), so the run stops "
        f"rather than train on it; the other ranks fail at their next collective. Restart from the last "
        f"checkpoint, and check the disk (dmesg, SMART) if it happens again.")


def check_sums(expected: Optional[torch.Tensor], found: Optional[torch.Tensor], path: str, what: str,
               file_byte: int) -> None:
    """Raise :func:`swap_corrupted` unless the block sums ``found`` of data read at ``file_byte`` of ``path``
    are the ``expected`` ones (either None: nothing recorded or computed, nothing checked)."""
    if expected is not None and found is not None and not torch.equal(found, expected):
        raise swap_corrupted(path, what, file_byte, expected, found)
