"""Where the offloaded optimizer state lives: host memory, or files streamed through a bounded pool.

Both stores hand out, tile by tile, a :class:`TileState` (fp32 master, exp_avg, exp_avg_sq views of the
same length) and take it back with :meth:`release`:

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
(:func:`swap_corrupted`) instead of being trained on.

Swap folders (:func:`make_swap_dir`): ``nvme_path/shardspeed-swap-<job>/rank<R>-attempt<A>-pid<P>-<host>/
<kind>-*``, where the job is torchrun's ``TORCHELASTIC_RUN_ID`` (else a hash of ``MASTER_ADDR:MASTER_PORT``,
else ``local``) and the attempt its ``TORCHELASTIC_RESTART_COUNT``. A new store first removes the
folders of its own job and rank left by dead processes or older attempts (:func:`remove_dead_swap`).
"""
from __future__ import annotations

import hashlib
import logging
import os
import queue
import re
import shutil
import socket
import tempfile
import threading
import weakref
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Dict, Iterator, List, NamedTuple, Optional, Sequence, Tuple

import torch

from ..errors import ConfigError, ShardspeedError
from .tiles import Tile

logger = logging.getLogger("shardspeed")

STATE_NAMES = ("master", "exp_avg", "exp_avg_sq")
_FP32 = 4

#: Bytes per checksummed block of swap data (a page): one int64 of checksum in memory per block.
SUM_BLOCK = 4096
_SUM_WORDS = SUM_BLOCK // 8

#: Whether new NVMe stores and parameter files verify what they read back (an internal switch, not a config
#: key: ``benchmarks/bench_nvme_checksum.py`` turns it off to measure what the checksums cost).
VERIFY_SWAP = True


class TileState(NamedTuple):
    master: torch.Tensor
    exp_avg: torch.Tensor
    exp_avg_sq: torch.Tensor


def _pinned_ok(pin: bool) -> bool:
    return pin and torch.cuda.is_available()


class MemoryStateStore:
    """Master chunks (given) and Adam moments (allocated here, zero) held in memory per unit."""

    kind = "memory"

    def __init__(self, masters: Dict[int, torch.Tensor], with_moments: bool = True):
        self.masters = masters
        self.moments: Dict[int, Tuple[torch.Tensor, torch.Tensor]] = {}
        if with_moments:
            for u, m in masters.items():
                self.moments[u] = (torch.zeros_like(m), torch.zeros_like(m))

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
        master = sum(m.numel() * _FP32 for m in self.masters.values())
        moments = sum(2 * m.numel() * _FP32 for m, _ in self.moments.values())
        return {"master": master, "optimizer": moments}

    def close(self) -> None:
        pass


def check_nvme_path(path: str, needed_bytes: int, what: str = "the optimizer state") -> str:
    """Create ``path`` if needed and check it is a writable directory with room for ``needed_bytes``.

    Raises :class:`ConfigError` naming the problem and the fix. Returns the absolute path.
    """
    path = os.path.abspath(os.path.expanduser(path))
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as e:
        raise ConfigError(f"offload nvme_path {path!r} cannot be created ({e.strerror}); give an existing, "
                          f"writable directory on a local disk") from e
    if not os.path.isdir(path):
        raise ConfigError(f"offload nvme_path {path!r} is not a directory")
    if not os.access(path, os.W_OK | os.X_OK):
        raise ConfigError(f"offload nvme_path {path!r} is not writable by this process (uid {os.getuid()}); "
                          f"fix its permissions or choose another directory")
    free = shutil.disk_usage(path).free
    if free < needed_bytes:
        raise ConfigError(f"offload nvme_path {path!r} has {free / 2**30:.2f} GiB free; this rank "
                          f"needs {needed_bytes / 2**30:.2f} GiB for {what}: free space or choose another disk")
    return path


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


# ---- swap folders ----------------------------------------------------------------------------------------
_RANK_DIR = re.compile(r"^rank(\d+)-attempt(\d+)-pid(\d+)-(.+)$")


def _safe_name(text: str, limit: int = 64) -> str:
    safe = re.sub(r"[^A-Za-z0-9._-]", "_", text)
    return safe if len(safe) <= limit else hashlib.sha1(text.encode()).hexdigest()[:16]


