"""NVMe swap files: whole-buffer I/O and the checksums that verify every read.

- :class:`SwapFile`: one swap file; reads and writes all of a buffer at an offset, with ``O_DIRECT`` where
  alignment and the file system allow (no copy into the page cache: writes take a twentieth of the CPU time),
  optionally checksumming the bytes chunk by chunk as they pass.
- :func:`block_sums`: one int64 per :data:`SUM_BLOCK` bytes of swap data, kept in memory by the writer;
  :func:`check_sums` compares what a read found against it and raises :func:`swap_corrupted`, an error
  naming the file, what was read and the first bad byte.

Used by the optimizer state store (:mod:`.store`) and the parameter file (:mod:`.param_file`).
"""
from __future__ import annotations

import errno
import os
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import List, Optional

import torch

from ..errors import ShardspeedError
from ..utils.direct_io import ALIGN, aligned_empty, aligned_size, direct_ok, open_direct
from ..utils.safe_files import create_new, reopen

#: Bytes per checksummed block of swap data (a page): one int64 of checksum in memory per block.
SUM_BLOCK = 4096
_SUM_WORDS = SUM_BLOCK // 8


#: Bytes per ``preadv``/``pwritev`` call. Checksummed I/O sums each chunk while the others are in transfer
#: in the file's I/O thread, so that on a disk the sums hide under the I/O.
_IO_CHUNK = 4 << 20


class SwapFile:
    """One swap file, created empty at ``path`` (nothing may be there yet) and opened twice: buffered, and
    with ``O_DIRECT`` where the file system allows it (:func:`~shardspeed.utils.direct_io.open_direct`; the
    name opened again is checked to lead to the same file). A transfer whose address, file
    offset and length are :data:`~shardspeed.utils.direct_io.ALIGN`-aligned goes straight between the
    buffer and the disk; a write at an aligned offset from any other buffer goes through an aligned bounce
    buffer when the caller says the bytes up to the next aligned boundary are padding (``pad``); anything
    else goes through the page cache, which the kernel keeps coherent with the direct transfers. Without
    ``O_DIRECT`` every transfer is buffered, with the same results."""

    def __init__(self, path: str):
        self.path = path
        self.fd = create_new(path, os.O_RDWR, 0o600)  # never an existing file, nor through a link
        try:
            self.direct_fd = reopen(path, self.fd, os.O_RDWR, open_direct)  # checked: the file just created
        except OSError:
            os.close(self.fd)
            raise
        self._bounce: Optional[torch.Tensor] = None
        self._pool: Optional[ThreadPoolExecutor] = None  # the transfers of checksummed I/O (made at first use)
        self._lock = threading.Lock()  # the bounce buffer and the pool (several threads do I/O on one file)
        self._retired: List[int] = []  # a direct descriptor whose transfers the file system refused

    def preallocate(self, offset: int, nbytes: int) -> None:
        """Reserve ``nbytes`` at ``offset`` now (``posix_fallocate``: a full disk fails here, not later)."""
        os.posix_fallocate(self.fd, offset, nbytes)

    def read(self, buf: torch.Tensor, offset: int, checksum: bool = False) -> Optional[torch.Tensor]:
        """Fill ``buf`` (contiguous) from ``offset``; ``checksum``: also return the :func:`block_sums` of
        the bytes read, computed chunk by chunk as they arrive."""
        return self._io(True, buf, offset, checksum, False)

    def write(self, buf: torch.Tensor, offset: int, checksum: bool = False, pad: bool = False
              ) -> Optional[torch.Tensor]:
        """Write all of ``buf`` at ``offset`` (returning its block sums with ``checksum``). ``pad``: the file's
        bytes after it up to the next aligned boundary are padding, which may be written as zeros."""
        return self._io(False, buf, offset, checksum, pad)

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
        for fd in (self.fd, self.direct_fd, *self._retired):
            if fd is not None:
                try:
                    os.close(fd)
                except OSError:
                    pass

    def _io(self, reading: bool, buf: torch.Tensor, offset: int, checksum: bool, pad: bool
            ) -> Optional[torch.Tensor]:
        if not buf.is_contiguous():  # reshape would copy, and a read would land in the copy
            raise ValueError("NVMe I/O needs a contiguous buffer")
        data = buf.reshape(-1).view(torch.uint8)  # a uint8 view works for bf16/fp16 too
        total = data.numel()
        sums = _ChunkSums(data) if checksum else None
        step = _IO_CHUNK if sums is None or sums.words is not None else max(total, 1)
        chunks = [(c0, min(c0 + step, total)) for c0 in range(0, total, step)]
        # several chunks: the transfers run back to back in the file's I/O thread (queued at once: no wake-up
        # between two of them), while this thread sums each chunk once it is read, or before it is queued for
        # writing: on a disk the sums take no time of their own. One chunk: nothing to overlap, done here.
        submit = self._io_thread().submit if len(chunks) > 1 else _run_now
        futs: List[Future] = []
        try:
            for c0, c1 in chunks:
                if sums is not None and not reading:
                    sums.add(c0, c1)
                futs.append(submit(self._move, reading, data[c0:c1], offset + c0, pad))
            for fut, (c0, c1) in zip(futs, chunks):
                fut.result()
                if sums is not None and reading:
                    sums.add(c0, c1)
        finally:
            for fut in futs:  # after an error, the transfers still queued end before the buffer is let go
                fut.exception()
        return sums.out if sums is not None else None

    def _io_thread(self) -> ThreadPoolExecutor:
        with self._lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(1, thread_name_prefix="shardspeed-swap-io")
            return self._pool

    def _move(self, reading: bool, chunk: torch.Tensor, at: int, pad: bool) -> None:
        """Transfer one chunk (uint8) at file byte ``at`` the cheapest way its alignment allows."""
        fn = os.preadv if reading else os.pwritev
        direct = self.direct_fd
        if direct is not None and at % ALIGN == 0:
            try:
                if direct_ok(chunk, at):
                    return _transfer_all(fn, direct, chunk, at, self.path, self.fd)
                if pad and not reading and chunk.numel() <= _IO_CHUNK:
                    n = chunk.numel()
                    with self._lock:
                        if self._bounce is None:
                            self._bounce = aligned_empty(_IO_CHUNK)
                        padded = self._bounce[: aligned_size(n)]
                        padded[:n].copy_(chunk)
                        padded[n:].zero_()
                        return _transfer_all(fn, direct, padded, at, self.path, self.fd)
            except OSError as e:  # took O_DIRECT at open, refuses the transfer: buffered from now on
                if e.errno != errno.EINVAL:
                    raise
                self.direct_fd = None
                self._retired.append(direct)  # closed at close(): another thread may still be in a transfer on it
        _transfer_all(fn, self.fd, chunk, at, self.path)


