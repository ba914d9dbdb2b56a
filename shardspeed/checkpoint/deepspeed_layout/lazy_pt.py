"""``torch.save``'s zip files opened lazily: the pickled structure is read, every tensor in it becomes a
:class:`TensorRef` (dtype, shape and where its bytes are in the file), and a slice of one is read with
one ``readinto``, so reading DeepSpeed's rank files touches only the bytes asked for (a memory map would
leave every page read in the process's RSS until the file is closed).

The format (``torch/serialization.py``): ``<archive>/data.pkl`` pickles the object; a tensor is a call of
``torch._utils._rebuild_tensor_v2(storage, offset, size, stride, ...)`` whose storage is a persistent id
``("storage", storage_type, key, location, numel)``; the storage's bytes are the stored (uncompressed) zip
member ``<archive>/data/<key>``. Anything else (the legacy non-zip format, another rebuild function) is
:class:`LazyUnsupported`: the caller falls back to ``torch.load``.
"""
from __future__ import annotations

import io
import math
import pickle
import struct
import warnings
import zipfile
from dataclasses import dataclass
from typing import Any, Callable, Dict, Optional, Tuple

import torch

from ...errors import CheckpointError
from ..format import tensor_bytes


class LazyUnsupported(Exception):
    """This file needs ``torch.load`` (not the zip format, or a tensor kind this reader does not know)."""


@dataclass
class TensorRef:
    """A tensor of a ``torch.save`` file, not read: ``numel`` elements of ``dtype`` from byte ``offset``."""

    path: str
    offset: int  # of its first element in the file
    dtype: torch.dtype
    shape: Tuple[int, ...]

    def numel(self) -> int:
        return math.prod(self.shape)

    def read(self, lo: int, hi: int, out: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Elements ``[lo, hi)`` of the flattened tensor (into ``out``, a contiguous CPU tensor of its
        dtype, when given)."""
        t = torch.empty(hi - lo, dtype=self.dtype) if out is None else out
        if out is not None and (out.dtype != self.dtype or not out.is_contiguous() or out.numel() != hi - lo):
            t = torch.empty(hi - lo, dtype=self.dtype)
        size = torch.empty((), dtype=self.dtype).element_size()
        buf = tensor_bytes(t) if t.numel() else None
        if buf is not None:
            with open(self.path, "rb") as f:
                f.seek(self.offset + lo * size)
                got = f.readinto(memoryview(buf))
            if got != (hi - lo) * size:
                raise CheckpointError(f"DeepSpeed checkpoint file {self.path} is cut short; the file is truncated")
        if out is not None and t is not out:
            out.view(-1).copy_(t)
            return out
        return t


def _member_offsets(path: str) -> Tuple[str, Dict[str, Tuple[int, int]], zipfile.ZipFile]:
    """(the archive's ``data.pkl`` member, data key -> (byte offset, byte length)) of a torch zip file."""
    try:
        z = zipfile.ZipFile(path)
    except zipfile.BadZipFile:
        raise LazyUnsupported(path) from None
    pkl = next((i.filename for i in z.infolist() if i.filename.endswith("/data.pkl")), None)
    if pkl is None:
        z.close()
        raise LazyUnsupported(path)
    prefix = pkl[: -len("data.pkl")] + "data/"
    out: Dict[str, Tuple[int, int]] = {}
    with open(path, "rb") as f:
        for info in z.infolist():
            if not info.filename.startswith(prefix):
                continue
            if info.compress_type != zipfile.ZIP_STORED:
                z.close()
                raise LazyUnsupported(path)
            f.seek(info.header_offset)
            head = f.read(30)
            name_len, extra_len = struct.unpack("<HH", head[26:30])
            out[info.filename[len(prefix):]] = (info.header_offset + 30 + name_len + extra_len, info.file_size)
    return pkl, out, z


def load_lazy(path: str, find_class: Callable[[str, str], Any]) -> Any:
    """The object in ``path`` with :class:`TensorRef` for every tensor. ``find_class``: the look-up of
    globals other than torch's tensor machinery (DeepSpeed's classes become stand-ins there)."""
    pkl, members, z = _member_offsets(path)
    with z:
        data = z.read(pkl)

    def rebuild(storage, storage_offset, size, stride, *rest):
        key, dtype = storage
        if key not in members:
            raise CheckpointError(f"DeepSpeed checkpoint file {path} has no storage {key!r}; the file is corrupt")
        shape = tuple(int(s) for s in size)
        contiguous = [math.prod(shape[i + 1 :]) for i in range(len(shape))]
        if math.prod(shape) > 1 and list(stride) != contiguous and any(s > 1 for s in shape):
            raise LazyUnsupported(path)
        start, nbytes = members[key]
        size_ = torch.empty((), dtype=dtype).element_size()
        if (int(storage_offset) + math.prod(shape)) * size_ > nbytes:
            raise CheckpointError(f"DeepSpeed checkpoint file {path}: a tensor runs past its storage {key!r}")
        return TensorRef(path, start + int(storage_offset) * size_, dtype, shape)

    def parameter(data, *rest):  # torch._utils._rebuild_parameter: the data is what is read
        return data

    def subclass(func, new_type, args, state):  # torch._tensor._rebuild_from_type_v2: the plain tensor
        return func(*args)

    known = {("torch._utils", "_rebuild_tensor_v2"): rebuild, ("torch._utils", "_rebuild_parameter"): parameter,
             ("torch._tensor", "_rebuild_from_type_v2"): subclass}

    class Unpickler(pickle.Unpickler):
        def find_class(self, module: str, name: str) -> Any:
            if (module, name) in known:
                return known[(module, name)]
            if module in ("torch._utils", "torch._tensor") and name.startswith("_rebuild"):
                raise LazyUnsupported(f"{path}: {name}")
            return find_class(module, name)

        def persistent_load(self, saved_id: Any) -> Any:
            if not (isinstance(saved_id, tuple) and saved_id and saved_id[0] in ("storage", b"storage")):
                raise LazyUnsupported(path)
            storage_type, key = saved_id[1], saved_id[2]
            with warnings.catch_warnings():  # (TypedStorage's deprecation: its dtype is all that is used)
                warnings.simplefilter("ignore")
                dtype = torch.uint8 if storage_type is torch.UntypedStorage else storage_type.dtype
            return (str(key), dtype)

    try:
        return Unpickler(io.BytesIO(data)).load()
    except (LazyUnsupported, CheckpointError):
        raise
    except Exception as exc:
        raise CheckpointError(f"DeepSpeed checkpoint file {path} cannot be read ({type(exc).__name__}: "
                              f"{exc})") from exc
