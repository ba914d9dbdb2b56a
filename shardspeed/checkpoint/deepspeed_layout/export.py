"""Ours → DeepSpeed's layout for a given world size and ZeRO stage, as DeepSpeed itself would save it, so
that ``deepspeed``'s ``engine.load_checkpoint`` continues the run at that world size and stage.

Written one file at a time: each rank's optimizer file is assembled from our entries (a partition of the
masters and of each Adam moment), saved and dropped before the next; the model-states file holds the
module's weights in the training dtype (DeepSpeed's format puts them in one pickle). DeepSpeed pickles its
own loss scaler and stage enum into these files and loads them as objects, so writing them needs
``deepspeed`` importable (its classes, none of its code paths). One parameter group (and, with native MoE
layers at ZeRO 1-2, DeepSpeed's expert group and per-expert files: :mod:`.moe_export`), and at ZeRO 0 fp32
only (DeepSpeed's ZeRO-0 bf16/fp16 optimizers keep other layouts).
"""
from __future__ import annotations

import logging
import math
import os
from collections import OrderedDict
from typing import Any, Dict, List, Optional, Tuple

import torch

from ...errors import CheckpointError
from ...plan import tile_elems_of
from ...utils.secrets import mask_secrets
from ..commit import check_tag, read_latest, resolve
from ..format import NAME_TO_DTYPE, ShardReader, write_bytes_atomic
from ..metadata import WEIGHT, CheckpointMetadata
from ..metadata_checks import check_files, check_stored
from ..ranges import EntryIndex, read_range
from ..unpickle import read_common
from .layout import save_pt, zero3_piece
from .moe_export import ExpertPlan, Run, dense_layout, expert_plan, write_expert_files
from .source import IMPL_KEYS, MODEL_FILE, Z3_MODEL

logger = logging.getLogger("shardspeed")


class _Ours:
    """Our checkpoint, opened for reading ranges (checked as the loader checks it)."""

    def __init__(self, load_dir: str, tag: Optional[str], trust_pickles: bool = False):
        tag = tag or read_latest(load_dir)
        if tag is None:
            raise CheckpointError(f"{load_dir} has no 'latest' file; pass the tag to convert")
        self.tag = check_tag(tag)
        self.path = resolve(load_dir, tag)
        self.meta = CheckpointMetadata.read(self.path)
        check_files(self.meta, self.path)
        self.reader = ShardReader(self.path, header_crc32=self.meta.header_crc32())
        self.index = EntryIndex(self.meta.entries, self.meta.shapes)
        check_stored(self.reader, self.meta.entries, self.meta.tensors)  # every entry is read: all checked first
        missing = sorted(set(self.meta.aliases.values()) - set(self.meta.tensors))
        if missing:
            raise CheckpointError(f"{os.path.join(self.path, 'metadata.json')}: tied names point at {missing[:4]}, "
                                  f"which are not saved tensors; the metadata is corrupt or crafted")
        self.common: Dict[str, Any] = read_common(self.path, self.meta, trust_pickles)
        self.trained = registration_order(self.meta)
        groups = (self.meta.optimizer or {}).get("param_groups", {})
        if len(groups) > 1 and not all(g.get("moe") for g in list(groups.values())[1:]):
            raise CheckpointError(f"{os.path.join(self.path, 'metadata.json')}: field 'optimizer.param_groups' has "
                                  f"{len(groups)} groups; export to DeepSpeed's layout handles one (and, with MoE "
                                  f"layers, the expert groups of split_params_into_different_moe_groups_for_optimizer)")
        self.hyper = dict(next(iter(groups.values()), {}))
        self.moe_hyper = dict(list(groups.values())[1]) if len(groups) > 1 else self.hyper
        self.ds_config: Optional[Dict[str, Any]] = None  # the DeepSpeed config the run will load under

    def read(self, name: str, state: str, lo: int, hi: int) -> torch.Tensor:
        return read_range(self.reader, self.index, name, state, lo, hi)

    def has(self, name: str, state: str) -> bool:
        return self.index.has(name, state)

    def step(self) -> Optional[float]:
        e = next((e for e in self.meta.entries if e.state == "step"), None)
        if e is None:
            return None
        return float(self.reader.read(e.file, e.key, e.crc32)) if e.file else float(e.value)

    def whole(self, name: str, dtype: torch.dtype) -> torch.Tensor:
        info = self.meta.tensors[name]
        return read_range(self.reader, self.index, name, WEIGHT, 0, info.numel,
                          dtype=NAME_TO_DTYPE.get(info.dtype, torch.float32)).view(info.shape).to(dtype)


