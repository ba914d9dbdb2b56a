"""``save_checkpoint``: every rank streams what it owns into its own safetensors file; rank 0 describes the
whole in ``metadata.json`` and commits the directory atomically (see :mod:`.commit`)."""
from __future__ import annotations

import io
import logging
import os
import shutil
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Dict, List, Optional, Protocol, Tuple, Union

import torch

from ..errors import CheckpointError
from .commit import check_tag, commit, new_temp_dir, remove_stale
from .engine_view import EngineView
from .format import LazyTensor, dtype_name, fsync_dir, maybe_crash, write_file_synced, write_safetensors
from .metadata import COMMON_FILE, METADATA_FILE, WEIGHT, CheckpointMetadata, Entry, FileInfo, TensorInfo, rank_file
from .save_lock import SaveLock

logger = logging.getLogger("shardspeed")


class Coordination(Protocol):
    """The collectives a save coordinates its ranks with: :class:`~.engine_view.EngineView`'s (the training
    group) for a synchronous save, the checkpoint writer's own group for an asynchronous one."""

    def all_gather_object(self, obj: Any) -> List[Any]: ...

    def agree(self, error: Optional[str]) -> None: ...


def _jsonable(v: Any) -> Any:
    if torch.is_tensor(v):
        return v.item() if v.numel() == 1 else v.tolist()
    if isinstance(v, (tuple, list)):
        return [_jsonable(x) for x in v]
    if isinstance(v, (bool, int, float, str)) or v is None:
        return v
    return repr(v)


def group_hyper(group: Dict[str, Any]) -> Dict[str, Any]:
    return {k: _jsonable(v) for k, v in group.items() if k not in ("params", "param_names")}


def _rank_items(view: EngineView) -> Tuple[List[Tuple[str, Union[torch.Tensor, LazyTensor]]], List[Entry],
                                          Dict[int, dict]]:
    """This rank's tensors (key, tensor) and the entries describing them (CRCs filled in after writing)."""
    file = rank_file(view.rank)
    items: List[Tuple[str, Union[torch.Tensor, LazyTensor]]] = []
    entries: List[Entry] = []
    groups: Dict[int, dict] = {}
    opt_state = view.optimizer.state
    for gi, g in zip(view.master.group_indices, view.optimizer.param_groups):
        groups[gi] = group_hyper(g)
    if view.offloaded:
        _offloaded_items(view, file, items, entries)
    for unit, pieces in zip(view.units, [] if view.offloaded else view.pieces()):
        if not view.writes_unit(unit):
            continue
        for pc in pieces:
            if not view.writes_param(pc.name):
                continue
            tp = _tp(view, pc.name)
            key = f"w/{pc.name}/{pc.start}"
            items.append((key, pc.master))
            entries.append(Entry(pc.name, WEIGHT, pc.start, pc.end, file, key, tp=tp))
            for sk, sv in opt_state.get(pc.master, {}).items():
                skey = f"o/{sk}/{pc.name}/{pc.start}"
                if torch.is_tensor(sv):
                    elementwise = sv.numel() == pc.master.numel() and sv.dim() >= 1
                    items.append((skey, sv))
                    entries.append(Entry(pc.name, str(sk), pc.start, pc.end, file, skey, elementwise=elementwise,
                                         tp=tp))
                else:
                    entries.append(Entry(pc.name, str(sk), pc.start, pc.end, "", "", elementwise=False,
                                         value=_jsonable(sv), tp=tp))
    for unit, frozen in zip(view.units, view.frozen_pieces()):
        if not view.writes_unit(unit):
            continue
        for name, start, end, t in frozen:
            if view.writes_param(name):
                key = f"w/{name}/{start}"
                items.append((key, t))
                entries.append(Entry(name, WEIGHT, start, end, file, key, tp=_tp(view, name)))
    if view.data_rank == 0:  # held whole by every rank of the data group
        for name, t in view.other_params() + view.buffers():
            if view.writes_param(name):
                key = f"w/{name}/0"
                items.append((key, t.detach()))
                entries.append(Entry(name, WEIGHT, 0, t.numel(), file, key, tp=_tp(view, name)))
    return items, entries, groups


def _tp(view: EngineView, name: str) -> Optional[List[int]]:
    """``Entry.tp`` of a parameter: its tensor-parallel slice on this rank, None when it is whole here."""
    spec = view.spec(name)
    return None if spec is None else list(spec)


