"""File I/O that bypasses the OS page cache (Linux ``O_DIRECT``), for checkpoints and NVMe swap.

A buffered write is a copy into the page cache made by the kernel on the writing thread, and its pages
are written back and reclaimed later, again on the CPU: on this project's 2-core VM, writing 80 MiB
buffered costs 0.12-0.20 s of CPU, against 0.005-0.007 s with ``O_DIRECT`` (the device's DMA moves the
bytes); reading 80 MiB with ``O_DIRECT`` costs 0.005-0.008 s of CPU (``benchmarks/bench_async_save.py``,
``benchmarks/bench_nvme_checksum.py``). That CPU is taken from training whenever the cores are busy, and a
checkpoint or a swap file that is larger than the free memory only evicts useful pages. DeepSpeed's
``aio`` library opens its swap files with ``O_DIRECT`` for the same reasons.

``O_DIRECT`` needs the memory address, the file offset and the length of every transfer to be multiples
of the device's logical block size; :data:`ALIGN` (4 KiB) is one on every common device.

- :func:`aligned_empty`: a host buffer at an :data:`ALIGN`-aligned address.
- :func:`open_direct`: a file opened with ``O_DIRECT``, or None where the OS or the file system refuses it
  (macOS, tmpfs and some FUSE/network file systems): callers then use buffered I/O, with the same results.
- :func:`direct_ok`: whether one transfer meets the alignment rules.
- :class:`StreamWriter`: a file written front to back from buffers of any address and length, through an
  aligned bounce buffer (one ``memcpy`` of each byte, on the calling thread); the last partial block is
  written padded and the file truncated to its length.
"""
from __future__ import annotations

import errno
import os
from typing import Callable, Optional

import numpy as np
import torch

from .safe_files import create_new, reopen

#: Alignment of address, offset and length for ``O_DIRECT`` transfers.
ALIGN = 4096

#: Bytes per ``O_DIRECT`` write of :class:`StreamWriter`.
STREAM_CHUNK = 8 << 20

_REFUSED = (errno.EINVAL, errno.EOPNOTSUPP, errno.ENOTSUP, errno.EPERM)


