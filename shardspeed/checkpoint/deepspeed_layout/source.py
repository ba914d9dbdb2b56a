"""A DeepSpeed checkpoint presented as ours: the tensor table, the per-parameter entries and the common
state the loader consumes (:class:`DeepSpeedSource`), with a reader over DeepSpeed's ``.pt`` files.

Entries point into DeepSpeed's flat partitions (:mod:`.layout`), so the loader's own resharding reads the
ranges each rank owns now, at any world size and stage, one saved slice at a time.
"""
from __future__ import annotations

import glob
import os
import re
from dataclasses import dataclass
from typing import Any, Dict, List, Sequence, Tuple

from ...errors import CheckpointError
from ..metadata import WEIGHT, CheckpointMetadata, Entry, TensorInfo
from .layout import Span
from .lazy_pt import TensorRef
from .pickles import PtReader, field, is_tensor, key_of, materialize, plain, scaler_state

#: the DeepSpeed releases whose layouts this reader knows (0.10 to 0.x); others are refused
OLDEST, NEWEST_MAJOR = (0, 10), 0
MODEL_FILE = "mp_rank_00_model_states.pt"
Z3_MODEL = "zero_pp_rank_{}_mp_rank_00_model_states.pt"
_OPTIM = re.compile(r"^(bf16_)?zero_pp_rank_(\d+)_mp_rank_00_optim_states\.pt$")
#: what DeepSpeed writes into the model-states file besides the client's own keys
DS_KEYS = frozenset({"module", "buffer_names", "optimizer", "param_shapes", "frozen_param_shapes", "shared_params",
           "frozen_param_fragments", "lr_scheduler", "data_sampler", "random_ltd", "sparse_tensor_module_names",
           "skipped_steps", "global_steps", "global_samples", "dp_world_size", "mp_world_size", "ds_config",
           "ds_version", "checkpoint_parallel_dimensions", "universal_checkpoint_info", "autoep_layers",
           "param_alignment_paddings", "num_experts", "ds_autoep_layers"})
ADAM_STATES = ("exp_avg", "exp_avg_sq")
#: a torch optimizer group's keys that choose its implementation, not the math: each side keeps its own
IMPL_KEYS = ("params", "param_names", "fused", "foreach", "capturable", "differentiable")


@dataclass
class DeepSpeedSource:
    """What the loader needs, as its own checkpoint would give it."""

    path: str
    meta: CheckpointMetadata
    reader: PtReader
    common: Dict[str, Any]
    kind: str  # "zero0", "zero12", "zero3" or "universal"


def is_deepspeed_dir(path: str) -> bool:
    """Whether ``path`` (a tag directory) holds a DeepSpeed checkpoint (or its universal layout)."""
    return os.path.isfile(os.path.join(path, MODEL_FILE)) or os.path.isfile(os.path.join(path, Z3_MODEL.format(0)))


def check_version(ms: Dict[str, Any], file: str) -> None:
    v = ms.get("ds_version")
    m = re.match(r"^(\d+)\.(\d+)", str(v)) if v is not None else None
    if m is None or (int(m[1]), int(m[2])) < OLDEST or int(m[1]) > NEWEST_MAJOR:
        raise CheckpointError(f"DeepSpeed checkpoint file {file}: field 'ds_version' is {v!r}; this shardspeed "
                              f"reads the layouts of DeepSpeed {OLDEST[0]}.{OLDEST[1]} to {NEWEST_MAJOR}.x")


def optim_files(path: str) -> Dict[int, str]:
    out: Dict[int, str] = {}
    for p in glob.glob(os.path.join(glob.escape(path), "*zero_pp_rank_*_mp_rank_*_optim_states.pt")):
        m = _OPTIM.match(os.path.basename(p))
        if m is None:
            raise CheckpointError(f"DeepSpeed checkpoint file {p}: tensor or pipeline parallel checkpoints "
                                  f"(mp_rank other than 00) are not read by this shardspeed")
        out[int(m[2])] = os.path.basename(p)
    return out


def refuse_model_parallel(path: str) -> None:
    for pattern in ("mp_rank_0[1-9]*_model_states.pt", "layer_*-model_*states.pt", "expert_*_model_states.pt"):
        hits = glob.glob(os.path.join(glob.escape(path), pattern))
        if hits:
            raise CheckpointError(f"DeepSpeed checkpoint file {hits[0]}: tensor-parallel, pipeline or old-style expert "
                                  f"checkpoints are not read by this shardspeed (data parallel ZeRO 0-3, and MoE "
                                  f"layers at ZeRO 1-2 saved per layer)")


def _shape(s: Any, file: str, name: str) -> List[int]:
    try:
        return [int(d) for d in s]
    except (TypeError, ValueError):
        raise CheckpointError(f"DeepSpeed checkpoint file {file}: field 'param_shapes' gives {name!r} the shape "
                              f"{s!r}") from None


def param_shapes(ms: Dict[str, Any], file: str) -> List[List[Tuple[str, List[int]]]]:
    """``param_shapes``: per flat group, (name, shape) in flat order."""
    groups = ms.get("param_shapes")
    if not isinstance(groups, list) or not all(isinstance(g, dict) for g in groups):
        raise CheckpointError(f"DeepSpeed checkpoint file {file}: field 'param_shapes' is {type(groups).__name__}, "
                              f"a list of name -> shape per parameter group was expected")
    return [[(n, _shape(s, file, n)) for n, s in g.items()] for g in groups]