def _offloaded_items(view: EngineView, file: str, items: List[Tuple[str, Union[torch.Tensor, LazyTensor]]],
                     entries: List[Entry]) -> None:
    """Masters and optimizer states from the offload store, one entry per (piece ∩ tile), in the same format as
    ``optimizer.state`` gives (so either kind of engine loads it). Lazy: with NVMe each range is read from
    the files only when the writer reaches it, so memory holds one tile-sized range at a time."""
    steps = view.optimizer_steps
    master = view.tiled_master()
    for op in view.offloaded_pieces():
        if not view.writes_param(op.name):
            continue
        n = op.end - op.start
        tp = _tp(view, op.name)

        def lazy(name: str, seg=op.segment, n=n) -> LazyTensor:
            dtype = view.master_dtype if name == "master" else master.state_dtype  # fp32 moments of bf16 masters
            return LazyTensor((n,), dtype, lambda: master.read_segment(seg, name))

        key = f"w/{op.name}/{op.start}"
        items.append((key, lazy("master")))
        entries.append(Entry(op.name, WEIGHT, op.start, op.end, file, key, tp=tp))
        if steps == 0:
            continue  # as torch's Adam before its first step: no state yet
        for saved, stored in master.saved_states(op.segment):
            skey = f"o/{saved}/{op.name}/{op.start}"
            items.append((skey, lazy(stored)))
            entries.append(Entry(op.name, saved, op.start, op.end, file, skey, elementwise=True, tp=tp))
        step = master.saved_step(op.segment)  # as optimizer.state holds it: torch Adam's 0-dim tensor, a count
        if torch.is_tensor(step):
            skey = f"o/step/{op.name}/{op.start}"
            items.append((skey, step))
            entries.append(Entry(op.name, "step", op.start, op.end, file, skey, elementwise=False, tp=tp))
        elif step is not None:
            entries.append(Entry(op.name, "step", op.start, op.end, "", "", elementwise=False, value=step, tp=tp))


def _tensor_table(view: EngineView) -> Dict[str, TensorInfo]:
    tensors: Dict[str, TensorInfo] = {}
    for name, shape, trainable in view.unit_params():
        full = list(view.full_shape(name, shape))  # a tensor-parallel slice: the full tensor's shape
        tensors[name] = TensorInfo(full, dtype_name(view.master_dtype), "param") if trainable else \
            TensorInfo(full, dtype_name(view.train_dtype), "frozen")
    for name, prm in view.other_params():
        tensors[name] = TensorInfo(list(view.full_shape(name, tuple(prm.shape))), dtype_name(prm.dtype), "frozen")
    for name, buf in view.buffers():
        tensors[name] = TensorInfo(list(buf.shape), dtype_name(buf.dtype), "buffer")
    return tensors


def save_checkpoint(engine, save_dir: str, tag: Optional[str] = None, client_state: Optional[dict] = None,
                    save_latest: bool = True, async_save: bool = False) -> str:
    """Save the full training state under ``{save_dir}/{tag}``; every rank must call it. Returns the path.

    ``async_save``: snapshot this rank's state to host memory, then write and commit it in a background
    thread (:mod:`.async_save`); the path is returned before the checkpoint exists. Either way a save first
    waits for an asynchronous one in flight and raises its error, on every rank."""
    t0 = time.perf_counter()
    view = EngineView(engine, "save_checkpoint")
    saves = view.parts.async_saves
    if saves is not None:
        saves.wait(view.coord)
    tag = check_tag(tag if tag is not None else f"global_step{engine.global_steps}")
    save_dir = os.path.abspath(save_dir)

    # 1. rank 0 prepares the temporary directory; every rank learns its name (and that tags agree)
    # (rank 0 holds the folder's save lock from here until the commit: a second writer is refused)
    prep: Tuple[Optional[str], Optional[str], str] = (None, None, tag)
    mine: Optional[str] = None  # the temporary directory this rank created (rank 0), removed on failure
    lock: Optional[SaveLock] = None  # released here, or by the asynchronous writer once it committed
    if view.rank == 0:
        try:
            os.makedirs(save_dir, exist_ok=True)
            lock = SaveLock.acquire(save_dir, tag)
            remove_stale(save_dir, lock)
            mine = new_temp_dir(save_dir, tag)
            os.makedirs(mine)
            prep = (mine, None, tag)
        except CheckpointError as exc:
            prep = (None, str(exc), tag)
        except OSError as exc:
            prep = (None, f"cannot create a checkpoint directory in {save_dir}: {exc}", tag)
    tmp: Optional[str] = None
    try:
        tmp, err, tag0 = view.broadcast_object(prep)
        if err is None and tag0 != tag:
            tag, err = _check_tag(view.parts.tag_validation, view.rank, tag, tag0)
        view.agree(err)
        assert tmp is not None
        job = RankSave(view.rank, save_dir, tmp, tag, save_latest, t0, lock=lock)
        if not async_save:
            return write_and_commit(job, view, lambda: collect(view, job, client_state))
        if saves is None:
            raise CheckpointError("internal error: async_save asked of an engine without an asynchronous saver")
        final = saves.start(view, job, client_state)
        lock = None  # the writer thread holds it until its commit
        return final
    except BaseException:
        remove_leftovers(view.rank, mine, tmp)
        raise
    finally:
        if lock is not None:
            lock.release()


