"""DeepSpeed's ZeRO 0, 1-2 and 3 checkpoints as a :class:`~.source.DeepSpeedSource`.

Each reader opens the model-states file and every rank's optimizer file (memory-mapped: only their small
pickled structure is read here), checks the fields it will use, and builds the entries; no tensor data is
read until the loader asks for a range. Any field that is missing or does not add up is a
:class:`CheckpointError` naming the file and the field, raised before anything is applied.
"""
from __future__ import annotations

import os
from typing import Any, Dict, List, Optional, Sequence, Tuple

from ...errors import CheckpointError
from ..metadata import WEIGHT, Entry, TensorInfo
from .layout import zero3_frozen_spans, zero3_spans, zero12_spans
from .moe import is_moe_checkpoint, moe_spans, refuse_unsupported
from .pickles import PtReader, field, is_tensor, key_of, stage_of
from .source import (
    ADAM_STATES,
    MODEL_FILE,
    Z3_MODEL,
    DeepSpeedSource,
    aliases,
    check_covered,
    check_version,
    common_state,
    hyper,
    metadata,
    module_tensors,
    numel,
    optim_files,
    param_shapes,
    span_entries,
    step_entries,
    train_dtype,
)

OSD = "optimizer_state_dict"


def _rank_files(path: str, world: int, first: str) -> Dict[int, str]:
    files = optim_files(path)
    missing = [r for r in range(world) if r not in files]
    if missing:
        name = first.replace("rank_0_", f"rank_{missing[0]}_")
        raise CheckpointError(f"DeepSpeed checkpoint file {os.path.join(path, name)} is missing: field "
                              f"'partition_count' of {first} says {world} ranks saved")
    return files


def _counts(osd: Dict[str, Any], file: str) -> List[int]:
    count = field(osd, ("partition_count",), file)
    return [int(c) for c in (count if isinstance(count, (list, tuple)) else [count])]


def _world(osd: Dict[str, Any], file: str, moe: bool = False) -> int:
    """The data ranks that saved: every group's ``partition_count``; with MoE layers the largest (expert
    groups are partitioned over the fewer ranks that hold the same experts)."""
    counts = _counts(osd, file)
    if len(set(counts)) != 1 and not moe:
        raise CheckpointError(f"DeepSpeed checkpoint file {file}: field 'partition_count' is {counts}; groups "
                              f"partitioned over different ranks are read only from models with MoE layers")
    return max(counts)


def _zero0_names(ms: Dict[str, Any], groups: List[Dict[str, Any]], trainable: Optional[Sequence[Sequence[str]]],
                 file: str) -> List[str]:
    """The parameter name of each optimizer position (``param_groups`` order). ZeRO 0 saves no names: the
    position is the one in the groups the user passed. ``trainable[g]``: the names of group ``g`` in the
    model's registration order (from the engine); None: every module parameter, groups in module order."""
    module = field(ms, ("module",), file)
    buffers = set(ms.get("buffer_names") or [])
    alias = aliases(ms)
    names = [n for n, t in module.items() if n not in buffers and n not in alias and is_tensor(t)]
    sizes = [len(g["params"]) for g in groups]
    if trainable is not None and [len(t) for t in trainable] == sizes:
        names = [n for t in trainable for n in t]
    elif trainable is not None:
        names = []  # fails below, naming the counts
    if len(names) != sum(sizes):
        raise CheckpointError(f"DeepSpeed checkpoint file {file}: field 'optimizer/param_groups' holds parameter "
                              f"groups of {sizes} parameters but the model's have "
                              f"{[len(t) for t in trainable] if trainable is not None else [len(names)]}; load it "
                              f"into the model (and parameter groups) it was trained with")
    state = (ms["optimizer"] if "state" in ms["optimizer"] else ms["optimizer"][OSD]).get("state", {})
    order = [int(i) for g in groups for i in g["params"]]
    for idx, name in zip(order, names):
        if name not in module:
            raise CheckpointError(f"DeepSpeed checkpoint file {file}: field 'module' has no {name!r}")
        got = state.get(idx, {}).get("exp_avg")
        if is_tensor(got) and tuple(got.shape) != tuple(module[name].shape):
            raise CheckpointError(f"DeepSpeed checkpoint file {file}: field 'optimizer/state/{idx}/exp_avg' has shape "
                                  f"{list(got.shape)}, the parameter it belongs to ({name!r}) {list(module[name].shape)}")
    return names


