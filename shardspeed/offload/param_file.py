"""offload_param with ``device: nvme``: the stage-3 parameter shards of this rank in one file.

One file per rank (``nvme_path/shardspeed-swap-<job>/rank<r>-attempt<a>-pid<p>-<host>/param-*/params.bin``,
:func:`~shardspeed.offload.swap_dirs.make_swap_dir`, which first removes the folders of dead processes),
one region per unit at a 4 KiB-aligned offset, preallocated as each unit is built with its
:class:`FilePlacement` (``posix_fallocate``) after the same checks as the optimizer store
(:func:`~shardspeed.offload.swap_dirs.check_nvme_path`). Every read of a region is checked against the block
sums (:func:`~shardspeed.offload.swap_io.block_sums`) of what was written there, kept in memory. A unit's
shard is read into a temporary host tensor when it is needed (gather, checkpoints, masters) and written
back after the optimizer step, so host memory for parameters is bounded by the units gathered at once
(plus :data:`WRITES_IN_FLIGHT` copies queued for writing), not by the model. The writes and the read-aheads
run in order on one background thread, off the training thread; a plain read first waits for the writes.
I/O is ``os.preadv``/``os.pwritev`` with ``O_DIRECT`` where the file system allows it
(:class:`~shardspeed.offload.swap_io.SwapFile`), through the page cache otherwise. The directory is removed
on :meth:`close`, when the object is collected, or at interpreter exit.
"""
from __future__ import annotations

import logging
import os
import weakref
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Dict, List, Optional

import torch

from ..errors import ConfigError
from ..utils.direct_io import aligned_empty, aligned_size
from ..zero.placement import ShardPlacement
from . import store
from .swap_dirs import SwapDir, check_nvme_path, make_swap_dir
from .swap_io import SUM_BLOCK, SwapFile, check_sums, n_blocks

logger = logging.getLogger("shardspeed")

#: Writes of a parameter file queued behind the training thread at most (each holds a copy of its bytes).
WRITES_IN_FLIGHT = 2


