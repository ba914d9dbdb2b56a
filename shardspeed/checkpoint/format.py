"""One job: checkpoint files, as safetensors written tensor by tensor with a CRC-32 each, and read back checked.

The writer does not build the file in memory (``safetensors.torch.save_file`` does): the header is
computed from shapes and dtypes alone, then each tensor is copied out in slices of at most
:data:`WRITE_CHUNK_BYTES` (one device-to-host copy per slice), so the extra memory of a save is one slice.
The files are plain safetensors: ``safetensors.safe_open`` and any other reader open them.
"""
from __future__ import annotations

import json
import math
import os
import signal
import struct
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Callable, Dict, List, Mapping, Optional, Sequence, Tuple, Union

import torch

from ..errors import CheckpointError
from ..utils.direct_io import StreamWriter
from ..utils.safe_files import create_new, fsync_path, write_atomic

WRITE_CHUNK_BYTES = 64 << 20

try:  # zlib-ng's CRC-32: zlib's values, about 7 times faster (SIMD); ``pip install shardspeed[fast]``
    from zlib_ng.zlib_ng import crc32
except ImportError:  # pragma: no cover - depends on the install
    from zlib import crc32

DTYPE_TO_ST: Mapping[torch.dtype, str] = MappingProxyType({
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
    torch.bool: "BOOL",
})
DTYPE_NAMES: Mapping[torch.dtype, str] = MappingProxyType({d: str(d).replace("torch.", "") for d in DTYPE_TO_ST})
NAME_TO_DTYPE: Mapping[str, torch.dtype] = MappingProxyType({v: k for k, v in DTYPE_NAMES.items()})


def dtype_name(dtype: torch.dtype) -> str:
    try:
        return DTYPE_NAMES[dtype]
    except KeyError:
        raise CheckpointError(f"cannot checkpoint a tensor of dtype {dtype}: supported are {sorted(DTYPE_NAMES.values())}") from None


def tensor_bytes(t: torch.Tensor):
    """The raw bytes of a contiguous CPU tensor, as a numpy uint8 array (no copy)."""
    return t.reshape(-1).view(torch.uint8).numpy()


# ---- test hook -----------------------------------------------------------------------------------------
@dataclass(frozen=True)
class CrashHook:
    """Where a save may be interrupted: tests replace :data:`CRASH_HOOK` (``tests/crash_hook.py``) to kill the
    process at a named point or after N bytes of its file. This one does nothing and holds nothing:
    production code reads no switch for it."""

    def at(self, point: str, rank: int) -> None:
        """Called at the named point of a save (``after_files``, ``after_metadata``, ``after_rename``, ...)."""

    def kill_after_bytes(self, rank: int) -> Optional[int]:
        """How many bytes of its checkpoint file ``rank`` writes before it is killed; None: all of them."""
        return None


CRASH_HOOK = CrashHook()


def maybe_crash(point: str, rank: int) -> None:
    CRASH_HOOK.at(point, rank)


# ---- writing -------------------------------------------------------------------------------------------
class LazyTensor:
    """A tensor described by shape and dtype, produced by ``make()`` only when its bytes are written (so a
    file of many tensors needs one of them in memory at a time)."""

    def __init__(self, shape, dtype: torch.dtype, make):
        self.shape = torch.Size(shape)
        self.dtype = dtype
        self._make = make

    def numel(self) -> int:
        return self.shape.numel()

    def element_size(self) -> int:
        return torch.empty((), dtype=self.dtype).element_size()

    def materialize(self) -> torch.Tensor:
        t = self._make()
        if t.dtype != self.dtype or t.shape != self.shape:
            raise CheckpointError(f"internal error: lazy tensor made {t.dtype}{list(t.shape)}, "
                                  f"declared {self.dtype}{list(self.shape)}")
        return t


# ---- CRC-32 of a concatenation, from the parts' (zlib's crc32_combine, which Python's zlib lacks) -------
_CRC_POLY = 0xEDB88320  # CRC-32's polynomial, reflected


def _multmodp(a: int, b: int) -> int:
    """``a * b`` modulo CRC-32's polynomial (both reflected, as zlib's ``multmodp``)."""
    m, p = 1 << 31, 0
    while True:
        if a & m:
            p ^= b
            if a & (m - 1) == 0:
                return p
        m >>= 1
        b = (b >> 1) ^ _CRC_POLY if b & 1 else b >> 1


def _x2n_table() -> Tuple[int, ...]:
    """``x ** (2 ** k)`` modulo the polynomial, for k in 0..31."""
    p, out = 1 << 30, []  # x ** 1
    for _ in range(32):
        out.append(p)
        p = _multmodp(p, p)
    return tuple(out)


