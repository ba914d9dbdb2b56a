"""``load_checkpoint``: each rank reads the ranges it owns *now* (any world size, any ZeRO stage) from
whichever files hold them, so resharding needs no conversion step."""
from __future__ import annotations

import logging
import os
from collections import defaultdict
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Tuple

import torch

from ..errors import CheckpointError
from .commit import check_tag, read_latest, resolve
from .engine_view import EngineView, OwnedPiece
from .format import ShardReader, dtype_name
from .metadata import FORMAT, WEIGHT, CheckpointMetadata, Entry, rank_file
from .metadata_checks import check_files, check_stored
from .ranges import EntryIndex, entries_for, read_range
from .slices import Spec
from .unpickle import read_common

logger = logging.getLogger("shardspeed")


def _check_names(view: EngineView, meta: CheckpointMetadata, strict: bool) -> set:
    """Names of the current model that the checkpoint holds; raises on a mismatch when ``strict``."""
    current: Dict[str, Tuple[int, ...]] = {}
    for name, shape, _ in view.unit_params():
        current[name] = view.full_shape(name, tuple(shape))  # a tensor-parallel slice: its full tensor's
    for name, t in view.other_params() + view.buffers():
        current[name] = view.full_shape(name, tuple(t.shape))
    saved = set(meta.tensors)
    missing = sorted(set(current) - saved)
    unexpected = sorted(saved - (view.model_names or set(current)))  # a pipeline: other stages' names too
    if strict and (missing or unexpected):
        raise CheckpointError(
            f"the checkpoint does not match the model: missing {missing[:8]}{'...' if len(missing) > 8 else ''}, "
            f"unexpected {unexpected[:8]}{'...' if len(unexpected) > 8 else ''}; pass load_module_strict=False "
            f"to load what matches"
        )
    for name in sorted(set(current) & saved):
        if tuple(meta.tensors[name].shape) != current[name]:
            raise CheckpointError(f"{name!r} has shape {list(current[name])} in the model but "
                                  f"{meta.tensors[name].shape} in the checkpoint")
    return set(current) & saved


def _log_master_conversion(view: EngineView, meta: CheckpointMetadata, reader: ShardReader, present: set) -> None:
    """One line when the checkpoint's master weights are in another dtype than this engine's
    (bf16_master_weights_and_grads on one side only): they are converted as they are read, and so are the
    optimizer states where theirs differ (bf16 masters keep fp32 moments when offloaded without
    bf16_optimizer_states)."""
    now = dtype_name(view.master_dtype)
    saved = sorted({meta.tensors[n].dtype for n in present if meta.tensors[n].kind == "param"} - {now})
    if not saved:
        return
    e = next((e for e in meta.entries if e.state == "exp_avg" and e.tensor in present and e.file), None)
    states = dtype_name(reader.dtype_of(e.file, e.key)) if e is not None else "/".join(saved)
    now_states = dtype_name(view.state_dtype)
    if states == "/".join(saved) and now_states == now:
        logger.info("checkpoint master weights and optimizer states are %s, this engine's are %s: converting "
                    "them %s -> %s as they load", "/".join(saved), now, "/".join(saved), now)
    else:
        logger.info("checkpoint master weights are %s, this engine's are %s: converting them %s -> %s as they "
                    "load (optimizer states: %s, this engine's %s)", "/".join(saved), now, "/".join(saved), now,
                    states, now_states)


@torch.no_grad()
def _load_weights(view: EngineView, index: EntryIndex, reader: ShardReader, present: set) -> None:
    for pieces in ([] if view.offloaded else view.pieces()):  # offloaded masters: _load_offloaded
        for pc in pieces:
            if pc.name in present:
                read_range(reader, index, pc.name, WEIGHT, pc.start, pc.end, out=pc.master, sl=view.spec(pc.name))
    for unit, frozen in zip(view.units, view.frozen_pieces()):
        for name, start, end, shard_view in frozen:
            if name in present:
                read_range(reader, index, name, WEIGHT, start, end, out=shard_view, sl=view.spec(name))
        view.store_frozen(unit, [f[3] for f in frozen])
    for name, t in view.other_params() + view.buffers():
        if name in present:
            flat = read_range(reader, index, name, WEIGHT, 0, t.numel(), dtype=t.dtype, sl=view.spec(name))
            t.data.copy_(flat.view(t.shape))