def read_zero0(path: str, tag: str, ms: Dict[str, Any], reader: PtReader,
               trainable: Optional[Sequence[Sequence[str]]]) -> DeepSpeedSource:
    """ZeRO 0: the module holds the weights (fp32) or ``optimizer.fp32_groups[_flat]`` the masters; the
    torch optimizer's per-parameter state is keyed by its position in ``param_groups``."""
    file = os.path.join(path, MODEL_FILE)
    opt = ms.get("optimizer")
    alias = aliases(ms)
    if not isinstance(opt, dict):
        raise CheckpointError(f"DeepSpeed checkpoint file {file}: field 'optimizer' is {type(opt).__name__}; a "
                              f"ZeRO-0 checkpoint saved without its optimizer cannot continue the run")
    base = opt if "state" in opt else field(opt, (OSD,), file)
    base_path: Tuple[Any, ...] = ("optimizer",) if base is opt else ("optimizer", OSD)
    groups = field(base, ("param_groups",), file)
    order = [int(i) for g in groups for i in g["params"]]
    module = field(ms, ("module",), file)
    names = _zero0_names(ms, groups, trainable, file)
    tensors, entries = module_tensors(ms, file, skip=set(alias))
    mf = os.path.basename(file)
    flat_at: Dict[int, Tuple[int, int]] = {}  # fp32_groups_flat: position -> (group, offset in its flat)
    for gi, g in enumerate(groups):
        off = 0
        for i in g["params"]:
            flat_at[int(i)] = (gi, off)
            off += numel(module[names[order.index(int(i))]].shape)
    entries = [e for e in entries if e.tensor not in names]  # trainable weights: from the masters below
    fused_step = _fused_steps(base.get("state", {}), groups)
    for idx, name in zip(order, names):
        shape = list(module[name].shape)
        n = numel(shape)
        tensors[name] = TensorInfo(shape, "float32", "param")
        gi, off = flat_at[idx]
        if "fp32_groups_flat" in opt:  # FP16_Optimizer: a flat master (and state) per group
            entries.append(Entry(name, WEIGHT, 0, n, mf, key_of(("optimizer", "fp32_groups_flat", gi), off, off + n)))
            state_path, lo = base_path + ("state", gi), off
        else:
            wpath = ("optimizer", "fp32_groups", gi, g_index(groups, idx)) if "fp32_groups" in opt else ("module", name)
            entries.append(Entry(name, WEIGHT, 0, n, mf, key_of(wpath, 0, n)))
            state_path, lo = base_path + ("state", idx), 0
        st = base.get("state", {}).get(state_path[-1], {})
        for sk in ADAM_STATES:
            if sk in st:
                entries.append(Entry(name, sk, 0, n, mf, key_of(state_path + (sk,), lo, lo + n)))
        if "step" in st:
            step_at = fused_step.get(gi, state_path[-1]) if "fp32_groups_flat" not in opt else state_path[-1]
            entries += step_entries([(name, n)], mf, state_path[:-1] + (step_at, "step"))
    meta = metadata(tag, int(ms.get("dp_world_size") or 1), 0, train_dtype(ms), tensors, alias, entries,
                    {str(i): hyper(g) for i, g in enumerate(groups)})
    scaler = {k: opt[k] for k in ("cur_scale", "cur_iter", "last_overflow_iter", "scale_window") if k in opt}
    if scaler:
        scaler["dynamic"] = bool(opt.get("dynamic_loss_scale"))
    return DeepSpeedSource(path, meta, reader, common_state(ms, scaler or None), "zero0")


def _fused_steps(state: Dict[Any, Any], groups: List[Dict[str, Any]]) -> Dict[int, Any]:
    """Per group whose steps are ints (DeepSpeed's FusedAdam), the position whose ``step`` counts the group's:
    FusedAdam counts a group's steps in the state of its last parameter with a gradient (the others keep
    the count they started with) and uses that one count for every parameter."""
    out: Dict[int, Any] = {}
    for gi, g in enumerate(groups):
        steps = {i: state.get(i, {}).get("step") for i in g["params"]}
        ints = {i: v for i, v in steps.items() if isinstance(v, int) and not isinstance(v, bool)}
        if ints:
            out[gi] = max(ints, key=lambda i: ints[i])
    return out


