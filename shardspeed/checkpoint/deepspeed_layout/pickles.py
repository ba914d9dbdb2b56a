"""DeepSpeed's ``.pt`` files, opened without DeepSpeed and read one tensor slice at a time.

DeepSpeed pickles a few of its own objects into its checkpoints (``ZeroStageEnum``, ``fragment_address``,
``LossScaler``). :func:`load_pt` opens a file through an unpickler that turns every ``deepspeed.*`` class
into a :class:`Stand` (which keeps the constructor arguments and the attribute state), so no DeepSpeed
code runs and DeepSpeed need not be installed.

Files in ``torch.save``'s zip format are opened lazily (:mod:`.lazy_pt`): tensors are
:class:`~.lazy_pt.TensorRef` and only the slices asked for are read; other files go through
``torch.load`` (memory-mapped where it can). These are pickles: loading one runs whatever the file says, as
``torch.load(weights_only=False)`` does. Load only checkpoints you trust.
"""
from __future__ import annotations

import os
import pickle
import sys
from collections import OrderedDict
from typing import Any, Dict, Optional, Tuple

import torch

from ...errors import CheckpointError
from ..format import ShardReader
from .lazy_pt import LazyUnsupported, TensorRef, load_lazy


class Stand:
    """A DeepSpeed object read without DeepSpeed: its class name, constructor arguments and attributes."""

    ds_class = "?"
    args: Tuple[Any, ...] = ()  # (objects rebuilt by ``__newobj__`` skip ``__init__``)
    kwargs: Dict[str, Any] = {}

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.args = args
        self.kwargs = kwargs

    def __setstate__(self, state: Any) -> None:
        if isinstance(state, tuple) and len(state) == 2:  # (dict state, slots state)
            state = {**(state[0] or {}), **(state[1] or {})}
        if isinstance(state, dict):
            self.__dict__.update(state)

    @property
    def value(self) -> Any:
        """An enum's value (``ZeroStageEnum(2)`` pickles as the class called with 2)."""
        return self.args[0] if self.args else None

    def __repr__(self) -> str:
        return f"<{self.ds_class} {self.args or ''}{self.__dict__ or ''}>"


def _stand_class(module: str, name: str) -> type:
    return type(name, (Stand,), {"ds_class": f"{module}.{name}"})


class _Module:
    """What ``torch.load(pickle_module=...)`` needs of a pickle module, with the class look-up replaced."""

    class Unpickler(pickle.Unpickler):
        def find_class(self, module: str, name: str) -> Any:
            if module == "deepspeed" or module.startswith("deepspeed."):
                return _stand_class(module, name)
            return super().find_class(module, name)  # (torch.load's own wrapper maps torch's names)

    @staticmethod
    def load(f: Any, **kwargs: Any) -> Any:
        return _Module.Unpickler(f, **kwargs).load()

    __name__ = "shardspeed_deepspeed_pickle"


def _find_class(module: str, name: str) -> Any:
    """Globals of a pickle: DeepSpeed's classes as stand-ins, anything else as pickle finds it."""
    if module == "deepspeed" or module.startswith("deepspeed."):
        return _stand_class(module, name)
    __import__(module)
    obj: Any = sys.modules[module]
    for part in name.split("."):
        obj = getattr(obj, part)
    return obj


def is_tensor(x: Any) -> bool:
    return torch.is_tensor(x) or isinstance(x, TensorRef)


def load_pt(path: str) -> Any:
    """The object in ``path``: lazily (:mod:`.lazy_pt`: tensors as :class:`TensorRef`, read slice by slice)
    where the file is ``torch.save``'s zip format, else through ``torch.load`` (memory-mapped if it can)."""
    if not os.path.isfile(path):
        raise CheckpointError(f"DeepSpeed checkpoint file {path} is missing")
    try:
        return load_lazy(path, _find_class)
    except LazyUnsupported:
        pass
    for mmap in (True, False):
        try:
            return torch.load(path, map_location="cpu", mmap=mmap, weights_only=False, pickle_module=_Module)
        except RuntimeError as exc:  # the legacy (non-zip) format cannot be memory-mapped
            if mmap and "mmap" in str(exc):
                continue
            raise CheckpointError(f"DeepSpeed checkpoint file {path} cannot be read ({exc})") from exc
        except Exception as exc:
            raise CheckpointError(f"DeepSpeed checkpoint file {path} cannot be read "
                                  f"({type(exc).__name__}: {exc})") from exc
    raise CheckpointError(f"DeepSpeed checkpoint file {path} cannot be read")