def _state_entries(index: EntryIndex, name: str, state: str, start: int, end: int, sl: Spec) -> List[Entry]:
    """Saved entries of a piece's optimizer ``state`` (the first tells whether it is elementwise). Slices
    (saved or current) count ranges in different tensors: any entry of the state then stands for them."""
    if sl is not None or index.sliced(name, state):
        return index.entries_of(name, state)
    return index.overlapping(name, state, start, end)


def _piece_state(pc: OwnedPiece, index: EntryIndex, reader: ShardReader, sl: Spec = None) -> Dict[str, Any]:
    state: Dict[str, Any] = {}
    for sk in index.states_of(pc.name):
        entries = _state_entries(index, pc.name, sk, pc.start, pc.end, sl)
        if not entries:
            continue
        if entries[0].elementwise:  # one saved piece at a time; in place when it is exactly this piece
            dtype = reader.dtype_of(entries[0].file, entries[0].key)
            out = read_range(reader, index, pc.name, sk, pc.start, pc.end, dtype=dtype, sl=sl)
            state[sk] = out.view(pc.master.shape)
        elif entries[0].file:
            state[sk] = reader.read(entries[0].file, entries[0].key, entries[0].crc32)
        else:
            state[sk] = entries[0].value
    return state


def _restore_hyper(current: Dict[str, Any], saved: Optional[Dict[str, Any]]) -> Dict[str, Any]:
    out = {k: v for k, v in current.items() if k != "params"}
    for k, v in (saved or {}).items():
        if k not in out:
            continue
        cur = out[k]
        if torch.is_tensor(cur):
            out[k] = torch.as_tensor(v, dtype=cur.dtype, device=cur.device)
        elif isinstance(cur, tuple) and isinstance(v, list):
            out[k] = tuple(v)
        elif isinstance(cur, (bool, int, float)) or cur is None:
            out[k] = v
    return out


def _check_optimizer_class(view: EngineView, meta: CheckpointMetadata) -> Dict[str, Any]:
    saved = meta.optimizer or {}
    now = type(view.optimizer).__name__
    if saved.get("class") and saved["class"] != now:
        raise CheckpointError(f"the checkpoint's optimizer is {saved['class']} but the engine's is {now}; pass "
                              f"load_optimizer_states=False to start the optimizer afresh")
    return saved


@torch.no_grad()
def _load_offloaded(view: EngineView, meta: CheckpointMetadata, index: EntryIndex, reader: ShardReader,
                    present: set, with_optimizer: bool) -> None:
    """Masters (and Adam moments) of an offloaded engine, written into its store tile by tile: with NVMe,
    memory holds one tile plus one saved entry at a time. Any saved layout works (ranges are assembled
    from whichever entries overlap, as for the pieces of a non-offloaded engine)."""
    if with_optimizer:
        saved = _check_optimizer_class(view, meta)
        groups = saved.get("param_groups", {})
        for gi, g in zip(view.master.group_indices, view.optimizer.param_groups):
            g.update(_restore_hyper(g, groups.get(str(gi))))
    by_tile: Dict[Tuple[bool, int], List[Any]] = defaultdict(list)
    for op in view.offloaded_pieces():
        if op.name in present:
            by_tile[(op.segment.on_host, op.segment.tile.index)].append(op)

    def fill(tile, on_host: bool, st) -> None:
        for op in by_tile.get((on_host, tile.index), []):
            a = op.segment.lo - tile.lo
            b = a + op.end - op.start
            read_range(reader, index, op.name, WEIGHT, op.start, op.end, out=st.master[a:b], sl=view.spec(op.name))
            if not with_optimizer:
                continue
            stored = {slot: saved for saved, slot in view.tiled_master().saved_states(op.segment)}
            for slot in ("exp_avg", "exp_avg_sq"):
                dst, sk = getattr(st, slot)[a:b], stored.get(slot)
                if sk is not None and index.has(op.name, sk):
                    read_range(reader, index, op.name, sk, op.start, op.end, out=dst, sl=view.spec(op.name))
                else:  # saved before the first step (no moments yet), or a slot Muon leaves unused
                    dst.zero_()

    view.tiled_master().load_tiles(fill)
    if with_optimizer:  # Adam's step is one count for every piece: take it from any saved piece
        e = next((e for e in meta.entries if e.state == "step" and e.tensor in present), None)
        view.optimizer_steps = 0 if e is None else \
            int(float(reader.read(e.file, e.key, e.crc32)) if e.file else float(e.value))


