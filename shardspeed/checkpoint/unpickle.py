"""Pickles read from checkpoints, without running code from them unless the caller trusts the checkpoint.

A pickle names the functions and classes it calls to rebuild its objects, so unpickling an untrusted file
runs whatever it names. Everything shardspeed itself writes into a pickle (``common.pt``: counters, the LR
schedule's and loss scaler's state, the data-loader position, and the client state of plain containers,
numbers, strings and tensors) loads with ``torch.load(weights_only=True)``, which calls only torch's tensor
machinery and a few containers; :data:`SAFE_BUILTINS` adds builtins that only build a value (``range``,
``frozenset``, ...). Anything else (a client state holding the user's own class) is refused with a
:class:`PickleRefused` naming it, unless the caller passes ``trust_pickles=True``, which unpickles with
plain ``torch.load(weights_only=False)``: any code the file names runs. DeepSpeed's files go through an
allowlist of their own (:mod:`.deepspeed_layout.pickles`) with the same opt-in and the same message.
"""
from __future__ import annotations

import io
import os
import pickle
import re
from typing import Any, Dict, Iterable, List

import torch

from ..errors import CheckpointError
from .format import crc32
from .metadata import COMMON_FILE, CheckpointMetadata

#: builtins (``module.name`` after pickle's Python 2 name mapping) that only construct a value from
#: plain arguments; torch's weights-only unpickler already allows ``set``, ``complex`` and ``bytearray``
SAFE_BUILTINS = ("builtins.set", "builtins.frozenset", "builtins.range", "builtins.complex", "builtins.slice",
                 "builtins.bytearray", "builtins.bytes", "builtins.dict", "builtins.list", "builtins.tuple",
                 "builtins.int", "builtins.float", "builtins.bool", "builtins.str")
OPT_IN = ("pass trust_pickles=True (shardspeed convert --trust-pickles) only if you trust where the checkpoint "
          "came from: unpickling it runs any code it names")


class PickleRefused(CheckpointError):
    """A pickle names a global that is not on the allowlist (``names``: ``module.name`` of each)."""

    def __init__(self, names: Iterable[str], file: str = ""):
        self.names: List[str] = sorted(set(names)) or ["?"]
        self.file = file
        shown = ", ".join(self.names[:4]) + (", ..." if len(self.names) > 4 else "")
        where = f"checkpoint file {file}" if file else "a checkpoint pickle"
        super().__init__(f"{where} names {shown}, which a checkpoint of plain state does not hold; refused "
                         f"(nothing of it ran). To load it, {OPT_IN}")

    def at(self, file: str) -> PickleRefused:
        """The same refusal, naming the file."""
        return PickleRefused(self.names, file)


def _safe_builtin_objects() -> List[Any]:
    import builtins

    return [getattr(builtins, n.split(".", 1)[1]) for n in SAFE_BUILTINS]


def _unsafe_names(data: bytes, exc: Exception) -> List[str]:
    """The globals of ``data`` that the weights-only load refuses (read from the pickle's opcodes, nothing
    is called), else the one torch's error names."""
    try:
        names = torch.serialization.get_unsafe_globals_in_checkpoint(io.BytesIO(data))
        names = [n for n in names if n not in SAFE_BUILTINS]
        if names:
            return list(names)
    except Exception:  # not torch's zip format: the error message is all there is
        pass
    m = re.search(r"GLOBAL (\S+?)(?: was not| whose|\s|$)", str(exc))
    return [m[1]] if m else []


def load_pickle(data: bytes, file: str, trust_pickles: bool = False) -> Any:
    """``torch.load`` of ``data`` (the bytes of ``file``) on the CPU: weights-only plus
    :data:`SAFE_BUILTINS`, or anything with ``trust_pickles``. A refused global is a :class:`PickleRefused`
    naming it; any other failure a CheckpointError naming the file."""
    buf = io.BytesIO(data)
    try:
        if trust_pickles:
            return torch.load(buf, map_location="cpu", weights_only=False)
        with torch.serialization.safe_globals(_safe_builtin_objects()):
            return torch.load(buf, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as exc:
        names = [] if trust_pickles else _unsafe_names(data, exc)
        if names:
            raise PickleRefused(names, file) from None
        raise CheckpointError(f"checkpoint file {file} cannot be unpickled ({type(exc).__name__}: "
                              f"{str(exc).splitlines()[0]})") from None
    except Exception as exc:
        raise CheckpointError(f"checkpoint file {file} cannot be unpickled ({type(exc).__name__}: {exc})") from exc


def read_common(path: str, meta: CheckpointMetadata, trust_pickles: bool = False) -> Dict[str, Any]:
    """``common.pt`` of our checkpoint at ``path``, checked against the CRC-32 its metadata records before
    it is unpickled (:func:`load_pickle`)."""
    file = os.path.join(path, COMMON_FILE)
    info = meta.files.get(COMMON_FILE)
    if info is None:
        raise CheckpointError(f"{os.path.join(path, 'metadata.json')} lists no {COMMON_FILE}; the checkpoint is "
                              f"incomplete or corrupt")
    try:
        with open(file, "rb") as f:
            data = f.read()
    except OSError as exc:
        raise CheckpointError(f"checkpoint file {file} cannot be read: {exc}") from exc
    got = crc32(data)
    if got != info.crc32:
        raise CheckpointError(f"checkpoint file {file} fails its checksum (crc32 {got:#010x}, expected "
                              f"{info.crc32:#010x}); the file is corrupt")
    common = load_pickle(data, file, trust_pickles)
    if not isinstance(common, dict):
        raise CheckpointError(f"checkpoint file {file} does not hold a dict; it is not a shardspeed checkpoint")
    return common