class NvmeParamFile:
    """This rank's stage-3 parameter shards in one file, one region per unit (:meth:`reserve`).

    The file grows by one preallocated region per reservation, made when a unit is constructed with a
    :class:`FilePlacement`, so a disk that is too small fails at start, not mid-training."""

    def __init__(self, nvme_path: str, rank: int, verify: Optional[bool] = None):
        self.nbytes = 0
        self.verify = store.verify_swap_default() if verify is None else bool(verify)
        self._sums: Dict[int, torch.Tensor] = {}  # region offset -> block sums of its bytes as last written
        self._size: Dict[int, int] = {}  # region offset -> bytes of data in it (numel × element size)
        swap = make_swap_dir(nvme_path, "param", rank, 0, "the parameter shards")
        self.root, self.dir = swap.root, swap.path
        self.path = os.path.join(self.dir, "params.bin")
        try:
            self.file = SwapFile(self.path)
        except OSError as e:
            swap.remove()
            raise ConfigError(f"offload_param nvme_path {self.root!r}: cannot create the parameter file "
                              f"({e.strerror})") from e
        # one background thread, made at first use, for the writes (queued behind the training thread) and the
        # read-aheads (FilePlacement.read_ahead), in order: a read queued after a write sees it
        self._pool: List[ThreadPoolExecutor] = []
        self._writes: List[Future] = []  # queued writes, oldest first
        self._failed: Dict[int, BaseException] = {}  # region offset -> the error of a write to it that failed
        self._finalizer = weakref.finalize(self, NvmeParamFile._cleanup, self.file, swap, self._pool)
        logger.info("NVMe parameter shards: %s (%s)", self.path,
                    "O_DIRECT" if self.file.direct_fd is not None else "through the page cache")

    def reserve(self, numel: int, dtype: torch.dtype) -> int:
        """Append a region for ``numel`` elements of ``dtype`` (4 KiB-aligned, preallocated); returns its
        byte offset."""
        size = numel * torch.empty((), dtype=dtype).element_size()
        nbytes = aligned_size(size)
        check_nvme_path(self.root, nbytes, what=f"the parameter shards ({self.nbytes / 2**30:.2f} GiB "
                                                f"reserved so far)")
        offset = self.nbytes
        try:
            if nbytes:
                self.file.preallocate(offset, nbytes)  # a full disk fails now, not mid-training
        except OSError as e:
            raise ConfigError(f"offload_param nvme_path {self.root!r}: cannot preallocate the parameter file "
                              f"({e.strerror}); need {(offset + nbytes) / 2**30:.2f} GiB") from e
        self.nbytes = offset + nbytes
        self._size[offset] = size
        if self.verify:  # a preallocated region reads as zeros, whose block sums are zero
            self._sums[offset] = torch.zeros(n_blocks(size), dtype=torch.int64)
        return offset

    def read(self, offset: int, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """A fresh host copy of the region at ``offset`` (writing into it does not change the file), after the
        writes queued before it. The whole region is read, padding included (4 KiB-aligned: ``O_DIRECT``),
        into an aligned buffer."""
        self.flush()
        return self._read_now(offset, numel, dtype)

    def read_async(self, offset: int, numel: int, dtype: torch.dtype) -> Future:
        """:meth:`read` in the background thread (after the writes queued before it); its error (a corrupt
        region, a failed write to it) is raised by ``result()``."""
        return self._background().submit(self._read_now, offset, numel, dtype)

    def write(self, offset: int, numel: int, dtype: torch.dtype, t: torch.Tensor, lo: int = 0) -> None:
        """Store ``t`` (cast to ``dtype``) as elements ``[lo, lo + t.numel())`` of the region at ``offset``
        (``numel`` elements). The write is queued on the background thread, with a copy of the bytes, and the
        call returns; at most :data:`WRITES_IN_FLIGHT` are queued (the next waits for the oldest). Every later
        read sees it; its error is raised by the next :meth:`flush` (every :meth:`read` flushes) and by every
        read of the region."""
        if lo < 0 or lo + t.numel() > numel:
            raise ValueError(f"write of [{lo}, {lo + t.numel()}) outside its shard of {numel} elements")
        src = t.detach().reshape(-1).to(device="cpu", dtype=dtype)
        if not src.numel():
            return
        if t.device.type == "cpu" and src.untyped_storage().data_ptr() == t.untyped_storage().data_ptr():
            src = src.clone()  # the caller may change ``t`` once this returns
        self._writes.append(self._background().submit(self._write_now, offset, src.contiguous(), lo))
        while len(self._writes) > WRITES_IN_FLIGHT:
            self._writes.pop(0).result()

    def flush(self) -> None:
        """Wait for the queued writes; raise the first one's error, if any."""
        writes, self._writes = self._writes, []
        errors = [f.exception() for f in writes]
        first = next((e for e in errors if e is not None), None)
        if first is not None:
            raise first

    def _background(self) -> ThreadPoolExecutor:
        if not self._pool:
            self._pool.append(ThreadPoolExecutor(max_workers=1, thread_name_prefix="shardspeed-param-io"))
        return self._pool[0]

    def _read_now(self, offset: int, numel: int, dtype: torch.dtype) -> torch.Tensor:
        failed = self._failed.get(offset)
        if failed is not None:
            raise failed
        size = numel * torch.empty((), dtype=dtype).element_size()
        if not size:
            return torch.empty(0, dtype=dtype)
        raw = aligned_empty(aligned_size(size))
        expected = self._sums.get(offset)
        found = self.file.read(raw, offset, checksum=expected is not None)
        check_sums(expected, found, self.path, self._what(offset), offset)
        return raw[:size].view(dtype)

    def _what(self, offset: int) -> str:
        return f"the parameter shard region at byte {offset} ({self._size.get(offset, 0)} bytes)"

    def _write_now(self, offset: int, src: torch.Tensor, lo: int) -> None:
        try:
            sums = self._sums.get(offset)
            a = lo * src.element_size()
            if sums is None:
                self.file.write(src, offset + a, pad=a + src.numel() * src.element_size() == self._size[offset])
                return
            start, data = self._whole_blocks(offset, src, a, sums)
            new = self.file.write(data, offset + start, checksum=True, pad=True)  # ends at a block or the data's end
            assert new is not None
            k0 = start // SUM_BLOCK
            sums[k0 : k0 + new.numel()] = new
        except BaseException as e:  # the region's bytes are unknown now: every later read of it raises this
            self._failed.setdefault(offset, e)
            raise

    def _whole_blocks(self, offset: int, src: torch.Tensor, a: int, sums: torch.Tensor):
        """What to write so that writing ``src`` at byte ``a`` of the region covers whole checksummed blocks:
        ``(start byte, bytes)``. ``src`` itself where it does; otherwise ``src`` with the old bytes of the
        blocks it covers in part around it, read (and checked) from the file first."""
        size, b = self._size[offset], a + src.numel() * src.element_size()
        k0, k1 = a // SUM_BLOCK, n_blocks(b)
        start, end = k0 * SUM_BLOCK, min(k1 * SUM_BLOCK, size)
        if a == start and b == end:
            return start, src
        stage = torch.empty(end - start, dtype=torch.uint8)
        partial: List[int] = sorted({k for k, cut in ((k0, a > start), (k1 - 1, b < end)) if cut})
        for k in partial:
            lo, hi = k * SUM_BLOCK, min((k + 1) * SUM_BLOCK, size)
            found = self.file.read(stage[lo - start : hi - start], offset + lo, checksum=True)
            check_sums(sums[k : k + 1], found, self.path, self._what(offset), offset + lo)
        stage[a - start : b - start] = src.view(torch.uint8)
        return start, stage

    @staticmethod
    def _cleanup(file: SwapFile, swap: SwapDir, pool: List[ThreadPoolExecutor]) -> None:
        for executor in pool:
            executor.shutdown(wait=True)  # the queued writes and reads finish before the file goes
        file.close()
        swap.remove()

    def close(self) -> None:
        """Close and delete the parameter file (the shards are gone afterwards), after the queued writes."""
        try:
            self.flush()
        finally:
            self._finalizer()


class FilePlacement(ShardPlacement):
    """A unit's shard in a region of ``param_file`` (offload_param nvme). Nothing is kept in memory: each
    read is a fresh host copy (gathers, masters, checkpoints), changes are written with :meth:`write`.
    The file is shared by the units of a rank; :meth:`close` deletes it (for all of them)."""

    where = "file"
    in_file = True

    def __init__(self, param_file: NvmeParamFile) -> None:
        self.file = param_file
        self.offset = -1
        self.numel = 0
        self.dtype = torch.float32
        self._device = torch.device("cpu")
        self._ahead: Optional[Future] = None  # a read started by read_ahead, not yet used

    def hold(self, shard: torch.Tensor, device: torch.device) -> None:
        self.numel, self.dtype, self._device = shard.numel(), shard.dtype, device
        self.offset = self.file.reserve(self.numel, self.dtype)
        self.write(shard)

    def read(self) -> torch.Tensor:
        ahead, self._ahead = self._ahead, None
        if ahead is not None:  # read since the last write: the same bytes, already checked
            return ahead.result()
        return self.file.read(self.offset, self.numel, self.dtype)

    def read_ahead(self) -> None:
        if self._ahead is None and self.numel:
            self._ahead = self.file.read_async(self.offset, self.numel, self.dtype)

    def write(self, t: torch.Tensor, lo: int = 0) -> None:
        self._ahead = None  # a read queued before this write gives the old bytes: dropped (the next read rereads)
        self.file.write(self.offset, self.numel, self.dtype, t, lo)

    def to_device_for_gather(self) -> torch.Tensor:
        return self.read().to(self._device)  # the read (or the read-ahead's result), then the host→device copy

    def close(self) -> None:
        self.file.close()

    def __repr__(self) -> str:
        return f"FilePlacement({self.file.path}@{self.offset}, {self.numel} × {self.dtype})"