def _load_optimizer(view: EngineView, meta: CheckpointMetadata, index: EntryIndex, reader: ShardReader,
                    present: set) -> None:
    saved = _check_optimizer_class(view, meta)
    piece_of = {id(pc.master): pc for pieces in view.pieces() for pc in pieces}
    opt = view.optimizer
    opt.state = defaultdict(dict)  # drop the current state first: peak memory stays one copy of it
    state: Dict[int, Dict[str, Any]] = {}
    groups: List[Dict[str, Any]] = []
    idx = 0
    saved_groups = saved.get("param_groups", {})
    for gi, g in zip(view.master.group_indices, opt.param_groups):
        ids = []
        for t in g["params"]:
            pc = piece_of.get(id(t))  # None: the empty placeholder of a group this rank owns nothing of
            if pc is not None and pc.name in present:
                st = _piece_state(pc, index, reader, view.spec(pc.name))
                if st:
                    state[idx] = st
            ids.append(idx)
            idx += 1
        groups.append(dict(_restore_hyper(g, saved_groups.get(str(gi))), params=ids))
    opt.load_state_dict({"state": state, "param_groups": groups})


@dataclass
class _Verified:
    """What the verification pass established, for the apply pass."""
    path: str
    meta: CheckpointMetadata
    index: EntryIndex
    reader: ShardReader
    present: set
    common: Dict[str, Any]


def _trained_by_group(view: EngineView) -> List[List[str]]:
    """Per optimizer group, its trained parameters' names in registration order (every rank's pieces
    together: a rank holds only its own at stages 1-3). A collective: DeepSpeed's ZeRO 0 keys its optimizer
    state by position in the groups, so a load of it needs them."""
    mine = {pc.name: pc.group for pieces in view.pieces() for pc in pieces}
    group_of: Dict[str, int] = {}
    for d in view.all_gather_object(mine):
        group_of.update(d)
    out: List[List[str]] = [[] for _ in range(max(group_of.values(), default=-1) + 1)]
    for name, _ in view.module.named_parameters():
        if name in group_of:
            out[group_of[name]].append(name)
    return out


def _open(view: EngineView, load_dir: str, tag: str, verify: bool,
          trust_pickles: bool) -> Tuple[str, CheckpointMetadata, ShardReader, Dict[str, Any]]:
    """(path, metadata, reader, common state) of checkpoint ``tag``: ours, or DeepSpeed's (its ZeRO 0-3
    layouts and its universal one), presented as ours (:mod:`.deepspeed_layout`)."""
    from .deepspeed_layout import is_deepspeed_dir, open_deepspeed

    tag = check_tag(tag)  # before any path is built from it
    if is_deepspeed_dir(os.path.join(load_dir, tag)):  # the same answer on every rank (a shared directory)
        ds = open_deepspeed(load_dir, tag, trainable=_trained_by_group(view), trust_pickles=trust_pickles)
        assert ds is not None
        return ds.path, ds.meta, ds.reader, ds.common
    path = resolve(load_dir, tag)
    meta = CheckpointMetadata.read(path)
    check_files(meta, path)
    reader = ShardReader(path, verify=verify, header_crc32=meta.header_crc32())
    return path, meta, reader, read_common(path, meta, trust_pickles)


