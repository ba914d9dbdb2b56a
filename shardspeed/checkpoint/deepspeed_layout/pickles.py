"""DeepSpeed's ``.pt`` files, opened without DeepSpeed and read one tensor slice at a time.

DeepSpeed pickles a few of its own objects into its checkpoints (``ZeroStageEnum``, ``fragment_address``,
``LossScaler``). :func:`load_pt` opens a file through an unpickler that turns every ``deepspeed.*`` class
into a :class:`Stand` (which keeps the constructor arguments and the attribute state), so no DeepSpeed
code runs and DeepSpeed need not be installed.

Files in ``torch.save``'s zip format are opened lazily (:mod:`.lazy_pt`): tensors are
:class:`~.lazy_pt.TensorRef` and only the slices asked for are read; other files go through
``torch.load`` (memory-mapped where it can). Either way every global a file names goes through
:func:`find_global`: an allowlist of what DeepSpeed's checkpoints hold (torch's tensor machinery,
containers, dtypes, its own classes as stand-ins, pickle's builtin names); anything else is refused
before it is called, unless the caller trusts the checkpoint (``trust_pickles=True``).
"""
from __future__ import annotations

import _compat_pickle
import functools
import os
import pickle
import sys
from collections import OrderedDict
from types import MappingProxyType
from typing import Any, Dict, Optional, Tuple

import torch

from ...errors import CheckpointError
from ..format import ShardReader
from ..unpickle import SAFE_BUILTINS, PickleRefused
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


#: what ``torch.save`` files name besides DeepSpeed's classes: torch's tensor machinery (its rebuild
#: functions, ``Parameter``, ``Size``, ``device``, storages and dtypes are matched by kind below), containers,
#: and ``argparse.Namespace`` (training scripts save their ``args``; it only sets attributes)
_ALLOWED = MappingProxyType({
    "torch._utils": {"_rebuild_tensor", "_rebuild_tensor_v2", "_rebuild_tensor_v3", "_rebuild_parameter",
                     "_rebuild_parameter_with_state", "_rebuild_sparse_tensor", "_rebuild_meta_tensor_no_storage",
                     "_rebuild_device_tensor_from_cpu_tensor", "_rebuild_qtensor", "_rebuild_nested_tensor",
                     "_rebuild_wrapper_subclass"},
    "torch._tensor": {"_rebuild_from_type_v2"},
    "torch.nn.parameter": {"Parameter"},
    "torch.storage": {"UntypedStorage", "TypedStorage"},
    "torch.serialization": {"_get_layout"},
    "torch": {"Tensor", "Size", "device"},
    "collections": {"OrderedDict", "Counter"},
    "_codecs": {"encode"},  # bytes in a protocol-2 pickle
    "argparse": {"Namespace"},
    "builtins": {n.split(".", 1)[1] for n in SAFE_BUILTINS},
})


def _is_torch_kind(module: str, name: str) -> bool:
    """``torch.float32`` and the other dtypes, ``torch.FloatStorage`` and the other (legacy) storages."""
    if module not in ("torch", "torch.cuda"):
        return False
    obj = getattr(torch, name, None) if module == "torch" else None
    return isinstance(obj, torch.dtype) or (name.endswith("Storage") and name[:1].isupper())


def find_global(module: str, name: str, trust_pickles: bool = False) -> Any:
    """A global a DeepSpeed ``.pt`` file names: DeepSpeed's classes as :class:`Stand` stand-ins, pickle's
    Python 2 names mapped as pickle maps them, then the allowlist above; anything else is a
    :class:`~shardspeed.checkpoint.unpickle.PickleRefused` unless ``trust_pickles`` (then as pickle finds it)."""
    if module == "deepspeed" or module.startswith("deepspeed."):
        return _stand_class(module, name)
    if (module, name) in _compat_pickle.NAME_MAPPING:
        module, name = _compat_pickle.NAME_MAPPING[(module, name)]
    module = _compat_pickle.IMPORT_MAPPING.get(module, module)
    if not trust_pickles and name not in _ALLOWED.get(module, ()) and not _is_torch_kind(module, name):
        raise PickleRefused([f"{module}.{name}"])
    try:
        __import__(module)
        obj: Any = sys.modules[module]
        for part in name.split("."):
            obj = getattr(obj, part)
    except (ImportError, AttributeError) as exc:
        raise CheckpointError(f"a DeepSpeed checkpoint pickle names {module}.{name}, which cannot be found "
                              f"({type(exc).__name__}: {exc})") from None
    return obj


def _pickle_module(trust_pickles: bool) -> Any:
    """What ``torch.load(pickle_module=...)`` needs of a pickle module, with :func:`find_global` as the look-up."""

    class Unpickler(pickle.Unpickler):
        def find_class(self, module: str, name: str) -> Any:
            return find_global(module, name, trust_pickles)

    class Module:
        __name__ = "shardspeed_deepspeed_pickle"

        @staticmethod
        def load(f: Any, **kwargs: Any) -> Any:
            return Unpickler(f, **kwargs).load()

    Module.Unpickler = Unpickler  # type: ignore[attr-defined]
    return Module


def is_tensor(x: Any) -> bool:
    return torch.is_tensor(x) or isinstance(x, TensorRef)


def load_pt(path: str, trust_pickles: bool = False) -> Any:
    """The object in ``path``: lazily (:mod:`.lazy_pt`: tensors as :class:`TensorRef`, read slice by slice)
    where the file is ``torch.save``'s zip format, else through ``torch.load`` (memory-mapped if it can).
    Every global the file names goes through :func:`find_global`."""
    if not os.path.isfile(path):
        raise CheckpointError(f"DeepSpeed checkpoint file {path} is missing")
    try:
        return load_lazy(path, functools.partial(find_global, trust_pickles=trust_pickles))
    except LazyUnsupported:
        pass
    except PickleRefused as exc:
        raise exc.at(path) from None
    module = _pickle_module(trust_pickles)
    for mmap in (True, False):
        try:
            return torch.load(path, map_location="cpu", mmap=mmap, weights_only=False, pickle_module=module)
        except PickleRefused as exc:
            raise exc.at(path) from None
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

    def __init__(self, root: str, trust_pickles: bool = False):
        super().__init__(root, verify=False)
        self._open: OrderedDict[str, Any] = OrderedDict()
        self.trust_pickles = trust_pickles

    def obj(self, file: str) -> Any:
        if file in self._open:
            self._open.move_to_end(file)
            return self._open[file]
        obj = load_pt(os.path.join(self.root, file), self.trust_pickles)
        self._open[file] = obj
        while len(self._open) > self.OPEN_FILES:
            self._open.popitem(last=False)
        return obj

    def _tensor(self, file: str, key: str) -> Tuple[Any, int, int]:
        path, lo, hi = parse_key(key)
        where = os.path.join(self.root, file)
        t = field(self.obj(file), path, where)
        if isinstance(t, (int, float)) and not isinstance(t, bool):  # a count DeepSpeed's own Adams keep as a
            t = torch.tensor(float(t), dtype=torch.float32)  # number (FusedAdam's, CPU Adam's ``step``): torch's form
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