def g_index(groups: List[Dict[str, Any]], idx: int) -> int:
    """The position of optimizer parameter ``idx`` within its group."""
    for g in groups:
        ids = [int(i) for i in g["params"]]
        if idx in ids:
            return ids.index(idx)
    raise CheckpointError(f"internal error: optimizer parameter {idx} is in no group")


def _optimizer_files(path: str, reader: PtReader, why: str,
                     moe: bool = False) -> Tuple[str, Dict[str, Any], int, Dict[int, str]]:
    """Rank 0's optimizer file (its name, its ``optimizer_state_dict``), the world it was saved at, and every
    rank's file; a missing rank-0 file is a CheckpointError ending with ``why`` it must exist."""
    files0 = optim_files(path)
    if 0 not in files0:
        raise CheckpointError(f"DeepSpeed checkpoint file {os.path.join(path, 'zero_pp_rank_0_mp_rank_00_optim_states.pt')}"
                              f" is missing: {why}")
    first = files0[0]
    osd0 = field(reader.obj(first), (OSD,), os.path.join(path, first))
    world = _world(osd0, os.path.join(path, first), moe)
    return first, osd0, world, _rank_files(path, world, first)


def read_zero12(path: str, tag: str, ms: Dict[str, Any], reader: PtReader) -> DeepSpeedSource:
    """ZeRO 1-2: ``single_partition_of_fp32_groups[g]`` and the base optimizer's state ``g`` per rank."""
    model_file = os.path.join(path, MODEL_FILE)
    moe = is_moe_checkpoint(ms)
    if moe:
        refuse_unsupported(path, ms, model_file)
    first, osd0, world, files = _optimizer_files(path, reader, f"field 'optimizer' of {model_file} says the "
                                                               f"optimizer is ZeRO's", moe)
    shapes = param_shapes(ms, model_file)
    groups = [[(n, numel(s)) for n, s in g] for g in shapes]
    parts: List[List[Tuple[int, int]]] = [[] for _ in groups]
    bases = []
    for r in range(world):
        where = os.path.join(path, files[r])
        osd = field(reader.obj(files[r]), (OSD,), where)
        fp32 = field(osd, ("single_partition_of_fp32_groups",), where)
        pads = field(osd, ("group_paddings",), where)
        if len(fp32) != len(groups) or len(pads) != len(groups):
            raise CheckpointError(f"DeepSpeed checkpoint file {where}: field 'single_partition_of_fp32_groups' has "
                                  f"{len(fp32)} groups, 'param_shapes' of {model_file} {len(groups)}")
        for g, (t, p) in enumerate(zip(fp32, pads)):
            parts[g].append((int(t.numel()), int(t.numel()) + int(p)))
        bases.append(field(osd, ("base_optimizer_state",), where))
    try:
        if moe:
            spans, shapes = moe_spans(shapes, osd0.get("param_alignment_paddings"), parts,
                                      _counts(osd0, os.path.join(path, first)), world, ms["num_experts"], model_file)
            groups = [[(n, numel(s)) for n, s in g] for g in shapes]  # expert parameters stacked, as ours
        else:
            spans = zero12_spans(groups, osd0.get("param_alignment_paddings"), parts)
    except CheckpointError as exc:
        raise CheckpointError(f"DeepSpeed checkpoint file {os.path.join(path, first)}: field "
                              f"'single_partition_of_fp32_groups': {exc}") from exc
    entries = span_entries(spans, files, (OSD, "single_partition_of_fp32_groups"))
    listed = isinstance(bases[0], list)  # elastic checkpoints: a lean state per group
    state0 = bases[0] if listed else bases[0].get("state", {})

    def state_path(sk: str):
        return (lambda g: (OSD, "base_optimizer_state", g, sk)) if listed else \
            (lambda g: (OSD, "base_optimizer_state", "state", g, sk))

    for sk in ADAM_STATES:
        if all(sk in state0[g] for g in range(len(groups))):
            entries += span_entries(spans, files, (), sk, state_path(sk))
    for g, params in enumerate(groups):
        if "step" in state0[g]:
            entries += step_entries(params, first, state_path("step")(g))
    trained = {n for g in groups for n, _ in g}
    tensors, whole = module_tensors(ms, model_file, skip=trained | set(aliases(ms)))
    for grp in shapes:
        for n, s in grp:
            tensors[n] = TensorInfo(s, "float32", "param")
    hypers = {} if listed else {str(g): hyper(x) for g, x in enumerate(bases[0].get("param_groups", []))}
    stage = stage_of(osd0.get("zero_stage"))
    meta = metadata(tag, world, stage or 1, train_dtype(ms), tensors, aliases(ms), entries + whole, hypers)
    check_covered(meta, path)
    return DeepSpeedSource(path, meta, reader, common_state(ms, osd0.get("loss_scaler")), "zero12")