def aligned_size(nbytes: int) -> int:
    """``nbytes`` rounded up to a multiple of :data:`ALIGN`."""
    return -(-nbytes // ALIGN) * ALIGN


def aligned_empty(nbytes: int, pin: bool = False) -> torch.Tensor:
    """An uninitialised uint8 host tensor of ``nbytes`` bytes whose data starts at an :data:`ALIGN`-aligned
    address (pinned with ``pin``): a view into an allocation :data:`ALIGN` bytes larger."""
    raw = torch.empty(nbytes + ALIGN, dtype=torch.uint8, pin_memory=pin)
    skip = -raw.data_ptr() % ALIGN
    return raw[skip: skip + nbytes]


def open_direct(path: str, flags: int, mode: int = 0o600) -> Optional[int]:
    """``os.open(path, flags | O_DIRECT)``, or None where ``O_DIRECT`` is not available for ``path`` (the
    OS lacks it, or its file system refuses it). Other errors (missing folder, no permission) are raised."""
    direct = getattr(os, "O_DIRECT", 0)
    if not direct:
        return None
    try:
        return os.open(path, flags | direct, mode)
    except OSError as e:
        if e.errno in _REFUSED:
            return None
        raise


def direct_ok(t: torch.Tensor, offset: int) -> bool:
    """Whether reading or writing all of the contiguous host tensor ``t`` at file ``offset`` meets the
    ``O_DIRECT`` alignment rules (address, offset and length multiples of :data:`ALIGN`)."""
    nbytes = t.numel() * t.element_size()
    return nbytes > 0 and t.data_ptr() % ALIGN == 0 and offset % ALIGN == 0 and nbytes % ALIGN == 0


class StreamWriter:
    """A new file at ``path`` (created by this call: nothing, not even a link, may be there;
    :func:`~shardspeed.utils.safe_files.create_new`), written front to back by :meth:`write` and finished by
    :meth:`close`. With ``O_DIRECT`` (:func:`open_direct`, on the same file opened again by name, checked to
    be the one created), the bytes go through a bounce buffer of :data:`STREAM_CHUNK` bytes, written whenever
    it fills; otherwise they are written as given, buffered. :meth:`flush` hands everything written so far
    to the OS (a crash test's partial file)."""

    def __init__(self, path: str, chunk: int = STREAM_CHUNK):
        self.path = path
        self._plain = create_new(path, os.O_WRONLY, 0o644)
        try:
            fd = reopen(path, self._plain, os.O_WRONLY, open_direct)
        except BaseException:
            os.close(self._plain)
            raise
        self.direct = fd is not None
        self.fd = fd if fd is not None else self._plain
        self.written = 0  # bytes accepted by write()
        self._file_pos = 0  # bytes of the file that are final (always a multiple of the chunk when direct)
        self._bounce = aligned_empty(chunk).numpy() if self.direct else None
        self._fill = 0  # bytes waiting in the bounce buffer

    def write(self, buf, digest: Optional[Callable[[np.ndarray], None]] = None) -> None:
        """Append the bytes of ``buf`` (anything that exposes a buffer: bytes, a numpy array...).
        ``digest``: called on the bytes in order, piece by piece, where they lie just after the copy into the
        bounce buffer (still in the CPU cache: a checksum there costs a third less than on the source)."""
        src = np.frombuffer(buf, dtype=np.uint8) if not isinstance(buf, np.ndarray) else buf.reshape(-1).view(np.uint8)
        self.written += src.size
        if self._bounce is None:
            if digest is not None:
                digest(src)
            _write_all(self.fd, src, self._file_pos)
            self._file_pos += src.size
            return
        chunk = self._bounce.size
        at = 0
        while at < src.size:
            n = min(chunk - self._fill, src.size - at)
            piece = self._bounce[self._fill: self._fill + n]
            np.copyto(piece, src[at: at + n])
            if digest is not None:
                digest(piece)
            self._fill += n
            at += n
            if self._fill == chunk:
                self._put(self._bounce, self._file_pos)
                self._file_pos += chunk
                self._fill = 0

    def _put(self, data: np.ndarray, offset: int) -> None:
        """Write ``data`` at ``offset``. A file system that took ``O_DIRECT`` at open but refuses the transfer
        (EINVAL: a block size over :data:`ALIGN`, some network file systems) gets this and every later
        write buffered, on a plain descriptor of the same file."""
        if self.direct:
            try:
                return _write_all(self.fd, data, offset)
            except OSError as e:
                if e.errno != errno.EINVAL:
                    raise
                refused, self.fd, self.direct = self.fd, self._plain, False
                os.close(refused)
        _write_all(self.fd, data, offset)

    def flush(self) -> None:
        """Write the bytes still in the bounce buffer (padded to :data:`ALIGN`), and truncate the file to
        the bytes written; they stay in the buffer, so later writes go on from there."""
        if self._bounce is None or not self._fill:
            return
        padded = aligned_size(self._fill)
        self._bounce[self._fill: padded] = 0
        self._put(self._bounce[:padded], self._file_pos)
        os.ftruncate(self.fd, self._file_pos + self._fill)

    def close(self, sync: bool = True) -> None:
        """Write what is left, ``fsync`` (with ``sync``) and close."""
        try:
            self.flush()
            if sync:
                os.fsync(self.fd)
        finally:
            if self.fd != self._plain:
                os.close(self.fd)
            os.close(self._plain)


def _write_all(fd: int, data: np.ndarray, offset: int) -> None:
    view = memoryview(data)  # type: ignore[arg-type]  # ndarray is a buffer
    done = 0
    while done < len(view):
        n = os.pwrite(fd, view[done:], offset + done)
        if n <= 0:  # (pwrite raises ENOSPC itself; this is the defensive case)
            raise OSError(errno.ENOSPC, "short write", "")
        done += n