def materialize(obj: Any) -> Any:
    """``obj`` with every :class:`TensorRef` read (small state handed to the engine: client state, LR
    schedule)."""
    if isinstance(obj, TensorRef):
        return obj.read(0, obj.numel()).view(obj.shape)
    if isinstance(obj, dict):
        return type(obj)((k, materialize(v)) for k, v in obj.items()) if isinstance(obj, OrderedDict) else \
            {k: materialize(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(materialize(v) for v in obj)
    return obj


def stage_of(value: Any) -> Optional[int]:
    """A ZeRO stage as DeepSpeed pickles it (``ZeroStageEnum`` or a plain int)."""
    if isinstance(value, Stand):
        value = value.value
    try:
        return int(value)
    except (TypeError, ValueError):
        return None


def field(obj: Any, path: Tuple[Any, ...], where: str) -> Any:
    """``obj[path[0]][path[1]]...``; a missing step is a CheckpointError naming the file and the field."""
    cur = obj
    for i, k in enumerate(path):
        try:
            cur = cur[k]
        except (KeyError, IndexError, TypeError):
            name = "/".join(str(p) for p in path[: i + 1])
            raise CheckpointError(f"DeepSpeed checkpoint file {where} has no field {name!r}; it is not a layout "
                                  f"this shardspeed reads") from None
    return cur


def key_of(path: Tuple[Any, ...], lo: int, hi: int) -> str:
    """An entry's key: the field path and the element range ``[lo, hi)`` of the flattened tensor there."""
    return "/".join(f"{'#' if isinstance(p, int) else ''}{p}" for p in path) + f"@{lo}:{hi}"


def parse_key(key: str) -> Tuple[Tuple[Any, ...], int, int]:
    where, rng = key.rsplit("@", 1)
    lo, hi = rng.split(":")
    path = tuple(int(p[1:]) if p.startswith("#") else p for p in where.split("/")) if where else ()
    return path, int(lo), int(hi)


class PtReader(ShardReader):
    """:class:`~shardspeed.checkpoint.format.ShardReader`'s interface over DeepSpeed's files, so the
    loader's range reads work unchanged: ``key`` is :func:`key_of` (a field path and a flat range). At most
    :attr:`OPEN_FILES` files are held open (memory-mapped) at a time. DeepSpeed records no checksums:
    ``crc`` is ignored."""

    OPEN_FILES = 2  # a range spans two rank files at most (the structures are small: tensors are references)

    def __init__(self, root: str):
        super().__init__(root, verify=False)
        self._open: OrderedDict[str, Any] = OrderedDict()

    def obj(self, file: str) -> Any:
        if file in self._open:
            self._open.move_to_end(file)
            return self._open[file]
        obj = load_pt(os.path.join(self.root, file))
        self._open[file] = obj
        while len(self._open) > self.OPEN_FILES:
            self._open.popitem(last=False)
        return obj

    def _tensor(self, file: str, key: str) -> Tuple[Any, int, int]:
        path, lo, hi = parse_key(key)
        where = os.path.join(self.root, file)
        t = field(self.obj(file), path, where)
        if not is_tensor(t):
            raise CheckpointError(f"DeepSpeed checkpoint file {where}: field {'/'.join(map(str, path))!r} is not a "
                                  f"tensor")
        if not 0 <= lo <= hi <= t.numel():
            raise CheckpointError(f"DeepSpeed checkpoint file {where}: field {'/'.join(map(str, path))!r} has "
                                  f"{t.numel()} elements, elements [{lo}, {hi}) were expected")
        return t, lo, hi

    def read(self, file: str, key: str, crc: Optional[int] = None, out: Optional[torch.Tensor] = None) -> torch.Tensor:
        t, lo, hi = self._tensor(file, key)
        whole = lo == 0 and hi == t.numel()
        if isinstance(t, TensorRef):
            got = t.read(lo, hi, out=None if out is None else out.view(-1))
            return out if out is not None else (got.view(t.shape) if whole else got)
        part = t.reshape(-1)[lo:hi]
        if out is None and whole:
            return t.clone()  # whole: its own shape (Adam's 0-dim step)
        if out is not None:
            out.view(-1).copy_(part)
            return out
        return part.clone()

    def check(self, file: str, key: str, crc: Optional[int] = None) -> None:
        self._tensor(file, key)

    def dtype_of(self, file: str, key: str) -> torch.dtype:
        return self._tensor(file, key)[0].dtype

    def close(self) -> None:
        self._open.clear()


def plain(obj: Any) -> Any:
    """``obj`` with :class:`Stand` objects replaced by their attribute dicts (for JSON and for logs)."""
    if isinstance(obj, Stand):
        return {k: plain(v) for k, v in obj.__dict__.items() if k not in ("args", "kwargs")}
    if isinstance(obj, dict):
        return {k: plain(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(plain(v) for v in obj)
    return obj


def scaler_state(obj: Any) -> Optional[Dict[str, Any]]:
    """DeepSpeed's dynamic loss scaler (a pickled ``DynamicLossScaler``, or the fields FP16_Optimizer keeps)
    as our dynamic scaler's ``state_dict``; None when there is none or it is static (a static scale comes
    from the config)."""
    d = plain(obj)
    if not isinstance(d, dict) or "cur_scale" not in d or not d.get("dynamic", "scale_window" in d):
        return None
    return {"dynamic": True, "scale": float(d["cur_scale"]), "cur_iter": int(d.get("cur_iter") or 0),
            "last_overflow_iter": int(d.get("last_overflow_iter", -1)),
            "cur_hysteresis": int(d.get("cur_hysteresis") or d.get("delayed_shift") or 1)}