def _verify(view: EngineView, load_dir: str, tag: str, strict: bool, with_optimizer: bool, module_only: bool,
            verify: bool, trust_pickles: bool = False) -> _Verified:
    """Check everything this rank's load will use, changing nothing: the metadata (its checksum), the file
    sizes, every safetensors header it reads (CRC), ``common.pt`` (CRC), names and shapes, the optimizer
    class, that every range is covered, and (``verify``) the CRC of every tensor it will read."""
    path, meta, reader, common = _open(view, load_dir, tag, verify, trust_pickles)
    index = EntryIndex(meta.entries, meta.shapes)
    present = _check_names(view, meta, strict)
    if with_optimizer:
        _check_optimizer_class(view, meta)
    needed: Dict[Tuple[str, str], Optional[int]] = {}
    used: Dict[int, Entry] = {}  # the entries read, checked against their stored tensors

    def need(e: Entry) -> None:
        needed[(e.file, e.key)] = e.crc32
        used[id(e)] = e

    def need_range(name: str, state: str, start: int, end: int) -> None:
        for e in entries_for(index, name, state, start, end, view.spec(name)):
            need(e)

    if view.offloaded:
        for op in view.offloaded_pieces():
            if op.name not in present:
                continue
            need_range(op.name, WEIGHT, op.start, op.end)
            if with_optimizer:
                for sk in ("exp_avg", "exp_avg_sq"):
                    if index.has(op.name, sk):
                        need_range(op.name, sk, op.start, op.end)
        if with_optimizer:
            e = next((e for e in meta.entries if e.state == "step" and e.tensor in present), None)
            if e is not None and e.file:
                need(e)
    else:
        for pieces in view.pieces():
            for pc in pieces:
                if pc.name not in present:
                    continue
                need_range(pc.name, WEIGHT, pc.start, pc.end)
                if not with_optimizer:
                    continue
                for sk in index.states_of(pc.name):
                    entries = _state_entries(index, pc.name, sk, pc.start, pc.end, view.spec(pc.name))
                    if entries and entries[0].elementwise:
                        need_range(pc.name, sk, pc.start, pc.end)
                    elif entries and entries[0].file:
                        need(entries[0])
    for frozen in view.frozen_pieces():
        for name, start, end, _ in frozen:
            if name in present:
                need_range(name, WEIGHT, start, end)
    for name, t in view.other_params() + view.buffers():
        if name in present:
            need_range(name, WEIGHT, 0, t.numel())
    if not module_only:  # the RNG tensors too, restored or not: a corrupt byte anywhere refuses the load
        rec = meta.rng.get(str(view.rank)) or {}
        for k, crc in rec.get("tensors", {}).items():
            needed[(rank_file(view.rank), k)] = crc
    if meta.format == FORMAT:  # ours (DeepSpeed's entries are built from its files' own layout)
        check_stored(reader, list(used.values()), meta.tensors)
    for (file, key), crc in sorted(needed.items()):
        reader.check(file, key, crc)
    return _Verified(path, meta, index, reader, present, common)


