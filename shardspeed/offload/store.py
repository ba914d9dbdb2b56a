"""One job: where the offloaded optimizer state lives: host memory, or files streamed through a bounded pool.

Both stores hand out, tile by tile, a :class:`TileState` (master, exp_avg, exp_avg_sq views of the same
length; fp32, or a bf16 master with fp32 or bf16 moments in memory) and take it back with :meth:`release`:

- :class:`MemoryStateStore`: state tensors held whole (on the host for ``device: cpu``, on the device for
  units kept there by ``ratio``); views are handed out directly, release is a no-op.
- :class:`NvmeStateStore`: three files per rank (master, exp_avg, exp_avg_sq) under ``nvme_path``; a
  reader thread fills free buffers from a pool of ``buffer_count`` buffers with the next tiles while the
  caller steps the current one; a writer thread writes a released tile back and returns its buffer to the
  pool. Host memory for state is therefore exactly ``buffer_count × 3 × largest tile × 4`` bytes, whatever
  the model size (rows rounded up to an even length). I/O is ``os.preadv``/``os.pwritev`` (they release
  the GIL) through the page cache.

Swap integrity: every write of swap data records its checksum in memory (:func:`block_sums`: one int64
per 4 KiB block), and every read is checked against it, so bytes changed on disk since this process
wrote them raise a :class:`~shardspeed.errors.ShardspeedError` naming the file, the tile and the byte
(:func:`swap_corrupted`) instead of being trained on. The I/O and checksums are in :mod:`.swap_io`.

Swap folders (:func:`make_swap_dir`): ``nvme_path/shardspeed-swap-<job>/rank<R>-attempt<A>-pid<P>-<host>/
<kind>-*``, where the job is torchrun's ``TORCHELASTIC_RUN_ID`` (else a hash of ``MASTER_ADDR:MASTER_PORT``,
else ``local``) and the attempt its ``TORCHELASTIC_RESTART_COUNT``. A new store first removes the
swap folders under ``nvme_path`` whose process is gone, and its own rank's of older attempts
(:func:`remove_dead_swap`); the folders (private to this user, each locked by its live owner) are made
and removed by :mod:`.swap_dirs`.
"""
from __future__ import annotations

import logging
import os
import queue
import threading
import weakref
from concurrent.futures import Future, ThreadPoolExecutor
from types import MappingProxyType
from typing import Any, Dict, Iterator, List, NamedTuple, Optional, Sequence, Tuple

import torch

from ..errors import ConfigError, ShardspeedError
from ..utils.direct_io import ALIGN, aligned_empty, aligned_size
from ..utils.env import VERIFY_SWAP_ENV as VERIFY_SWAP_ENV, verify_swap
from .swap_dirs import (
    SwapDir as SwapDir,
    check_nvme_path as check_nvme_path,
    make_swap_dir as make_swap_dir,
    remove_dead_swap as remove_dead_swap,
    remove_swap_dir as remove_swap_dir,
    swap_attempt as swap_attempt,
    swap_job_id as swap_job_id,
)
from .swap_io import (  # the I/O and checksum names are importable from here too
    _IO_CHUNK as _IO_CHUNK,
    SUM_BLOCK as SUM_BLOCK,
    SwapFile as SwapFile,
    _sum_blocks as _sum_blocks,
    block_sums as block_sums,
    check_sums as check_sums,
    n_blocks as n_blocks,
    swap_corrupted as swap_corrupted,
)
from .tiles import Tile

logger = logging.getLogger("shardspeed")

STATE_NAMES = ("master", "exp_avg", "exp_avg_sq")
_FP32 = 4
_SUFFIX = MappingProxyType({torch.float32: "f32", torch.bfloat16: "bf16", torch.float16: "f16"})

#: The environment variable that, set to ``0``, makes new NVMe stores and parameter files skip verifying what
#: they read back (an internal switch, not a config key: ``benchmarks/bench_nvme_checksum.py`` sets it to
#: measure what the checksums cost): ``VERIFY_SWAP_ENV``, read at construction by this, which refuses any value
#: but a flag with a one-line ConfigError.
def verify_swap_default() -> bool:
    return verify_swap()


class TileState(NamedTuple):
    master: torch.Tensor
    exp_avg: torch.Tensor
    exp_avg_sq: torch.Tensor


