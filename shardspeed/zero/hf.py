"""transformers' ``from_pretrained`` inside ``zero.Init``: straight into shards, never a whole model per rank.

transformers' own ZeRO-3 path imports ``deepspeed`` (``deepspeed.zero.Init``, ``GatheredParameters``) and its
default path builds on the meta device, which cannot be sharded. Inside ``shardspeed.zero.Init``,
``PreTrainedModel.from_pretrained`` is routed here instead: the model is built from its config under the
active ``zero.Init`` with transformers' weight initialisation switched off (as transformers does for
DeepSpeed, so no random numbers are drawn, like a normal ``from_pretrained``), then each rank reads only its
own flat slice of every parameter from the safetensors file(s) (one byte range per tensor, read with plain
``read``, no memory map), buffers whole. Parameters missing from the checkpoint are initialised as transformers
does (``initialize_weights`` skips the loaded ones), then weights are tied and the model is put in eval mode.
"""
from __future__ import annotations

import json
import logging
import os
from types import MappingProxyType
from typing import Any, Dict, List, Optional, Tuple

import torch
import torch.nn as nn

from ..errors import CheckpointError
from .tags import init_shard_of

logger = logging.getLogger(__name__)

SAFE_WEIGHTS_NAME = "model.safetensors"
SAFE_WEIGHTS_INDEX_NAME = "model.safetensors.index.json"

_HUB_KWARGS = ("cache_dir", "force_download", "proxies", "local_files_only", "token", "revision", "subfolder")
#: from_pretrained arguments that need transformers' own loader (device maps, quantisation, other formats)
_UNSUPPORTED = ("device_map", "quantization_config", "load_in_8bit", "load_in_4bit", "gguf_file", "from_tf",
                "from_flax", "tp_plan", "state_dict", "use_safetensors")


def _checkpoint_files(path: str, hub: Dict[str, Any]) -> List[str]:
    sub = hub.get("subfolder") or ""
    if os.path.isdir(path):
        root = os.path.join(path, sub)
        index: Optional[str] = os.path.join(root, SAFE_WEIGHTS_INDEX_NAME)
        assert index is not None
        if os.path.isfile(index):
            with open(index) as f:
                names = sorted(set(json.load(f)["weight_map"].values()))
            return [os.path.join(root, n) for n in names]
        single = os.path.join(root, SAFE_WEIGHTS_NAME)
        if os.path.isfile(single):
            return [single]
        raise CheckpointError(f"from_pretrained under shardspeed.zero.Init reads safetensors checkpoints: no "
                              f"{SAFE_WEIGHTS_NAME} or {SAFE_WEIGHTS_INDEX_NAME} in {root}")
    from transformers.utils.hub import cached_file, get_checkpoint_shard_files

    cached: Optional[str] = cached_file(path, SAFE_WEIGHTS_NAME, _raise_exceptions_for_missing_entries=False, **hub)
    if cached is not None:
        return [cached]
    index = cached_file(path, SAFE_WEIGHTS_INDEX_NAME, _raise_exceptions_for_missing_entries=False, **hub)
    if index is None:
        raise CheckpointError(f"from_pretrained under shardspeed.zero.Init reads safetensors checkpoints: none "
                              f"found for {path!r}")
    files, _ = get_checkpoint_shard_files(path, index, **{k: v for k, v in hub.items() if k != "proxies"})
    return list(files)


_ST_DTYPES = MappingProxyType({"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
              "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
              "BOOL": torch.bool})


class _SafetensorsFile:
    """Reads byte ranges of one safetensors file with plain ``read``: no memory map, so a rank holds only
    the elements it asked for (tensors are stored whole and row-major: a flat range is one byte range)."""

    def __init__(self, path: str):
        self.path = path
        with open(path, "rb") as f:
            n = int.from_bytes(f.read(8), "little")
            header = json.loads(f.read(n))
        self.base = 8 + n
        header.pop("__metadata__", None)
        self.entries = header

    def keys(self):
        return self.entries.keys()

    def dtype(self, key: str) -> Optional[torch.dtype]:
        return _ST_DTYPES.get(self.entries[key]["dtype"])

    def read(self, key: str, lo: int = 0, hi: Optional[int] = None) -> torch.Tensor:
        """Flat elements [lo, hi) of tensor ``key`` (all of them by default)."""
        e = self.entries[key]
        dtype = _ST_DTYPES[e["dtype"]]
        size = torch.empty((), dtype=dtype).element_size()
        start, end = e["data_offsets"]
        numel = (end - start) // size
        hi = numel if hi is None else hi
        out = torch.empty(max(0, hi - lo), dtype=dtype)
        if hi > lo:
            with open(self.path, "rb") as f:
                f.seek(self.base + start + lo * size)
                f.readinto(out.view(torch.uint8).numpy().data)
        return out


def _resolve_dtype(dtype, config, files: List[str]) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype is None or dtype == "auto":
        cdt = getattr(config, "dtype", None)
        if cdt is not None:
            return getattr(torch, cdt) if isinstance(cdt, str) else cdt
        if dtype is None:
            return torch.get_default_dtype()
        f = _SafetensorsFile(files[0])
        for k in f.keys():
            dt = f.dtype(k)
            if dt is not None and dt.is_floating_point:
                return dt
        return torch.get_default_dtype()
    if isinstance(dtype, str):
        return getattr(torch, dtype)
    raise CheckpointError(f"from_pretrained under shardspeed.zero.Init: unsupported dtype {dtype!r}")