def registration_order(meta: CheckpointMetadata) -> List[Tuple[str, List[int]]]:
    """Trained tensors in the model's registration order, which DeepSpeed flattens in: our tensor table
    lists them as the units hold them, at stages 0-2 in gradient order (the reverse of registration,
    ``runtime/builder.py``), at stage 3 by module."""
    trained = [(n, t.shape) for n, t in meta.tensors.items() if t.kind == "param"]
    return trained[::-1] if meta.zero_stage < 3 else trained


def _ds():
    try:
        import deepspeed
    except ImportError as exc:
        raise CheckpointError(f"writing DeepSpeed's layout needs deepspeed importable (its checkpoints pickle its "
                              f"loss scaler and stage enum): {exc}") from exc
    if "+shardspeed" in deepspeed.__version__:  # shardspeed's own package (shardspeed deepspeed-path) is on the path
        raise CheckpointError("writing DeepSpeed's layout needs the real deepspeed (its checkpoints pickle its own "
                              "classes); run without shardspeed's deepspeed package on PYTHONPATH")
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address
    return deepspeed.__version__, LossScaler, DynamicLossScaler, ZeroStageEnum, fragment_address


def _scaler(ours: _Ours):
    """DeepSpeed's loss scaler object with our saved state; its settings (which DeepSpeed takes from the
    pickled object, not from its config, on load) from ``ours.ds_config``'s ``fp16`` section, else
    DeepSpeed's defaults."""
    _, static, dynamic, _, _ = _ds()
    st = ours.common.get("loss_scaler") or {}
    if not st.get("dynamic"):
        return static(float(st.get("scale", 1.0)))
    fp16 = (ours.ds_config or {}).get("fp16") or {}
    s = object.__new__(dynamic)
    s.__dict__.update(cur_scale=float(st["scale"]), cur_iter=int(st["cur_iter"]),
                      last_overflow_iter=int(st["last_overflow_iter"]), scale_factor=2.0,
                      scale_window=int(fp16.get("loss_scale_window", 1000)),
                      min_scale=float(fp16.get("min_loss_scale", 1)), delayed_shift=int(fp16.get("hysteresis", 2)),
                      cur_hysteresis=int(st["cur_hysteresis"]),
                      consecutive_hysteresis=bool(fp16.get("consecutive_hysteresis", False)),
                      raise_error_at_min_scale=True, dynamic=True, dtype=torch.float16)
    return s


def _hyper_group(ours: _Ours, params: List[int], hyper: Optional[Dict[str, Any]] = None) -> Dict[str, Any]:
    g = {k: (tuple(v) if isinstance(v, list) else v) for k, v in (hyper or ours.hyper).items() if k not in IMPL_KEYS}
    g["params"] = params
    return g