def swap_job_id() -> str:
    """This job's name in swap folder names: torchrun's ``TORCHELASTIC_RUN_ID`` (the same in every attempt of
    an elastic job; its default ``none`` does not count), else a hash of ``MASTER_ADDR:MASTER_PORT``, else
    ``local``."""
    run = os.environ.get("TORCHELASTIC_RUN_ID", "")
    if run and run != "none":
        return _safe_name(run)
    addr, port = os.environ.get("MASTER_ADDR", ""), os.environ.get("MASTER_PORT", "")
    if addr and port:
        return "m" + hashlib.sha1(f"{addr}:{port}".encode()).hexdigest()[:12]
    return "local"


def swap_attempt() -> int:
    """torchrun's ``TORCHELASTIC_RESTART_COUNT`` (0 without torchrun)."""
    value = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    return int(value) if value.isdigit() else 0


def _host() -> str:
    return _safe_name(socket.gethostname() or "host")


def _alive(pid: int) -> bool:
    """Whether process ``pid`` of this host is running (a zombie is not)."""
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except FileNotFoundError:
        return False
    except (OSError, IndexError):
        return True


def _tree_bytes(path: str) -> int:
    total = 0
    for d, _, files in os.walk(path):
        for name in files:
            try:
                total += os.lstat(os.path.join(d, name)).st_size
            except OSError:
                pass
    return total


def remove_dead_swap(job_dir: str, rank: int, attempt: int) -> List[Tuple[str, int]]:
    """Remove the swap folders of ``rank`` in ``job_dir`` (this job's) made on this host by a process that is
    gone or by an older attempt; never this process's own, another rank's, another host's or another job's.
    Logs one line naming each removed folder and its bytes; returns ``(path, bytes)`` of each."""
    try:
        entries = sorted(os.listdir(job_dir))
    except OSError:
        return []
    host, me = _host(), os.getpid()
    removed: List[Tuple[str, int]] = []
    for name in entries:
        m = _RANK_DIR.match(name)
        if m is None or int(m[1]) != rank or m[4] != host:
            continue
        a, pid = int(m[2]), int(m[3])
        if pid == me or (a >= attempt and _alive(pid)):
            continue
        path = os.path.join(job_dir, name)
        nbytes = _tree_bytes(path)
        shutil.rmtree(path, ignore_errors=True)
        removed.append((path, nbytes))
    if removed:
        logger.warning("NVMe swap: removed %d folder(s) that dead attempts of this job left for rank %d: %s",
                       len(removed), rank, "; ".join(f"{p} ({n} bytes, {n / 2**30:.2f} GiB)" for p, n in removed))
    return removed


def make_swap_dir(nvme_path: str, kind: str, rank: int, needed_bytes: int, what: str) -> Tuple[str, str]:
    """Check ``nvme_path`` (:func:`check_nvme_path`), remove this job's dead swap folders of ``rank``
    (:func:`remove_dead_swap`, before the free-space check counts them) and make a fresh folder
    ``<nvme_path>/shardspeed-swap-<job>/rank<R>-attempt<A>-pid<P>-<host>/<kind>-*``. Returns
    ``(nvme_path as an absolute path, the new folder)``; :func:`remove_swap_dir` undoes it."""
    root = check_nvme_path(nvme_path, 0, what)
    job_dir = os.path.join(root, f"shardspeed-swap-{swap_job_id()}")
    attempt = swap_attempt()
    remove_dead_swap(job_dir, rank, attempt)
    check_nvme_path(root, needed_bytes, what)
    rank_dir = os.path.join(job_dir, f"rank{rank}-attempt{attempt}-pid{os.getpid()}-{_host()}")
    for tries in range(3):
        try:
            os.makedirs(rank_dir, exist_ok=True)
            return root, tempfile.mkdtemp(prefix=f"{kind}-", dir=rank_dir)
        except FileNotFoundError:  # an engine closing meanwhile removed the empty parent: make it again
            if tries == 2:
                raise
        except OSError as e:
            raise ConfigError(f"offload nvme_path {root!r}: cannot create the swap folder {rank_dir!r} "
                              f"({e.strerror})") from e
    raise AssertionError("unreachable")


def remove_swap_dir(directory: str) -> None:
    """Delete a folder of :func:`make_swap_dir`, and its rank and job folders once they are empty."""
    shutil.rmtree(directory, ignore_errors=True)
    parent = os.path.dirname(directory)
    for d in (parent, os.path.dirname(parent)):
        try:
            os.rmdir(d)
        except OSError:  # still holds another engine's folder (or is gone)
            break