def _candidates(name: str, prefix: str) -> List[str]:
    out = [name]
    if prefix:
        if name.startswith(prefix + "."):
            out.append(name[len(prefix) + 1 :])
        else:
            out.append(f"{prefix}.{name}")
    return out


def sharded_from_pretrained(cls, pretrained_model_name_or_path, *model_args, **kwargs):
    """``cls.from_pretrained(...)`` for the active ``zero.Init``: every rank holds only its shards."""
    from transformers.initialization import no_init_weights

    path = str(pretrained_model_name_or_path)
    hub, output_loading_info, dtype, attn = _pop_loading_kwargs(kwargs)
    config = kwargs.pop("config", None)
    if config is None:
        config, kwargs = cls.config_class.from_pretrained(path, return_unused_kwargs=True, **hub, **kwargs)
    elif kwargs:
        for k in list(kwargs):
            if hasattr(config, k):
                setattr(config, k, kwargs.pop(k))
    files = _checkpoint_files(path, hub)
    torch_dt = _resolve_dtype(dtype, config, files)
    build_kwargs: Dict[str, Any] = {"dtype": torch_dt}
    if attn is not None:
        build_kwargs["attn_implementation"] = attn
    with no_init_weights():  # loaded below; nothing random is drawn, as in a normal from_pretrained
        model = cls._from_config(config, *model_args, **build_kwargs, **kwargs)

    model.tie_weights()  # tied parameters are one parameter, loaded once (checkpoints keep one name)
    missing = _load_shards(model, getattr(cls, "base_model_prefix", "") or "", files)
    if missing:
        logger.warning("from_pretrained under zero.Init: %d parameter(s) not in the checkpoint, newly "
                       "initialised: %s", len(missing), ", ".join(missing[:8]))
        model.initialize_weights()  # under zero.Init: the missing ones are written through their placeholders
    model.tie_weights()
    model.eval()
    if output_loading_info:
        unexpected: List[str] = []
        return model, {"missing_keys": missing, "unexpected_keys": unexpected, "mismatched_keys": [],
                       "error_msgs": []}
    return model


def _pop_loading_kwargs(kwargs: Dict[str, Any]) -> Tuple[Dict[str, Any], bool, Any, Optional[str]]:
    """Take from_pretrained's loading arguments out of ``kwargs`` (what is left configures the model):
    (the hub arguments, output_loading_info, the dtype asked for, attn_implementation). Raises for the
    arguments that need transformers' own loader; drops those with no effect here."""
    bad = [k for k in _UNSUPPORTED if kwargs.get(k) not in (None, False)]
    if bad:
        raise CheckpointError(f"from_pretrained under shardspeed.zero.Init does not support {', '.join(bad)}; "
                              "build the model under zero.Init and load the weights yourself, or load without it")
    for k in _UNSUPPORTED:
        kwargs.pop(k, None)
    hub = {k: kwargs.pop(k) for k in _HUB_KWARGS if k in kwargs}
    output_loading_info = kwargs.pop("output_loading_info", False)
    dtype = kwargs.pop("dtype", None)
    torch_dtype = kwargs.pop("torch_dtype", None)
    dtype = dtype if dtype is not None else (torch_dtype if torch_dtype is not None else "auto")
    for k in ("trust_remote_code", "low_cpu_mem_usage", "_fast_init", "mirror", "offload_state_dict",
              "weights_only", "key_mapping", "_from_auto", "_from_pipeline", "adapter_kwargs", "variant"):
        kwargs.pop(k, None)
    attn = kwargs.pop("attn_implementation", None)
    return hub, output_loading_info, dtype, attn


def _load_shards(model: nn.Module, prefix: str, files: List[str]) -> List[str]:
    """Read each parameter's own shard (a whole parameter where it is not sharded) and every buffer from the
    safetensors ``files``; the names of the parameters the checkpoint lacks."""
    handles = [_SafetensorsFile(f) for f in files]
    where: Dict[str, _SafetensorsFile] = {}
    for h in handles:
        for k in h.keys():
            where[k] = h
    used, missing = set(), []
    names_of: Dict[int, List[Tuple[str, nn.Parameter]]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        names_of.setdefault(id(p), []).append((name, p))
    for group in names_of.values():
        p = group[0][1]
        key = next((c for n, _ in group for c in _candidates(n, prefix) if c in where), None)
        if key is None:
            missing.append(group[0][0])
            continue
        used.add(key)
        info = init_shard_of(p)
        with torch.no_grad():
            if info is not None:
                lo, hi = info.range
                info.shard.zero_()
                if hi > lo:
                    info.shard[: hi - lo].copy_(where[key].read(key, lo, hi))
            else:  # not sharded (e.g. created outside the context)
                p.data.copy_(where[key].read(key).view(p.shape))
        p._is_hf_initialized = True  # type: ignore[attr-defined]  # transformers' init skips it
    for name, b in model.named_buffers():
        key = next((c for c in _candidates(name, prefix) if c in where), None)
        if key is not None:
            used.add(key)
            with torch.no_grad():
                b.copy_(where[key].read(key).view(b.shape))
    return missing