def _model_states(ours: _Ours, world: int, stage: int, dtype: torch.dtype, placeholder: bool,
                  shapes: Any, optimizer: Any = None) -> Dict[str, Any]:
    version = _ds()[0]
    module: Dict[str, torch.Tensor] = OrderedDict()
    buffers = []
    for name, info in ours.meta.tensors.items():
        if info.kind == "buffer":
            buffers.append(name)
            module[name] = ours.whole(name, NAME_TO_DTYPE.get(info.dtype, torch.float32))
        elif placeholder and info.kind == "param":
            module[name] = torch.empty(0, dtype=dtype)
        else:
            module[name] = ours.whole(name, torch.float32 if stage == 0 else dtype)
    for alias, target in ours.meta.aliases.items():
        module[alias] = module[target]
    counters = ours.common.get("counters", {})
    sd: Dict[str, Any] = {
        "module": module, "buffer_names": buffers, "optimizer": optimizer, "param_shapes": shapes,
        "frozen_param_shapes": None if stage < 3 else OrderedDict(),
        "shared_params": None if stage == 0 else dict(ours.meta.aliases),
        "frozen_param_fragments": None if stage < 3 else OrderedDict(),
        "lr_scheduler": ours.common.get("lr_scheduler"), "data_sampler": None, "random_ltd": None,
        "skipped_steps": int(counters.get("skipped_steps", 0)), "global_steps": int(counters.get("global_steps", 0)),
        "global_samples": int(counters.get("global_samples", 0)), "dp_world_size": world, "mp_world_size": 1,
        "checkpoint_parallel_dimensions": {"pp_degree": 1, "tp_degree": 1},
        "ds_config": mask_secrets(ours.ds_config) or {"zero_optimization": {"stage": stage}}, "ds_version": version}
    sd.update(ours.common.get("client_state") or {})
    return sd


def _zero0(ours: _Ours, out: str, world: int) -> None:
    state: Dict[int, Dict[str, Any]] = {}
    step = ours.step()
    for i, (name, shape) in enumerate(ours.trained):
        n = math.prod(shape)
        st: Dict[str, Any] = {}
        if step is not None:
            st["step"] = torch.tensor(step)
        for sk in ("exp_avg", "exp_avg_sq"):
            if ours.has(name, sk):
                st[sk] = ours.read(name, sk, 0, n).view(shape)
        if st:
            state[i] = st
    opt = {"state": state, "param_groups": [_hyper_group(ours, list(range(len(ours.trained))))]}
    save_pt(_model_states(ours, world, 0, torch.float32, False, None, opt), os.path.join(out, MODEL_FILE))


def _flat_range(ours: _Ours, layout: List[Run], state: str, lo: int, hi: int, size: int) -> torch.Tensor:
    """Elements ``[lo, hi)`` of the flat concatenation ``layout`` of ``state``, zero-padded to ``size``."""
    out = torch.zeros(size, dtype=torch.float32)
    for run in layout:
        a, b = max(lo, run.off), min(hi, run.off + run.n)
        if a < b:
            out[a - lo : b - lo] = ours.read(run.src, state, run.src_off + a - run.off, run.src_off + b - run.off)
    return out


def _partition(ours: _Ours, layout: List[Run], ranks: int, j: int, step: Optional[float]):
    """Partition ``j`` of a flat group over ``ranks`` (padded to ``2 × ranks``, as ZeRO 1-2 pads): its fp32
    weights without the tail padding, its Adam state, the padding cut, DeepSpeed's slice mapping."""
    frag = _ds()[4]
    total = sum(run.n for run in layout)
    part = math.ceil(total / (2 * ranks)) * 2
    lo, hi = j * part, min((j + 1) * part, total)
    st: Dict[str, Any] = {} if step is None else {"step": torch.tensor(step)}
    for sk in ("exp_avg", "exp_avg_sq"):
        if all(ours.has(run.src, sk) for run in layout):
            st[sk] = _flat_range(ours, layout, sk, lo, hi, part)
    mapping = OrderedDict((run.name, frag(numel=min(hi, run.off + run.n) - max(lo, run.off), start=max(lo, run.off) - lo))
                          for run in layout if max(lo, run.off) < min(hi, run.off + run.n))
    return _flat_range(ours, layout, WEIGHT, lo, hi, max(hi - lo, 0)), st, part - max(hi - lo, 0), mapping