_X2N = _x2n_table()


def crc32_combine(crc1: int, crc2: int, len2: int) -> int:
    """The CRC-32 of ``a + b`` from ``crc1 = crc32(a)``, ``crc2 = crc32(b)`` and ``len2 = len(b)``: ``crc1``
    times ``x ** (8 * len2)``, plus ``crc2`` (a few hundred integer operations, however long ``b`` is)."""
    p, k, n = 1 << 31, 3, len2  # p = x ** 0; x ** (8 n) = x ** (n * 2 ** 3)
    while n:
        if n & 1:
            p = _multmodp(_X2N[k & 31], p)
        n >>= 1
        k += 1
    return _multmodp(p, crc1) ^ crc2


@dataclass
class WrittenFile:
    bytes: int
    crc32: int  # of the whole file
    tensor_crc32: Dict[str, int] = field(default_factory=dict)
    header_crc32: int = 0  # of the first 8 + header-length bytes (the length and the JSON header)


def fsync_dir(path: str) -> None:
    """``fsync`` the folder ``path`` (:func:`~shardspeed.utils.safe_files.fsync_path`; refusals let be)."""
    fsync_path(path, directory=True)


def write_safetensors(path: str, items: Sequence[Tuple[str, Union[torch.Tensor, LazyTensor]]], metadata: Optional[Dict[str, str]] = None,
                      rank: int = 0, on_written: Optional[Callable[[], None]] = None) -> WrittenFile:
    """Write ``items`` (key, tensor) to ``path`` as safetensors, streaming, then fsync. Tensors are stored
    with their own shape and dtype. The file is written with ``O_DIRECT`` where its file system allows it
    (:class:`~shardspeed.utils.direct_io.StreamWriter`: one copy into an aligned buffer instead of the
    kernel's copy into its page cache, a twentieth of the CPU time). ``on_written()`` runs once every byte
    is handed to the OS, before the fsync (the tensors are not read after it)."""
    header: Dict[str, object] = {}
    off = 0
    for key, t in items:
        if key in header:
            raise CheckpointError(f"internal error: tensor key {key!r} written twice to {path}")
        n = t.numel() * t.element_size()
        header[key] = {"dtype": DTYPE_TO_ST[t.dtype] if t.dtype in DTYPE_TO_ST else dtype_name(t.dtype),
                       "shape": list(t.shape), "data_offsets": [off, off + n]}
        off += n
    if metadata:
        header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
    hb = json.dumps(header, separators=(",", ":")).encode()
    hb += b" " * (-len(hb) % 8)
    kill_at = CRASH_HOOK.kill_after_bytes(rank)
    written = 0
    out = WrittenFile(0, 0)

    f = StreamWriter(path)
    try:
        tcrc = 0

        def digest(piece) -> None:
            nonlocal tcrc
            tcrc = crc32(piece, tcrc)

        def emit(buf, checksum: bool = True) -> None:
            nonlocal written
            if kill_at is not None and written + len(buf) >= kill_at:
                f.write(memoryview(buf)[: max(kill_at - written, 0)])
                f.flush()
                os.kill(os.getpid(), signal.SIGKILL)
            f.write(buf, digest if checksum else None)  # the bytes pass once more, in the cache: their CRC-32
            written += len(buf)

        head = struct.pack("<Q", len(hb)) + hb
        emit(head, checksum=False)
        crc = out.header_crc32 = crc32(head)
        for key, t in items:
            if isinstance(t, LazyTensor):
                t = t.materialize()
            flat = t.detach().reshape(-1)
            step = max(WRITE_CHUNK_BYTES // max(flat.element_size(), 1), 1)
            tcrc = 0
            for i in range(0, flat.numel(), step):
                part = flat[i : i + step]
                if part.device.type != "cpu":
                    part = part.cpu()  # one slice on the host at a time; a device sync point
                emit(tensor_bytes(part.contiguous()))  # the file's CRC is combined from the tensors' (no 2nd pass)
            out.tensor_crc32[key] = tcrc
            crc = crc32_combine(crc, tcrc, flat.numel() * flat.element_size())
        f.flush()
        if on_written is not None:
            on_written()
        os.fsync(f.fd)
        if not f.direct:
            _drop_cached(f.fd)
    finally:
        f.close(sync=False)
    out.bytes, out.crc32 = written, crc
    return out


def _drop_cached(fd: int) -> None:
    """Let the OS drop a written, synced checkpoint file's pages from its cache (Linux ``POSIX_FADV_DONTNEED``):
    they are not read back soon, and the next save then writes into reused pages. On this box that cut the
    kernel's CPU time for writing 322 MiB from about 0.9 s to 0.15-0.2 s after the first save."""
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    except (AttributeError, OSError):  # not Linux, or a filesystem without it: the pages stay cached
        pass


def write_bytes_atomic(path: str, data: bytes) -> None:
    """Write a small file through a private temporary folder beside it, fsync, ``os.replace``, fsync the
    directory (:func:`~shardspeed.utils.safe_files.write_atomic`: never through a link planted at a
    temporary name)."""
    write_atomic(path, data)


def write_file_synced(path: str, data: bytes) -> int:
    """Create ``path`` (it must not exist: :func:`~shardspeed.utils.safe_files.create_new`), write ``data``,
    fsync; returns its CRC-32."""
    with os.fdopen(create_new(path), "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    return crc32(data)


# ---- reading -------------------------------------------------------------------------------------------
ST_TO_DTYPE: Mapping[str, torch.dtype] = MappingProxyType({v: k for k, v in DTYPE_TO_ST.items()})


def is_plain_name(name: object) -> bool:
    """Whether ``name`` is a plain file name: a non-empty string with no path separator or NUL, not ``.`` or
    ``..`` (so it is not absolute either, and ``{dir}/{name}`` names a file directly in ``dir``)."""
    return (isinstance(name, str) and name not in ("", ".", "..") and "/" not in name and os.sep not in name
            and (os.altsep is None or os.altsep not in name) and "\0" not in name)


def confined_path(root: str, name: object, where: str) -> str:
    """The real path of checkpoint file ``name`` of the directory ``root``: a plain name, and (symlinks
    resolved) a file directly in that directory; raises a one-line :class:`CheckpointError` otherwise.
    ``where``: what named the file (the metadata), for the message."""
    if not is_plain_name(name):
        raise CheckpointError(f"{where} names the file {name!r}: only plain file names inside the checkpoint "
                              f"directory are read (no '/', '..' or absolute path); the metadata is corrupt or "
                              f"crafted")
    assert isinstance(name, str)
    real = os.path.realpath(os.path.join(root, name))
    if os.path.dirname(real) != os.path.realpath(root):
        raise CheckpointError(f"{where} names the file {name!r}, a link to {real} outside the checkpoint directory "
                              f"{root}: refused (copy the file into the directory instead)")
    return real


class ShardReader:
    """Read whole tensors from the safetensors files of one checkpoint, checking their CRC.

    Reads with ``readinto`` into a fresh tensor rather than through a memory map: the bytes land once in
    memory this process owns, and the file's pages do not count against the process while it loads.
    """

    #: bytes read at a time by :meth:`check` (which verifies a tensor without keeping it)
    CHECK_CHUNK_BYTES = 16 << 20

    def __init__(self, root: str, verify: bool = True, header_crc32: Optional[Dict[str, Optional[int]]] = None):
        """``header_crc32``: per file, the CRC-32 of its length prefix and JSON header as recorded at save
        time (format 3); a header that does not match is refused before any of it is used. Headers are
        checked whatever ``verify`` says (they are small); ``verify`` governs the tensors' CRCs."""
        self.root = root
        self.verify = verify
        self.header_crc32 = dict(header_crc32 or {})
        self._headers: Dict[str, Tuple[int, dict]] = {}
        self._paths: Dict[str, str] = {}
        self._infos: Dict[Tuple[str, str], Tuple[str, int, int, List[int], torch.dtype]] = {}  # checked entries

    def _path(self, file: str) -> str:
        """The file's real path, confined to the checkpoint directory (:func:`confined_path`; once per file)."""
        path = self._paths.get(file)
        if path is None:
            path = self._paths[file] = confined_path(self.root, file, f"checkpoint {self.root}")
        return path

    def _header(self, file: str) -> Tuple[int, dict]:
        h = self._headers.get(file)
        if h is None:
            path = self._path(file)
            try:
                with open(path, "rb") as f:
                    raw = f.read(8)
                    if len(raw) < 8:
                        raise ValueError("shorter than its 8-byte header length")
                    n = struct.unpack("<Q", raw)[0]
                    text = f.read(n)
                    if len(text) < n:
                        raise ValueError("header cut short")
                    want = self.header_crc32.get(file)
                    if want is not None:
                        got = crc32(text, crc32(raw))
                        if got != want:
                            raise CheckpointError(
                                f"checkpoint file {path}: its header fails its checksum (crc32 {got:#010x}, "
                                f"expected {want:#010x}); the file is corrupt")
                    header = json.loads(text)
                    if not isinstance(header, dict):
                        raise ValueError("the header is not a JSON object")
            except FileNotFoundError:
                raise CheckpointError(f"checkpoint file {path} is missing") from None
            except (ValueError, RecursionError) as exc:
                raise CheckpointError(f"checkpoint file {path} cannot be read ({exc}); it is truncated or corrupt") from exc
            h = (8 + n, header)
            self._headers[file] = h
        return h

    def read(self, file: str, key: str, crc: Optional[int] = None, out: Optional[torch.Tensor] = None) -> torch.Tensor:
        """The tensor ``key``; with ``out`` (a contiguous CPU tensor of its dtype and size), read into it in
        place (no temporary)."""
        path, start, end, shape, dtype = self._info(file, key)
        if out is not None:
            t = out
            if t.dtype != dtype or t.numel() != math.prod(shape):
                raise CheckpointError(f"internal error: reading {key!r} of {path} into a {t.dtype}{list(t.shape)}")
        else:
            t = torch.empty(shape, dtype=dtype)
        buf = tensor_bytes(t) if t.numel() else None
        if buf is not None and len(buf) != end - start:
            raise CheckpointError(f"checkpoint file {path}: tensor {key!r} has a malformed header entry")
        if buf is not None:
            with open(path, "rb") as f:
                f.seek(start)
                got = f.readinto(memoryview(buf))
            if got != end - start:
                raise CheckpointError(f"checkpoint file {path}: tensor {key!r} is cut short; the file is truncated")
        if self.verify and crc is not None:
            got_crc = crc32(buf) if buf is not None else 0
            if got_crc != crc:
                raise CheckpointError(
                    f"checkpoint file {path}: tensor {key!r} fails its checksum "
                    f"(crc32 {got_crc:#010x}, expected {crc:#010x}); the file is corrupt"
                )
        return t

    def _info(self, file: str, key: str) -> Tuple[str, int, int, List[int], torch.dtype]:
        """(path, absolute start, end, shape, dtype) of tensor ``key``; raises on a malformed header entry."""
        got = self._infos.get((file, key))
        if got is not None:
            return got
        base, header = self._header(file)
        path = self._path(file)
        info = header.get(key)
        if info is None:
            raise CheckpointError(f"checkpoint file {path} has no tensor {key!r}")
        try:
            lo, hi = (int(v) for v in info["data_offsets"])
            dtype = ST_TO_DTYPE[info["dtype"]]
            shape = [int(d) for d in info["shape"]]
        except (KeyError, TypeError, ValueError):
            raise CheckpointError(f"checkpoint file {path}: tensor {key!r} has a malformed header entry") from None
        if lo < 0 or min(shape, default=0) < 0 or hi - lo != math.prod(shape) * dtype.itemsize:
            raise CheckpointError(f"checkpoint file {path}: tensor {key!r} has a malformed header entry")
        got = self._infos[(file, key)] = (path, base + lo, base + hi, shape, dtype)
        return got

    def stored(self, file: str, key: str) -> Tuple[List[int], torch.dtype]:
        """(shape, dtype) of tensor ``key`` as its file's header gives them (checked, nothing read but the header)."""
        _, _, _, shape, dtype = self._info(file, key)
        return shape, dtype

    def check(self, file: str, key: str, crc: Optional[int] = None) -> None:
        """Verify tensor ``key`` without keeping it: its header entry, that its bytes are all there, and
        (when ``verify`` and a CRC is given) its CRC-32, reading :attr:`CHECK_CHUNK_BYTES` at a time."""
        path, lo, hi, _, _ = self._info(file, key)
        if not (self.verify and crc is not None):
            if os.path.getsize(path) < hi:
                raise CheckpointError(f"checkpoint file {path}: tensor {key!r} is cut short; the file is truncated")
            return
        got_crc, pos = 0, lo
        with open(path, "rb") as f:
            f.seek(lo)
            while pos < hi:
                buf = f.read(min(self.CHECK_CHUNK_BYTES, hi - pos))
                if not buf:
                    raise CheckpointError(f"checkpoint file {path}: tensor {key!r} is cut short; the file is truncated")
                got_crc = crc32(buf, got_crc)
                pos += len(buf)
        if got_crc != crc:
            raise CheckpointError(
                f"checkpoint file {path}: tensor {key!r} fails its checksum "
                f"(crc32 {got_crc:#010x}, expected {crc:#010x}); the file is corrupt"
            )

    def dtype_of(self, file: str, key: str) -> torch.dtype:
        return self.stored(file, key)[1]

    def close(self) -> None:
        self._headers.clear()
        self._paths.clear()
        self._infos.clear()