def read_zero3(path: str, tag: str, reader: PtReader) -> DeepSpeedSource:
    """ZeRO 3: a model-states file and an optimizer file per rank; ``fp32_flat_groups`` per sub-group."""
    m0 = Z3_MODEL.format(0)
    ms = reader.obj(m0)
    check_version(ms, os.path.join(path, m0))
    first, osd0, world, files = _optimizer_files(path, reader, f"{m0} is a ZeRO-3 checkpoint's")
    models = {r: Z3_MODEL.format(r) for r in range(world)}
    for f in models.values():
        if not os.path.isfile(os.path.join(path, f)):
            raise CheckpointError(f"DeepSpeed checkpoint file {os.path.join(path, f)} is missing: field "
                                  f"'partition_count' of {first} says {world} ranks saved")
    shapes = [p for g in param_shapes(ms, os.path.join(path, m0)) for p in g]
    params = [(n, numel(s)) for n, s in shapes]
    sizes = [int(t.numel()) for t in field(osd0, ("fp32_flat_groups",), os.path.join(path, first))]
    for r in range(1, world):
        where = os.path.join(path, files[r])
        got = [int(t.numel()) for t in field(reader.obj(files[r]), (OSD, "fp32_flat_groups"), where)]
        if got != sizes:
            raise CheckpointError(f"DeepSpeed checkpoint file {where}: field 'fp32_flat_groups' has sizes {got}, rank "
                                  f"0's {sizes}")
    try:
        spans = zero3_spans(params, world, sizes)
    except CheckpointError as exc:
        raise CheckpointError(f"DeepSpeed checkpoint file {os.path.join(path, first)}: field 'fp32_flat_groups': "
                              f"{exc}") from exc
    entries = span_entries(spans, files, (OSD, "fp32_flat_groups"))
    base = field(osd0, (OSD,), os.path.join(path, first))
    state0 = base.get("state", {})
    for sk in ADAM_STATES:
        if sizes and all(sk in state0.get(g, {}) for g in range(len(sizes))):
            entries += span_entries(spans, files, (), sk, lambda g, sk=sk: (OSD, OSD, "state", g, sk))
    if sizes and "step" in state0.get(0, {}):
        entries += step_entries(params, first, (OSD, OSD, "state", 0, "step"))
    tensors, whole = module_tensors(ms, os.path.join(path, m0), skip={n for n, _ in params} | set(aliases(ms)))
    entries += whole
    entries += _frozen3(ms, models, world, tensors)
    for n, s in shapes:
        tensors[n] = TensorInfo(s, "float32", "param")
    meta = metadata(tag, world, 3, train_dtype(ms), tensors, aliases(ms), entries, _group_hypers(base))
    check_covered(meta, path)
    return DeepSpeedSource(path, meta, reader, common_state(ms, osd0.get("loss_scaler")), "zero3")


def _frozen3(ms: Dict[str, Any], models: Dict[int, str], world: int, tensors: Dict[str, TensorInfo]) -> List[Entry]:
    """Frozen parameters at stage 3: rank ``r``'s piece in its ``frozen_param_fragments``."""
    frozen = [(str(n), [int(d) for d in s]) for n, s in (ms.get("frozen_param_shapes") or {}).items()]
    for n, s in frozen:
        tensors[n] = TensorInfo(s, train_dtype(ms), "frozen")
    out = []
    for sp in zero3_frozen_spans([(n, numel(s)) for n, s in frozen], world):
        size = sp.end - sp.start
        out.append(Entry(sp.name, WEIGHT, sp.start, sp.end, models[sp.rank],
                         key_of(("frozen_param_fragments", sp.name), 0, size)))
    return out


def _group_hypers(base: Dict[str, Any]) -> Dict[str, Any]:
    """Stage 3's optimizer groups are sub-groups; consecutive ones with the same settings are one of the
    user's groups."""
    out: List[Dict[str, Any]] = []
    for g in base.get("param_groups", []):
        h = hyper(g)
        if not out or out[-1] != h:
            out.append(h)
    return {str(i): h for i, h in enumerate(out)}