def _zero12(ours: _Ours, out: str, world: int, stage: int, dtype: torch.dtype, prefix: str,
            plan: Optional[ExpertPlan] = None) -> None:
    """ZeRO 1-2: one flat group over every rank; with MoE layers (``plan``) also DeepSpeed's expert group,
    partitioned over the ranks holding the same experts, and its per-expert model files."""
    version, _, _, enum, _ = _ds()
    dense = dense_layout(ours.trained, plan)
    step = ours.step()
    for r in range(world):
        groups = [(dense, world, r)] if plan is None else [(dense, world, r), (plan.layout(r % plan.ep),
                                                                              world // plan.ep, r // plan.ep)]
        parts = [_partition(ours, layout, ranks, j, step) for layout, ranks, j in groups]
        hypers = [_hyper_group(ours, [0])] + [_hyper_group(ours, [1], ours.moe_hyper) for _ in groups[1:]]
        osd = {"loss_scaler": _scaler(ours), "dynamic_loss_scale": bool((ours.common.get("loss_scaler") or {})
                                                                       .get("dynamic")), "overflow": False,
               "base_optimizer_state": {"state": {g: p[1] for g, p in enumerate(parts) if p[1]},
                                        "param_groups": hypers},
               "single_partition_of_fp32_groups": [p[0] for p in parts], "zero_stage": enum(stage),
               "group_paddings": [p[2] for p in parts], "partition_count": [ranks for _, ranks, _ in groups],
               "param_alignment_paddings": [[0] * len(layout) for layout, _, _ in groups], "ds_version": version,
               "param_slice_mappings": [p[3] for p in parts]}
        save_pt({"optimizer_state_dict": osd, "ds_config": {}, "ds_version": version},
              os.path.join(out, f"{prefix}zero_pp_rank_{r}_mp_rank_00_optim_states.pt"))
        del osd, parts
    layouts = [dense] + ([plan.layout(0)] if plan is not None else [])
    shapes = [OrderedDict((run.name, torch.Size(run.shape)) for run in layout) for layout in layouts]
    ms = _model_states(ours, world, stage, dtype, False, shapes)
    if plan is not None:
        write_expert_files(ours, out, plan, ms, dtype)
    save_pt(ms, os.path.join(out, MODEL_FILE))


def _sub_groups(ours: _Ours, world: int, sub_group_size: int) -> List[List[Tuple[str, Any]]]:
    """DeepSpeed's stage-3 sub-groups: parameters in order until their pieces reach ``sub_group_size``."""
    pieces = [zero3_piece(math.prod(s), world) for _, s in ours.trained]
    if sub_group_size >= sum(pieces):
        return [list(ours.trained)]
    groups: List[List[Tuple[str, Any]]] = [[]]
    size = 0
    for p, k in zip(ours.trained, pieces):
        groups[-1].append(p)
        size += k
        if size >= sub_group_size and p is not ours.trained[-1]:
            groups.append([])
            size = 0
    return groups


def _zero3(ours: _Ours, out: str, world: int, dtype: torch.dtype, prefix: str, sub_group_size: int) -> None:
    version, _, _, enum, _ = _ds()
    groups = _sub_groups(ours, world, sub_group_size)
    step = ours.step()
    shapes = [OrderedDict((n, torch.Size(s)) for n, s in g) for g in groups]
    for r in range(world):
        flats: Dict[str, List[torch.Tensor]] = {WEIGHT: [], "exp_avg": [], "exp_avg_sq": []}
        for g in groups:
            for state, dst in flats.items():
                if state and not all(ours.has(name, state) for name, _ in g):
                    continue
                pieces = []
                for name, shape in g:
                    n = math.prod(shape)
                    k = zero3_piece(n, world)
                    piece = torch.zeros(k, dtype=torch.float32)
                    lo, hi = r * k, min((r + 1) * k, n)
                    if lo < hi:
                        piece[: hi - lo] = ours.read(name, state, lo, hi)
                    pieces.append(piece)
                dst.append(torch.cat(pieces) if pieces else torch.zeros(0))
        opt_state = {}
        for i in range(len(groups)):
            st: Dict[str, Any] = {} if step is None else {"step": torch.tensor(step)}
            for sk in ("exp_avg", "exp_avg_sq"):
                if len(flats[sk]) == len(groups):
                    st[sk] = flats[sk][i]
            opt_state[i] = st
        osd = {"zero_stage": enum(3), "loss_scaler": _scaler(ours),
               "dynamic_loss_scale": bool((ours.common.get("loss_scaler") or {}).get("dynamic")), "overflow": False,
               "partition_count": world,
               "optimizer_state_dict": {"state": opt_state, "param_groups": [_hyper_group(ours, [i])
                                                                         for i in range(len(groups))]},
               "fp32_flat_groups": flats[WEIGHT]}
        save_pt({"optimizer_state_dict": osd, "ds_config": {}, "ds_version": version},
                   os.path.join(out, f"{prefix}zero_pp_rank_{r}_mp_rank_00_optim_states.pt"))
        save_pt(_model_states(ours, world, 3, dtype, True, shapes), os.path.join(out, Z3_MODEL.format(r)))


def export_deepspeed(load_dir: str, save_dir: str, world: int, stage: int, tag: Optional[str] = None,
                     out_tag: Optional[str] = None, dtype: Optional[str] = None,
                     sub_group_size: Optional[int] = None, ds_config: Optional[Dict[str, Any]] = None,
                     ep_size: Optional[int] = None, trust_pickles: bool = False) -> str:
    """Write our checkpoint ``load_dir/tag`` as DeepSpeed's ZeRO-``stage`` checkpoint of ``world`` data-parallel
    ranks under ``save_dir/out_tag`` (default: the same tag), then ``save_dir/latest``. ``dtype``: the
    training dtype DeepSpeed will run in (default: the one saved). ``ds_config``: the DeepSpeed config it
    will run with (its ``fp16`` loss-scale settings and ZeRO-3 ``sub_group_size`` shape the files; default:
    DeepSpeed's defaults). ``ep_size``: the expert-parallel size of the MoE layers DeepSpeed will run (default:
    the one saved; MoE layers export at ZeRO 1-2). Returns the tag directory."""
    if stage not in (0, 1, 2, 3) or world < 1:
        raise CheckpointError(f"export to DeepSpeed: stage must be 0-3 and world at least 1 (got {stage}, {world})")
    if out_tag is not None:
        check_tag(out_tag)  # before anything is read or written
    ours = _Ours(load_dir, tag, trust_pickles)
    ours.ds_config = ds_config
    if sub_group_size is None:
        sub_group_size = tile_elems_of(ds_config)
    name = dtype or ours.meta.train_dtype
    tdtype = NAME_TO_DTYPE.get({"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}.get(name, name))
    if tdtype is None:
        raise CheckpointError(f"export to DeepSpeed: dtype must be fp32, bf16 or fp16 (got {name!r})")
    if stage == 0 and tdtype != torch.float32:
        raise CheckpointError("export to DeepSpeed at ZeRO 0 is for fp32 runs (DeepSpeed's ZeRO-0 bf16/fp16 "
                              "optimizers keep other layouts): pick stage 1-3")
    plan = expert_plan(ours.meta, ours.trained, world, ep_size)
    if plan is not None and stage not in (1, 2):
        raise CheckpointError(f"export to DeepSpeed: a model with MoE layers exports at ZeRO stage 1 or 2 (DeepSpeed's "
                              f"native MoE runs at 0-2, and its ZeRO-0 MoE files are not written here); got {stage}")
    out_tag = ours.tag if out_tag is None else out_tag  # the tag, not its directory (maybe a moved-aside copy)
    out = os.path.join(save_dir, out_tag)
    os.makedirs(out, exist_ok=True)
    if os.path.islink(out):
        raise CheckpointError(f"export to DeepSpeed: {out} is a symbolic link; remove it or choose another "
                              f"out_tag (the checkpoint is written only into a real folder)")
    prefix = "bf16_" if tdtype == torch.bfloat16 else ""
    if stage == 0:
        _zero0(ours, out, world)
    elif stage < 3:
        _zero12(ours, out, world, stage, tdtype, prefix, plan)
    else:
        _zero3(ours, out, world, tdtype, prefix, sub_group_size)
    write_bytes_atomic(os.path.join(save_dir, "latest"), out_tag.encode())
    ours.reader.close()
    logger.info("wrote DeepSpeed ZeRO-%d checkpoint for %d ranks at %s", stage, world, out)
    return out