def numel(shape: Sequence[int]) -> int:
    n = 1
    for d in shape:
        n *= int(d)
    return n


def module_tensors(ms: Dict[str, Any], file: str, skip: set) -> Tuple[Dict[str, TensorInfo], List[Entry]]:
    """Buffers and (unless in ``skip``) parameters held whole in the model-states ``module`` dict."""
    module = field(ms, ("module",), file)
    buffers = set(ms.get("buffer_names") or [])
    tensors: Dict[str, TensorInfo] = {}
    entries: List[Entry] = []
    for name, t in module.items():
        if name in skip or not is_tensor(t) or (t.numel() == 0 and name not in buffers):
            continue
        kind = "buffer" if name in buffers else "frozen"
        tensors[name] = TensorInfo(list(t.shape), str(t.dtype).replace("torch.", ""), kind)
        entries.append(Entry(name, WEIGHT, 0, t.numel(), os.path.basename(file), key_of(("module", name), 0, t.numel())))
    return tensors, entries


def aliases(ms: Dict[str, Any]) -> Dict[str, str]:
    """Tied parameters: alias -> the name saved (``shared_params``; at stage 0, tensors sharing storage)."""
    shared = ms.get("shared_params")
    if isinstance(shared, dict) and shared:
        return {str(a): str(b) for a, b in shared.items()}
    out: Dict[str, str] = {}
    seen: Dict[Tuple[Any, Tuple[int, ...]], str] = {}
    for name, t in (ms.get("module") or {}).items():
        if is_tensor(t) and t.numel():
            k = ((t.path, t.offset) if isinstance(t, TensorRef) else (t.untyped_storage().data_ptr(),
                                                                     int(t.storage_offset())), tuple(t.shape))
            if k in seen:
                out[name] = seen[k]
            else:
                seen[k] = name
    return out


def span_entries(spans: List[Span], files: Dict[int, str], base: Tuple[Any, ...], state: str = WEIGHT,
                 slot_path=None) -> List[Entry]:
    """One entry per span: ``base + (slot,)`` (or ``slot_path(slot)``) in rank ``span.rank``'s file."""
    out = []
    for s in spans:
        path = slot_path(s.slot) if slot_path is not None else base + (s.slot,)
        out.append(Entry(s.name, state, s.start, s.end, files[s.rank],
                         key_of(path, s.offset, s.offset + s.end - s.start)))
    return out


def step_entries(names: Sequence[Tuple[str, int]], file: str, path: Tuple[Any, ...]) -> List[Entry]:
    """Adam's step (one count, valid for every element) for each of ``names``, from one 0-dim tensor."""
    return [Entry(n, "step", 0, size, file, key_of(path, 0, 1), elementwise=False) for n, size in names]


def hyper(group: Dict[str, Any]) -> Dict[str, Any]:
    return {k: plain(v) for k, v in group.items() if k not in IMPL_KEYS}


def common_state(ms: Dict[str, Any], scaler: Any) -> Dict[str, Any]:
    """Our ``common.pt`` content from DeepSpeed's model states: schedule, scaler, counters, client state."""
    steps = int(ms.get("global_steps") or 0)
    gas = int((ms.get("ds_config") or {}).get("gradient_accumulation_steps") or 1)
    counters = {"global_steps": steps, "global_samples": int(ms.get("global_samples") or 0),
                "skipped_steps": int(ms.get("skipped_steps") or 0), "micro_steps": steps * gas}
    return {"lr_scheduler": materialize(ms.get("lr_scheduler")), "loss_scaler": scaler_state(scaler),
            "counters": counters, "dataloader": {"global_samples": counters["global_samples"]},
            "client_state": materialize({k: v for k, v in ms.items() if k not in DS_KEYS})}


def metadata(tag: str, world: int, stage: int, dtype: str, tensors: Dict[str, TensorInfo], alias: Dict[str, str],
             entries: List[Entry], groups: Dict[str, Any]) -> CheckpointMetadata:
    meta = CheckpointMetadata(tag=tag, world_size=world, zero_stage=stage, train_dtype=dtype, tensors=tensors,
                              aliases=alias, entries=entries, files={},
                              optimizer={"class": None, "param_groups": groups}, format="deepspeed")
    meta.locate_entries()
    return meta


def train_dtype(ms: Dict[str, Any]) -> str:
    cfg = ms.get("ds_config") or {}
    for key, name in (("bf16", "bfloat16"), ("bfloat16", "bfloat16"), ("fp16", "float16")):
        if isinstance(cfg.get(key), dict) and cfg[key].get("enabled"):
            return name
    return "float32"


def check_covered(meta: CheckpointMetadata, where: str) -> None:
    """Every trainable tensor's weights are covered exactly once by its entries (a layout misread shows here)."""
    cover: Dict[str, int] = {}
    for e in meta.entries:
        if e.state == WEIGHT:
            cover[e.tensor] = cover.get(e.tensor, 0) + e.end - e.start
    for name, info in meta.tensors.items():
        if cover.get(name, 0) != info.numel:
            raise CheckpointError(f"DeepSpeed checkpoint {where}: {name!r} has {info.numel} elements but its saved "
                                  f"pieces hold {cover.get(name, 0)}; the layout does not match 'param_shapes'")