def _run_now(fn, *args) -> Future:
    """``fn(*args)`` on the calling thread, as a finished :class:`Future` (its result or its error)."""
    fut: Future = Future()
    try:
        fut.set_result(fn(*args))
    except BaseException as e:
        fut.set_exception(e)
    return fut


def _transfer_all(fn, fd: int, chunk: torch.Tensor, at: int, path: str, rest_fd: Optional[int] = None) -> None:
    """``fn`` (``os.preadv``/``os.pwritev``, which release the GIL) over all of ``chunk``, looping over
    short transfers (after a short one, on ``rest_fd``: a short ``O_DIRECT`` read at the end of a truncated
    file leaves an unaligned rest); a transfer of nothing is a full disk or a truncated file."""
    view = memoryview(chunk.numpy()).cast("B")  # type: ignore[arg-type]  # ndarray is a buffer
    done = 0
    while done < len(view):
        n = fn(fd, [view[done:]], at + done)
        if n <= 0:
            what = "read" if fn is os.preadv else "write"
            raise ShardspeedError(f"NVMe offload: short {what} at byte {at + done} of {path} (disk full or "
                                  f"file truncated?)")
        done += n
        fd = rest_fd if rest_fd is not None else fd


class _ChunkSums:
    """The :func:`block_sums` of a buffer's bytes, computed a chunk at a time as they pass."""

    def __init__(self, data: torch.Tensor):
        self.data = data
        total = data.numel()
        self.out = torch.empty(n_blocks(total), dtype=torch.int64)
        self.full = total - total % SUM_BLOCK
        #: the whole blocks as rows of int64 words (None: unaligned or under one block, summed in one pass)
        self.words = (data[: self.full].view(torch.int64).view(-1, _SUM_WORDS)
                      if self.full and data.storage_offset() % 8 == 0 else None)

    def add(self, c0: int, c1: int) -> None:
        if self.words is None:  # one pass, from an aligned copy
            self.out.copy_(block_sums(self.data))
            return
        b0, b1 = c0 // SUM_BLOCK, min(c1, self.full) // SUM_BLOCK
        if b1 > b0:
            _sum_blocks(self.words[b0:b1], self.out[b0:b1])
        if c1 == self.data.numel() > self.full:  # the last, partial block
            self.out[-1] = block_sums(self.data[self.full:])[0]


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