class NvmeStateStore:
    """Optimizer state of the given tiles in files; streamed through ``buffer_count`` host buffers.

    Every read is checked against the block sums of what was written (``verify``; default
    :data:`VERIFY_SWAP`), kept in memory per tile and state: 8 bytes per 4 KiB of file."""

    kind = "nvme"

    def __init__(self, nvme_path: str, tiles: Sequence[Tile], buffer_count: int, pin_memory: bool, rank: int,
                 verify: Optional[bool] = None):
        if buffer_count < 1:
            raise ConfigError("offload_optimizer.buffer_count must be >= 1 with device \"nvme\" (2 or more "
                              "lets reading the next tile overlap the step of the current one)")
        self.tiles = list(tiles)
        self.verify = VERIFY_SWAP if verify is None else bool(verify)
        total = sum(t.numel for t in self.tiles)
        root, self.dir = make_swap_dir(nvme_path, "optim", rank, 3 * total * _FP32, "the optimizer state")
        # tile index -> block sums of (master, exp_avg, exp_avg_sq) as last written (the files start as zeros)
        self._sums: Dict[int, List[torch.Tensor]] = {
            t.index: [torch.zeros(n_blocks(t.numel * _FP32), dtype=torch.int64) for _ in STATE_NAMES]
            for t in self.tiles} if self.verify else {}
        self.fds: Dict[str, int] = {}
        try:
            for name in STATE_NAMES:
                fd = os.open(os.path.join(self.dir, f"{name}.f32"), os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
                self.fds[name] = fd
                if total:
                    os.posix_fallocate(fd, 0, total * _FP32)  # fails now (ENOSPC), not mid-training
        except OSError as e:
            self._close_files()
            remove_swap_dir(self.dir)
            raise ConfigError(f"offload nvme_path {root!r}: cannot create the state files ({e.strerror}); "
                              f"need {3 * total * _FP32 / 2**30:.2f} GiB") from e
        self.tile_elems = max((t.numel for t in self.tiles), default=0)
        self.buffer_count = buffer_count
        pin = _pinned_ok(pin_memory)
        row = self.tile_elems + self.tile_elems % 2  # even: rows 8-byte aligned (block_sums copies otherwise)
        self._buffers = [torch.empty(3, row, dtype=torch.float32, pin_memory=pin) for _ in range(buffer_count)]
        self._free: queue.Queue[torch.Tensor] = queue.Queue()
        for b in self._buffers:
            self._free.put(b)
        self._owner: Dict[int, torch.Tensor] = {}  # tile index -> buffer it occupies
        self._writer = ThreadPoolExecutor(1, thread_name_prefix="shardspeed-nvme-write")
        self._writes: List[Future] = []
        self._finalizer = weakref.finalize(self, NvmeStateStore._cleanup, dict(self.fds), self.dir, self._writer)
        logger.info("NVMe optimizer state: %s (%.2f GiB), %d buffers × %d elements", self.dir,
                    3 * total * _FP32 / 2**30, buffer_count, self.tile_elems)

    # ---- bookkeeping ------------------------------------------------------------------------------
    @property
    def buffer_bytes(self) -> int:
        """Host bytes held for streaming: the whole pool (``buffer_count`` × 3 × tile × 4)."""
        return sum(b.numel() * b.element_size() for b in self._buffers)

    def held_bytes(self) -> Dict[str, int]:
        return {"master": 0, "optimizer": 0, "host_buffers": self.buffer_bytes,
                "nvme_files": 3 * sum(t.numel for t in self.tiles) * _FP32}

    # ---- raw I/O -------------------------------------------------------------------------------------
    def _path(self, name: str) -> str:
        return os.path.join(self.dir, f"{name}.f32")

    def _read_state(self, tile: Tile, i: int, out: torch.Tensor, first_block: int = 0) -> None:
        """Read ``out`` from state ``i`` of ``tile``, from its block ``first_block`` on, and check it is what
        was written there."""
        name, at = STATE_NAMES[i], tile.offset * _FP32 + first_block * SUM_BLOCK
        found = _rw_all(os.preadv, self.fds[name], out, at, "read", self._path(name), checksum=self.verify)
        if found is not None:
            expected = self._sums[tile.index][i][first_block : first_block + found.numel()]
            what = (f"tile {tile.index} ({name} of elements [{tile.lo}, {tile.hi}) of unit {tile.unit}'s chunk)")
            check_sums(expected, found, self._path(name), what, at)

    def _write_state(self, tile: Tile, i: int, data: torch.Tensor) -> None:
        """Write state ``i`` of ``tile`` (all of it) and record its block sums."""
        name = STATE_NAMES[i]
        sums = _rw_all(os.pwritev, self.fds[name], data, tile.offset * _FP32, "write", self._path(name),
                       checksum=self.verify)
        if sums is not None:
            self._sums[tile.index][i] = sums

    def _read(self, tile: Tile, buf: torch.Tensor) -> None:
        for i in range(len(STATE_NAMES)):
            self._read_state(tile, i, buf[i, : tile.numel])

    def _write(self, tile: Tile, buf: torch.Tensor, names: Sequence[str] = STATE_NAMES) -> None:
        for i, name in enumerate(STATE_NAMES):
            if name in names:
                self._write_state(tile, i, buf[i, : tile.numel])

    def initialize(self, tile: Tile, master: torch.Tensor) -> None:
        """Write a tile's initial master weights and zero moments (synchronously; at start only)."""
        buf = self._free.get()
        try:
            buf[0, : tile.numel].copy_(master)
            buf[1:, : tile.numel].zero_()
            self._write(tile, buf)
        finally:
            self._free.put(buf)

    def write_master(self, tile: Tile, master: torch.Tensor) -> None:
        """Overwrite a tile's master weights in the file (moments kept); synchronous."""
        self.flush()
        buf = self._free.get()
        try:
            buf[0, : tile.numel].copy_(master)
            self._write(tile, buf, names=("master",))
        finally:
            self._free.put(buf)

    def read_tile(self, tile: Tile) -> TileState:
        """A copy of one tile's state (for checks and checkpoints; not on the training path)."""
        self.flush()
        out = torch.empty(3, tile.numel + tile.numel % 2, dtype=torch.float32)  # rows 8-byte aligned
        self._read(tile, out)
        n = tile.numel
        return TileState(out[0, :n], out[1, :n], out[2, :n])

    def read_state(self, tile: Tile, name: str, lo: int, hi: int) -> torch.Tensor:
        """A copy of elements ``[lo, hi)`` of the unit's chunk (inside ``tile``) of one state file
        (checkpoints: one range in memory at a time; a sync point with the disk). Verified: the 4 KiB blocks
        around the range are read and checked."""
        self.flush()
        if not self.verify:
            out = torch.empty(hi - lo, dtype=torch.float32)
            at = (tile.offset + lo - tile.lo) * _FP32
            _rw_all(os.preadv, self.fds[name], out, at, "read", self._path(name))
            return out
        a, b = (lo - tile.lo) * _FP32, (hi - tile.lo) * _FP32  # bytes inside the tile
        k0 = a // SUM_BLOCK
        start, end = k0 * SUM_BLOCK, min(n_blocks(b) * SUM_BLOCK, tile.numel * _FP32)
        raw = torch.empty(max(end - start, 0), dtype=torch.uint8)
        if raw.numel():
            self._read_state(tile, STATE_NAMES.index(name), raw, k0)
        out = raw[a - start : b - start].view(torch.float32)
        return out if out.numel() == raw.numel() // _FP32 else out.clone()

    def write_tile(self, tile: Tile, state: TileState) -> None:
        """Overwrite a tile's master weights and moments in the files; synchronous (checkpoint load)."""
        self.flush()
        for i, t in enumerate(state):
            self._write_state(tile, i, t.detach().to("cpu", torch.float32).contiguous())

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
                n = t.numel
                yield t, TileState(buf[0, :n], buf[1, :n], buf[2, :n])
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
        for fd in self.fds.values():
            try:
                os.close(fd)
            except OSError:
                pass
        self.fds = {}

    @staticmethod
    def _cleanup(fds: Dict[str, int], directory: str, writer: ThreadPoolExecutor) -> None:
        writer.shutdown(wait=True)
        for fd in fds.values():
            try:
                os.close(fd)
            except OSError:
                pass
        remove_swap_dir(directory)

    def close(self) -> None:
        """Flush, close and delete the state files."""
        try:
            self.flush()
        finally:
            self._finalizer()