def _pinned_ok(pin: bool) -> bool:
    return pin and torch.cuda.is_available()


def _padded(numel: int) -> int:
    """``numel`` fp32 elements rounded up to whole 4 KiB blocks (a tile's region in the state files)."""
    return aligned_size(numel * _FP32) // _FP32


def _region(numel: int, size: int) -> int:
    """Bytes of a tile's region in a state file of ``size``-byte elements: whole 4 KiB blocks."""
    return aligned_size(numel * size)


def _state_buffer(tile_elems: int, pin: bool) -> torch.Tensor:
    """A (3, row) fp32 host buffer for one tile's three states: rows of whole 4 KiB blocks at 4 KiB-aligned
    addresses (``O_DIRECT`` transfers; the checksums' int64 view). A row holds a state of any dtype up to 4
    bytes (bf16 states use the front of their row, viewed as bf16)."""
    row = max(_padded(tile_elems), ALIGN // _FP32)
    return aligned_empty(3 * row * _FP32, pin).view(torch.float32).view(3, row)


class MemoryStateStore:
    """Master chunks (given) and Adam moments (allocated here, zero) held in memory per unit; the moments in
    ``state_dtype`` (None: the master's; fp32 beside bf16 masters, as DeepSpeedCPUAdam keeps them)."""

    kind = "memory"

    def __init__(self, masters: Dict[int, torch.Tensor], with_moments: bool = True,
                 state_dtype: Optional[torch.dtype] = None):
        self.masters = masters
        self.moments: Dict[int, Tuple[torch.Tensor, torch.Tensor]] = {}
        if with_moments:
            for u, m in masters.items():
                self.moments[u] = (torch.zeros_like(m, dtype=state_dtype), torch.zeros_like(m, dtype=state_dtype))

    def stream(self, tiles: Sequence[Tile]) -> Iterator[Tuple[Tile, TileState]]:
        for t in tiles:
            m, v = self.moments[t.unit]
            yield t, TileState(self.masters[t.unit][t.lo : t.hi], m[t.lo : t.hi], v[t.lo : t.hi])

    def release(self, tile: Tile, state: TileState, ready: Any = None) -> None:
        pass

    # ---- checkpoints: direct access by tile (not on the training path) ----
    def read_tile(self, tile: Tile) -> TileState:
        """The tile's state as views (no copy): writing into them changes the store."""
        return next(iter(self.stream([tile])))[1]

    def read_state(self, tile: Tile, name: str, lo: int, hi: int) -> torch.Tensor:
        """Elements ``[lo, hi)`` of the unit's chunk (inside ``tile``) of one state, as a view."""
        return getattr(self.read_tile(tile), name)[lo - tile.lo : hi - tile.lo]

    def write_master(self, tile: Tile, master: torch.Tensor) -> None:
        """Overwrite a tile's master weights (moments kept)."""
        dst = self.masters[tile.unit][tile.lo : tile.hi]
        if dst.data_ptr() != master.data_ptr():
            dst.copy_(master)

    def write_tile(self, tile: Tile, state: TileState) -> None:
        """Store a tile's state (a no-op for the views :meth:`read_tile` handed out)."""
        for dst, src in zip(self.read_tile(tile), state):
            if dst.data_ptr() != src.data_ptr():
                dst.copy_(src)

    def flush(self) -> None:
        pass

    def abandon(self) -> None:
        pass

    def held_bytes(self) -> Dict[str, int]:
        master = sum(m.numel() * m.element_size() for m in self.masters.values())
        moments = sum(m.numel() * m.element_size() + v.numel() * v.element_size() for m, v in self.moments.values())
        return {"master": master, "optimizer": moments}

    def close(self) -> None:
        pass


class NvmeStateStore:
    """Optimizer state of the given tiles in files; streamed through ``buffer_count`` host buffers. ``dtypes``:
    those of (master, exp_avg, exp_avg_sq) in the files and the buffers (fp32; a bf16 master with fp32 or bf16
    moments: the files are as much smaller).

    Every read is checked against the block sums of what was written (``verify``; default
    :data:`VERIFY_SWAP_ENV`), kept in memory per tile and state: 8 bytes per 4 KiB of file."""

    kind = "nvme"

    def __init__(self, nvme_path: str, tiles: Sequence[Tile], buffer_count: int, pin_memory: bool, rank: int,
                 verify: Optional[bool] = None, dtypes: Sequence[torch.dtype] = (torch.float32,) * 3):
        if buffer_count < 1:
            raise ConfigError("offload_optimizer.buffer_count must be >= 1 with device \"nvme\" (2 or more "
                              "lets reading the next tile overlap the step of the current one)")
        self.tiles = list(tiles)
        self.verify = verify_swap_default() if verify is None else bool(verify)
        self.dtypes = tuple(dtypes)
        if len(self.dtypes) != 3 or any(d.itemsize > _FP32 for d in self.dtypes):
            raise ValueError(f"NvmeStateStore: dtypes must be three of at most 4 bytes, got {self.dtypes}")
        self._sizes = [d.itemsize for d in self.dtypes]
        # each tile's region of a state file starts 4 KiB-aligned (its tail padded with zeros), so that whole
        # tiles move with O_DIRECT between the aligned buffers and the disk; per state, since dtypes differ
        self._at: Dict[int, List[int]] = {}
        totals = [0, 0, 0]
        for t in self.tiles:
            self._at[t.index] = list(totals)
            totals = [a + _region(t.numel, sz) for a, sz in zip(totals, self._sizes)]
        need = sum(totals)
        swap = make_swap_dir(nvme_path, "optim", rank, need, "the optimizer state")
        root, self.dir = swap.root, swap.path
        # tile index -> block sums of (master, exp_avg, exp_avg_sq) as last written (the files start as zeros)
        self._sums: Dict[int, List[torch.Tensor]] = {
            t.index: [torch.zeros(n_blocks(t.numel * sz), dtype=torch.int64) for sz in self._sizes]
            for t in self.tiles} if self.verify else {}
        self.files: Dict[str, SwapFile] = {}
        try:
            for name, dt, total in zip(STATE_NAMES, self.dtypes, totals):
                f = self.files[name] = SwapFile(os.path.join(self.dir, f"{name}.{_SUFFIX[dt]}"))
                if total:
                    f.preallocate(0, total)  # fails now (ENOSPC), not mid-training
        except OSError as e:
            self._close_files()
            swap.remove()
            raise ConfigError(f"offload nvme_path {root!r}: cannot create the state files ({e.strerror}); "
                              f"need {need / 2**30:.2f} GiB") from e
        self.tile_elems = max((t.numel for t in self.tiles), default=0)
        self.buffer_count = buffer_count
        pin = _pinned_ok(pin_memory)
        self._buffers = [_state_buffer(self.tile_elems, pin) for _ in range(buffer_count)]
        self._free: queue.Queue[torch.Tensor] = queue.Queue()
        for b in self._buffers:
            self._free.put(b)
        self._owner: Dict[int, torch.Tensor] = {}  # tile index -> buffer it occupies
        self._writer = ThreadPoolExecutor(1, thread_name_prefix="shardspeed-nvme-write")
        self._writes: List[Future] = []
        self._finalizer = weakref.finalize(self, NvmeStateStore._cleanup, dict(self.files), swap, self._writer)
        self._file_bytes = need
        direct = all(f.direct_fd is not None for f in self.files.values())
        logger.info("NVMe optimizer state: %s (%.2f GiB%s), %d buffers × %d elements", self.dir,
                    need / 2**30, ", O_DIRECT" if direct else ", through the page cache", buffer_count,
                    self.tile_elems)

    # ---- bookkeeping ------------------------------------------------------------------------------
    @property
    def buffer_bytes(self) -> int:
        """Host bytes held for streaming: the whole pool (``buffer_count`` × 3 × tile × 4)."""
        return sum(b.numel() * b.element_size() for b in self._buffers)

    def held_bytes(self) -> Dict[str, int]:
        return {"master": 0, "optimizer": 0, "host_buffers": self.buffer_bytes,
                "nvme_files": self._file_bytes}

    # ---- raw I/O -------------------------------------------------------------------------------------
    def _path(self, name: str) -> str:
        return self.files[name].path

    def file_offset(self, tile: Tile, state: int = 0) -> int:
        """The byte at which ``tile``'s region starts in the file of ``state`` (0 master, 1 exp_avg,
        2 exp_avg_sq; 4 KiB-aligned)."""
        return self._at[tile.index][state]

    def _row(self, buf: torch.Tensor, i: int, n: int) -> torch.Tensor:
        """The first ``n`` elements of state ``i`` in a buffer's row ``i``, in the state's dtype."""
        return buf[i].view(self.dtypes[i])[:n]

    def _padded_row(self, buf: torch.Tensor, tile: Tile, i: int) -> torch.Tensor:
        """State ``i``'s whole region of ``tile`` (with its padding) in row ``i`` of ``buf``."""
        return self._row(buf, i, _region(tile.numel, self._sizes[i]) // self._sizes[i])

    def _read_state(self, tile: Tile, i: int, out: torch.Tensor, first_block: int = 0) -> None:
        """Read ``out`` from state ``i`` of ``tile``, from its block ``first_block`` on, and check it is what
        was written there."""
        name, at = STATE_NAMES[i], self._at[tile.index][i] + first_block * SUM_BLOCK
        found = self.files[name].read(out, at, checksum=self.verify)
        if found is not None:
            expected = self._sums[tile.index][i][first_block : first_block + found.numel()]
            what = (f"tile {tile.index} ({name} of elements [{tile.lo}, {tile.hi}) of unit {tile.unit}'s chunk)")
            check_sums(expected, found, self._path(name), what, at)

    def _write_state(self, tile: Tile, i: int, data: torch.Tensor) -> None:
        """Write state ``i`` of ``tile`` (all of it, or with its region's zero padding) and record its block
        sums (those of the data: the padding is zeros, as :func:`block_sums` pads a partial block)."""
        sums = self.files[STATE_NAMES[i]].write(data, self._at[tile.index][i], checksum=self.verify, pad=True)
        if sums is not None:
            self._sums[tile.index][i] = sums

    def _read(self, tile: Tile, buf: torch.Tensor) -> None:
        """All three states of ``tile`` into ``buf``'s rows, with the regions' padding (whole aligned blocks:
        one ``O_DIRECT`` transfer per chunk)."""
        for i in range(len(STATE_NAMES)):
            self._read_state(tile, i, self._padded_row(buf, tile, i))

    def _write(self, tile: Tile, buf: torch.Tensor, names: Sequence[str] = STATE_NAMES) -> None:
        for i, name in enumerate(STATE_NAMES):
            if name in names:
                region = self._padded_row(buf, tile, i)
                region[tile.numel :].zero_()
                self._write_state(tile, i, region)

    def initialize(self, tile: Tile, master: torch.Tensor) -> None:
        """Write a tile's initial master weights and zero moments (synchronously; at start only)."""
        buf = self._free.get()
        try:
            self._row(buf, 0, tile.numel).copy_(master)
            for i in (1, 2):
                self._row(buf, i, tile.numel).zero_()
            self._write(tile, buf)
        finally:
            self._free.put(buf)

    def write_master(self, tile: Tile, master: torch.Tensor) -> None:
        """Overwrite a tile's master weights in the file (moments kept); synchronous."""
        self.flush()
        buf = self._free.get()
        try:
            self._row(buf, 0, tile.numel).copy_(master)
            self._write(tile, buf, names=("master",))
        finally:
            self._free.put(buf)

    def read_tile(self, tile: Tile) -> TileState:
        """A copy of one tile's state (for checks and checkpoints; not on the training path)."""
        self.flush()
        out = _state_buffer(tile.numel, False)
        self._read(tile, out)
        return TileState(*(self._row(out, i, tile.numel) for i in range(3)))

    def read_state(self, tile: Tile, name: str, lo: int, hi: int) -> torch.Tensor:
        """A copy of elements ``[lo, hi)`` of the unit's chunk (inside ``tile``) of one state file
        (checkpoints: one range in memory at a time; a sync point with the disk). Verified: the 4 KiB blocks
        around the range are read and checked."""
        self.flush()
        i = STATE_NAMES.index(name)
        dt, sz = self.dtypes[i], self._sizes[i]
        if not self.verify:
            out = torch.empty(hi - lo, dtype=dt)
            self.files[name].read(out, self._at[tile.index][i] + (lo - tile.lo) * sz)
            return out
        a, b = (lo - tile.lo) * sz, (hi - tile.lo) * sz  # bytes inside the tile
        k0 = a // SUM_BLOCK
        start, end = k0 * SUM_BLOCK, min(n_blocks(b) * SUM_BLOCK, tile.numel * sz)
        raw = torch.empty(max(end - start, 0), dtype=torch.uint8)
        if raw.numel():
            self._read_state(tile, i, raw, k0)
        out = raw[a - start : b - start].view(dt)
        return out if out.numel() == raw.numel() // sz else out.clone()

    def write_tile(self, tile: Tile, state: TileState) -> None:
        """Overwrite a tile's master weights and moments in the files; synchronous (checkpoint load)."""
        self.flush()
        for i, t in enumerate(state):
            self._write_state(tile, i, t.detach().to("cpu", self.dtypes[i]).contiguous())

    # ---- the stream ------------------------------------------------------------------------------
    def stream(self, tiles: Sequence[Tile]) -> Iterator[Tuple[Tile, TileState]]:
        """Yield tiles in order with their state loaded; the next tiles are read while the caller works
        (as far ahead as free buffers allow). Each yielded state must be :meth:`release`-d."""
        self.flush()
        ready: queue.Queue[Any] = queue.Queue()
        stop = threading.Event()

        def next_buffer() -> Optional[torch.Tensor]:
            while not stop.is_set():
                try:
                    return self._free.get(timeout=0.05)
                except queue.Empty:
                    continue
            return None

        def reader():
            try:
                for t in tiles:
                    buf = next_buffer()
                    if buf is None:
                        return
                    ready.put((t, buf))  # owned by the consumer from here, even if the read fails
                    self._read(t, buf)
                    ready.put(t.index)  # read complete
            except BaseException as e:  # surfaced in the consumer
                ready.put(e)

        th = threading.Thread(target=reader, name="shardspeed-nvme-read", daemon=True)
        th.start()
        pending: Dict[int, torch.Tensor] = {}
        try:
            for _ in range(len(tiles)):
                t, buf = self._get(ready, pending)
                pending[t.index] = buf
                while True:  # wait for this tile's read to complete
                    item = self._get(ready, pending)
                    if item == t.index:
                        break
                del pending[t.index]
                self._owner[t.index] = buf
                yield t, TileState(*(self._row(buf, i, t.numel) for i in range(3)))
        finally:
            stop.set()
            th.join()
            while True:
                try:
                    item = ready.get_nowait()
                except queue.Empty:
                    break
                if isinstance(item, tuple):
                    pending[item[0].index] = item[1]
            for buf in pending.values():  # read but never handed out (the consumer stopped early)
                self._free.put(buf)

    def _get(self, ready: queue.Queue[Any], pending: Dict[int, torch.Tensor]) -> Any:
        item = ready.get()
        if isinstance(item, ShardspeedError):  # says what is wrong already (a corrupted file, a short read)
            raise item
        if isinstance(item, BaseException):
            raise ShardspeedError(f"NVMe offload: reading optimizer state from {self.dir} failed: {item}") from item
        return item

    def abandon(self) -> None:
        """Return buffers of tiles handed out but not released (after an error mid-step)."""
        for buf in self._owner.values():
            self._free.put(buf)
        self._owner.clear()

    def release(self, tile: Tile, state: TileState, ready: Any = None) -> None:
        """Write the tile back (asynchronously) and return its buffer to the pool when written.
        ``ready``: an event to wait for first (a device copy still reading the buffer)."""
        buf = self._owner.pop(tile.index)

        def write():
            try:
                if ready is not None:
                    ready.synchronize()
                self._write(tile, buf)
            finally:
                self._free.put(buf)

        self._writes.append(self._writer.submit(write))

    def flush(self) -> None:
        """Wait for every pending write (a sync point with the disk)."""
        writes, self._writes = self._writes, []
        for f in writes:
            f.result()

    # ---- teardown ------------------------------------------------------------------------------------
    def _close_files(self) -> None:
        for f in self.files.values():
            f.close()
        self.files = {}

    @staticmethod
    def _cleanup(files: Dict[str, SwapFile], swap: SwapDir, writer: ThreadPoolExecutor) -> None:
        writer.shutdown(wait=True)
        for f in files.values():
            f.close()
        swap.remove()

    def close(self) -> None:
        """Flush, close and delete the state files."""
        try:
            self.flush()
        finally:
            self._finalizer()