def load_checkpoint(engine, load_dir: str, tag: Optional[str] = None, load_module_strict: bool = True,
                    load_optimizer_states: bool = True, load_lr_scheduler_states: bool = True,
                    load_module_only: bool = False, verify: bool = True,
                    trust_pickles: bool = False, load_rng_state: bool = False) -> Tuple[Optional[str], Optional[dict]]:
    """Load a checkpoint saved at any world size and ZeRO stage; every rank must call it.

    Returns ``(path, client_state)``, or ``(None, None)`` when ``load_dir`` holds no ``latest`` and no tag
    was given. ``load_module_only`` loads the weights alone, as DeepSpeed does: the engine keeps its optimizer
    state, schedule, loss scaler, step counters, data-loader position and RNG; the saved ``global_steps``,
    ``global_samples`` and ``skipped_steps`` are returned in ``client_state`` (unless it has those keys).

    ``load_rng_state``: also restore each rank's torch (CPU, CUDA), Python and numpy RNG states as saved by
    the rank of the same number. Off by default, as DeepSpeed, which saves none: a resumed run then draws
    what DeepSpeed's resumed run draws. On, a resume with dropout or random augmentation is bit-exact
    (docs/checkpoints.md).

    All or nothing: every rank first verifies everything its load will use (the metadata's checksum, file
    sizes, header and ``common.pt`` CRCs and, with ``verify``, each tensor's CRC-32), the ranks agree on the
    verdict, and only then does any rank change its engine. On failure every rank raises the same
    :class:`CheckpointError` and the engine is as it was.

    No code from the checkpoint runs: ``common.pt`` (and DeepSpeed's ``.pt`` files) are unpickled through
    an allowlist of plain types (:mod:`.unpickle`); a client state holding other classes is refused, naming
    them. ``trust_pickles=True`` unpickles anything, which runs whatever code the files name: only for
    checkpoints you trust.
    """
    view = EngineView(engine, "load_checkpoint")
    if tag is None:
        tag = read_latest(load_dir)
        if tag is None:
            if view.rank == 0:
                logger.warning("no 'latest' file in %s: nothing loaded", load_dir)
            return None, None
    with_optimizer = load_optimizer_states and not load_module_only
    with_rng = load_rng_state and not load_module_only
    err = None
    checked: Optional[_Verified] = None
    try:
        checked = _verify(view, load_dir, str(tag), load_module_strict, with_optimizer, load_module_only, verify,
                          trust_pickles)
    except CheckpointError as exc:
        err = str(exc)
    except Exception as exc:  # unexpected: still fail every rank alike, before anything changed
        err = f"cannot load checkpoint {tag!r} from {load_dir}: {type(exc).__name__}: {exc}"
    view.agree(err)  # the verdict: every rank raises the same error, or every rank applies
    assert checked is not None
    path, meta, index, reader, present, common = (checked.path, checked.meta, checked.index, checked.reader,
                                                  checked.present, checked.common)

    if view.rank == 0:
        _log_master_conversion(view, meta, reader, present)
    err = None
    try:
        _load_weights(view, index, reader, present)
        if view.offloaded:
            _load_offloaded(view, meta, index, reader, present, with_optimizer)
        elif with_optimizer:
            _load_optimizer(view, meta, index, reader, present)
        if not load_module_only:
            view.load_common_state(common, lr_scheduler=load_lr_scheduler_states)
        if with_rng:
            _restore_rng(view, meta, reader)
    except Exception as exc:  # verified a moment ago: an I/O error, or the files changed under us
        err = (f"loading checkpoint {path} failed after it was verified ({type(exc).__name__}: {exc}); "
               f"the engine is partially loaded: load a checkpoint again before training")
    finally:
        reader.close()
    view.agree(err)  # every rank fails alike before the collectives below
    view.write_back_masters()

    client_state = common.get("client_state", {})
    if load_module_only:  # as DeepSpeed: the saved counters come back in client_state, the engine's stay
        client_state = dict(client_state)
        for k, v in common.get("counters", {}).items():
            if k != "micro_steps":
                client_state.setdefault(k, v)
    if view.rank == 0:
        logger.info("loaded checkpoint %s (saved at world %d, stage %d; now world %d, stage %d)", path,
                    meta.world_size, meta.zero_stage, view.world, view.zero_stage)
    return path, client_state


def _restore_rng(view: EngineView, meta: CheckpointMetadata, reader: ShardReader) -> None:
    """This rank's RNG states as saved by the rank of the same number (if the old world had one)."""
    rec = meta.rng.get(str(view.rank))
    if rec is None:
        return
    file = rank_file(view.rank)
    tensors = {k: reader.read(file, k, crc) for k, crc in rec.get("tensors", {}).items()}
    view.parts.rng.load_state_dict({"tensors": tensors, "py": rec.get("py", {})})