def _check_tag(mode: str, rank: int, tag: str, tag0: str) -> Tuple[str, Optional[str]]:
    """``checkpoint.tag_validation`` when this rank's tag differs from rank 0's: (the tag to save under, an
    error). FAIL is an error on every rank; WARN logs the difference and IGNORE does not, and both save the
    one checkpoint under rank 0's tag (DeepSpeed would go on with a directory per tag)."""
    what = f"ranks disagree on the checkpoint tag (rank 0: {tag0!r}, rank {rank}: {tag!r})"
    if mode == "FAIL":
        return tag, f"{what}; pass the same tag (checkpoint.tag_validation is FAIL)"
    if mode == "WARN":
        logger.warning("%s: saving under rank 0's tag (checkpoint.tag_validation: WARN)", what)
    return tag0, None


def remove_leftovers(rank: int, mine: Optional[str], tmp: Optional[str]) -> None:
    """After a failed save: rank 0 removes the temporary directory it made, every other rank the file it
    wrote there (in case rank 0 is gone). Only ``*.tmp-*`` paths: never a committed checkpoint (after the
    commit's rename the temporary name no longer exists, and removing it does nothing)."""
    if mine is not None and ".tmp-" in os.path.basename(mine):
        shutil.rmtree(mine, ignore_errors=True)
    elif tmp is not None and ".tmp-" in os.path.basename(tmp):
        try:
            os.remove(os.path.join(tmp, rank_file(rank)))
        except OSError:
            pass
        try:
            os.rmdir(tmp)  # succeeds only if empty (rank 0's own cleanup may have raced with ours)
        except OSError:
            pass


@dataclass
class RankSave:
    """One rank's part of one save: where it goes and, once :func:`collect` ran, what it writes (tensors:
    the engine's own; an asynchronous save's device tensors as pinned host copies) and what rank 0 needs."""

    rank: int
    save_dir: str
    tmp: str
    tag: str
    save_latest: bool
    t0: float
    #: rank 0: the save folder's lock (:mod:`.save_lock`), checked before the commit
    lock: Optional[SaveLock] = None
    items: List[Tuple[str, Union[torch.Tensor, LazyTensor]]] = field(default_factory=list)
    entries: List[Entry] = field(default_factory=list)
    rng_keys: List[str] = field(default_factory=list)
    record: Dict[str, Any] = field(default_factory=dict)  # what every rank sends rank 0 (CRCs added on writing)
    meta: Dict[str, Any] = field(default_factory=dict)  # rank 0: the CheckpointMetadata fields of the whole
    common: bytes = b""  # rank 0: common.pt, serialised when collected (later changes do not reach it)
    #: called once this rank's file holds every tensor's bytes (before its fsync): an asynchronous save
    #: that reads the engine's host tensors in place lets the next optimizer step go on
    on_written: Optional[Callable[[], None]] = None

    @property
    def final(self) -> str:
        return os.path.join(self.save_dir, self.tag)


def collect(view: EngineView, job: RankSave, client_state: Optional[dict]) -> None:
    """Fill ``job`` from the engine: this rank's tensors, entries, RNG state and (rank 0) the common state."""
    items, entries, groups = _rank_items(view)
    rng_state = view.parts.rng.state_dict()
    rng_tensors = list(rng_state["tensors"].items())
    job.items, job.entries, job.rng_keys = items + rng_tensors, entries, [k for k, _ in rng_tensors]
    job.record = {"rank": view.rank, "file": rank_file(view.rank),
                  "tensors": {n: asdict(t) for n, t in _tensor_table(view).items()}, "aliases": view.aliases,
                  "groups": groups, "rng_py": rng_state["py"]}
    if view.rank == 0:
        buf = io.BytesIO()
        torch.save({"client_state": dict(client_state or {}), **view.common_state()}, buf)
        job.common = buf.getvalue()
        job.meta = {"world_size": view.world, "zero_stage": view.zero_stage,
                    "train_dtype": dtype_name(view.train_dtype), "optimizer": type(view.optimizer).__name__}


