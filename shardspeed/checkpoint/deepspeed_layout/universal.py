"""DeepSpeed's universal layout (``ds_to_universal.py``'s output) as a :class:`~.source.DeepSpeedSource`,
and :func:`open_deepspeed`, which recognises any of DeepSpeed's layouts in a tag directory.

The universal layout holds one folder per parameter under ``zero/``: ``fp32.pt``, ``exp_avg.pt``,
``exp_avg_sq.pt`` (each the whole tensor, bare or as ``{"param": tensor, ...}``) and, at stages 1-2,
``step.pt``; ``zero/optimizer_state.pt`` holds the optimizer's groups (and, at stage 3, its step); the
model-states files are copied from the original checkpoint.
"""
from __future__ import annotations

import os
from typing import Any, List, Optional, Sequence, Tuple

from ...errors import CheckpointError
from ..commit import check_tag
from ..metadata import WEIGHT, Entry, TensorInfo
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
    is_deepspeed_dir,
    metadata,
    module_tensors,
    numel,
    param_shapes,
    refuse_model_parallel,
    train_dtype,
)
from .zero import read_zero0, read_zero3, read_zero12

UNIVERSAL_DIR = "zero"
OPT_FILE = os.path.join(UNIVERSAL_DIR, "optimizer_state.pt")


def _state_file(reader: PtReader, file: str, name: str, n: int) -> Tuple[Any, ...]:
    """The field path of the tensor in a universal state file (``("param",)`` or the bare tensor: ``()``),
    checked to hold ``n`` elements."""
    obj = reader.obj(file)
    path: Tuple[Any, ...] = ("param",) if isinstance(obj, dict) else ()
    t = field(obj, path, os.path.join(reader.root, file))
    if not is_tensor(t) or t.numel() != n:
        got = t.numel() if is_tensor(t) else type(t).__name__
        raise CheckpointError(f"DeepSpeed universal checkpoint file {os.path.join(reader.root, file)}: field "
                              f"'param' holds {got} elements, {name!r} has {n}")
    reader.close()  # one parameter's files open at a time
    return path


def read_universal(path: str, tag: str, reader: PtReader) -> DeepSpeedSource:
    z3 = not os.path.isfile(os.path.join(path, MODEL_FILE))
    mfile = Z3_MODEL.format(0) if z3 else MODEL_FILE
    ms = reader.obj(mfile)
    check_version(ms, os.path.join(path, mfile))
    where = os.path.join(path, mfile)
    shapes = [p for g in param_shapes(ms, where) for p in g]
    opt = reader.obj(OPT_FILE)
    tensors, entries = module_tensors(ms, where, skip={n for n, _ in shapes} | set(aliases(ms)))
    step_file: Optional[Tuple[str, Tuple[Any, ...]]] = None
    if z3:
        st = (field(opt, ("optimizer_state_dict", "state"), os.path.join(path, OPT_FILE)) or {}).get(0, {})
        if "step" in st:
            step_file = (OPT_FILE, ("optimizer_state_dict", "state", 0, "step"))
    for name, shape in shapes:
        n = numel(shape)
        tensors[name] = TensorInfo(shape, "float32", "param")
        folder = os.path.join(UNIVERSAL_DIR, name)
        if not os.path.isfile(os.path.join(path, folder, "fp32.pt")):
            raise CheckpointError(f"DeepSpeed universal checkpoint file {os.path.join(path, folder, 'fp32.pt')} is "
                                  f"missing: field 'param_shapes' of {where} names {name!r}")
        for state, fname in ((WEIGHT, "fp32.pt"),) + tuple((s, f"{s}.pt") for s in ADAM_STATES):
            file = os.path.join(folder, fname)
            if os.path.isfile(os.path.join(path, file)):
                entries.append(Entry(name, state, 0, n, file, key_of(_state_file(reader, file, name, n), 0, n)))
        own_step = os.path.join(folder, "step.pt")
        if os.path.isfile(os.path.join(path, own_step)):
            entries.append(Entry(name, "step", 0, n, own_step, key_of((), 0, 1), elementwise=False))
        elif step_file is not None:
            entries.append(Entry(name, "step", 0, n, step_file[0], key_of(step_file[1], 0, 1), elementwise=False))
    groups = opt.get("param_groups") or []
    stage = stage_of(opt.get("zero_stage")) or (3 if z3 else 1)
    meta = metadata(tag, int(ms.get("dp_world_size") or 1), stage, train_dtype(ms), tensors, aliases(ms), entries,
                    {str(i): hyper(g) for i, g in enumerate(groups)})
    check_covered(meta, path)
    return DeepSpeedSource(path, meta, reader, common_state(ms, opt.get("loss_scaler")), "universal")


def open_deepspeed(load_dir: str, tag: str, trainable: Optional[Sequence[Sequence[str]]] = None,
                   trust_pickles: bool = False) -> Optional[DeepSpeedSource]:
    """The DeepSpeed checkpoint ``load_dir/tag`` as a source for our loader, or None when that directory
    is not DeepSpeed's. ``trainable[g]``: the model's trained parameter names in optimizer group ``g``, in
    registration order (ZeRO 0 keys its optimizer state by position; without them every parameter of the
    module is taken as trained, the groups in module order). ``trust_pickles``: unpickle any global its
    files name (by default only what DeepSpeed's checkpoints hold, :func:`~.pickles.find_global`)."""
    path = os.path.join(load_dir, check_tag(tag))
    if not is_deepspeed_dir(path):
        return None
    refuse_model_parallel(path)
    reader = PtReader(path, trust_pickles)
    if os.path.isdir(os.path.join(path, UNIVERSAL_DIR)) and os.path.isfile(os.path.join(path, OPT_FILE)):
        return read_universal(path, tag, reader)
    if not os.path.isfile(os.path.join(path, MODEL_FILE)):
        return read_zero3(path, tag, reader)
    ms = reader.obj(MODEL_FILE)
    check_version(ms, os.path.join(path, MODEL_FILE))
    if ms.get("param_shapes") is None and not any(f for f in os.listdir(path) if f.endswith("_optim_states.pt")):
        return read_zero0(path, tag, ms, reader, trainable)
    return read_zero12(path, tag, ms, reader)


def describe(src: DeepSpeedSource) -> List[str]:
    """Lines for ``shardspeed convert``'s log: what was found."""
    m = src.meta
    return [f"DeepSpeed {src.kind} checkpoint {src.path}: world {m.world_size}, ZeRO {m.zero_stage}, "
            f"{m.train_dtype}, {sum(1 for t in m.tensors.values() if t.kind == 'param')} trained tensors"]