def write_and_commit(job: RankSave, coord: Coordination, collect_now: Optional[Callable[[], None]] = None) -> str:
    """Steps 2-4 of a save: this rank writes its file, rank 0 the metadata, rank 0 commits; ``coord``'s
    collectives between them make every rank fail together rather than hang. ``collect_now``: fill
    ``job`` first (a synchronous save reads the engine's tensors while writing them)."""
    # 2. every rank streams its own file
    record: Dict[str, Any] = {"rank": job.rank}
    try:
        if collect_now is not None:
            collect_now()
        written = write_safetensors(os.path.join(job.tmp, rank_file(job.rank)), job.items,
                                    metadata={"format": "pt", "shardspeed_rank": str(job.rank)}, rank=job.rank,
                                    on_written=job.on_written)
        for e in job.entries:
            if e.file:
                e.crc32 = written.tensor_crc32[e.key]
        rng_py = job.record.pop("rng_py")
        record.update(job.record, bytes=written.bytes, crc32=written.crc32, header_crc32=written.header_crc32,
                      entries=[e.to_json() for e in job.entries],
                      rng={"py": rng_py, "tensors": {k: written.tensor_crc32[k] for k in job.rng_keys}})
    except Exception as exc:  # report and let every rank fail together rather than hang
        record["error"] = f"rank {job.rank} could not write its checkpoint file: {type(exc).__name__}: {exc}"
    job.items = []  # an asynchronous save's snapshot is freed here
    if job.on_written is not None:  # (again, harmless) also when writing failed: the step must not wait on it
        job.on_written()
    maybe_crash("after_files", job.rank)
    records = coord.all_gather_object(record)
    coord.agree(next((r["error"] for r in records if r.get("error")), None))

    # 3. rank 0: common state, then metadata.json (its presence marks the directory complete)
    err = None
    if job.rank == 0:
        try:
            _write_rank0(job, records)
        except Exception as exc:
            err = f"rank 0 could not write the checkpoint metadata: {type(exc).__name__}: {exc}"
    maybe_crash("after_metadata", job.rank)
    coord.agree(err)  # doubles as the barrier: every file is durable before the rename

    # 4. rank 0 commits; the others wait so that the checkpoint exists when this returns
    err = None
    if job.rank == 0:
        try:
            if job.lock is not None:
                job.lock.check()
            commit(job.save_dir, job.tmp, job.tag, job.save_latest)
        except (OSError, CheckpointError) as exc:
            err = f"could not commit checkpoint {job.tmp} as {job.final}: {exc}"
    coord.agree(err)
    if job.rank == 0:
        total = sum(r["bytes"] for r in records)
        logger.info("saved checkpoint %s (%.1f MB in %d files) in %.2fs", job.final, total / 2**20,
                    len(records) + 2, time.perf_counter() - job.t0)
    return job.final


def _write_rank0(job: RankSave, records: List[dict]) -> None:
    files = {r["file"]: FileInfo(r["rank"], r["bytes"], r["crc32"], r["header_crc32"]) for r in records}
    files[COMMON_FILE] = FileInfo(0, len(job.common), write_file_synced(os.path.join(job.tmp, COMMON_FILE),
                                                                        job.common))
    groups: Dict[str, dict] = {}
    for r in records:
        for gi, hyper in r["groups"].items():
            groups.setdefault(str(gi), hyper)
    m = job.meta
    meta = CheckpointMetadata(
        tag=job.tag, world_size=m["world_size"], zero_stage=m["zero_stage"], train_dtype=m["train_dtype"],
        tensors={n: TensorInfo(**t) for r in records for n, t in r["tensors"].items()},  # every stage's
        aliases={a: t for r in records for a, t in r["aliases"].items()},
        entries=[Entry.from_json(e) for r in records for e in r["entries"]], files=files,
        optimizer={"class": m["optimizer"], "param_groups": groups},
        rng={str(r["rank"]): r["rng"] for r in records},
    )
    meta.locate_entries()  # layer index and N-D slice of every entry (format version 2)
    write_file_synced(os.path.join(job.tmp, METADATA_FILE), meta.to_json().encode())
    fsync_dir(job.tmp)
