"""DeepSpeed (ZeRO 0-3 or universal) → our checkpoint format, streamed: each parameter's weights and
moments are assembled from DeepSpeed's partitions and written one tensor at a time (memory holds one
tensor, not the model: ``zero_to_fp32`` needs the whole model in host RAM). The result is an ordinary
shardspeed checkpoint (one rank file, committed atomically), loadable at any world size and stage."""
from __future__ import annotations

import io
import logging
import os
import shutil
from typing import List, Optional, Tuple, Union

import torch

from ...errors import CheckpointError
from ..commit import check_tag, commit, new_temp_dir, read_latest
from ..format import NAME_TO_DTYPE, LazyTensor, fsync_dir, write_file_synced, write_safetensors
from ..metadata import COMMON_FILE, METADATA_FILE, WEIGHT, CheckpointMetadata, Entry, FileInfo
from ..ranges import EntryIndex, read_range
from ..save_lock import SaveLock
from .source import DeepSpeedSource
from .universal import open_deepspeed

logger = logging.getLogger("shardspeed")
RANK_FILE = "rank00000.safetensors"


def _items(src: DeepSpeedSource) -> Tuple[List[Tuple[str, Union[torch.Tensor, LazyTensor]]], List[Entry]]:
    """One lazy tensor per (tensor, state) of the source: read when the writer reaches it."""
    index = EntryIndex(src.meta.entries, src.meta.shapes)
    items: List[Tuple[str, Union[torch.Tensor, LazyTensor]]] = []
    entries: List[Entry] = []
    for name, info in src.meta.tensors.items():
        n = info.numel
        dtype = NAME_TO_DTYPE.get(info.dtype, torch.float32)
        states = [WEIGHT] + index.states_of(name)
        for state in states:
            found = index.entries_of(name, state)
            if not found:
                continue
            key = f"{'w' if state == WEIGHT else 'o/' + state}/{name}/0"
            if not found[0].elementwise:
                e = found[0]
                t = src.reader.read(e.file, e.key)
                items.append((key, t))
                entries.append(Entry(name, state, 0, n, RANK_FILE, key, elementwise=False))
                continue
            dt = dtype if state == WEIGHT else torch.float32

            def make(name=name, state=state, n=n, dt=dt) -> torch.Tensor:
                return read_range(src.reader, index, name, state, 0, n, dtype=dt)

            items.append((key, LazyTensor((n,), dt, make)))
            entries.append(Entry(name, state, 0, n, RANK_FILE, key))
    return items, entries


def import_deepspeed(load_dir: str, save_dir: str, tag: Optional[str] = None, out_tag: Optional[str] = None,
                     trust_pickles: bool = False) -> str:
    """Write DeepSpeed's checkpoint ``load_dir/tag`` (default: its ``latest``) as our checkpoint
    ``save_dir/out_tag`` (default: the same tag) and point ``save_dir/latest`` at it. Returns its path.
    ``trust_pickles``: unpickle any global its files name (:func:`~.universal.open_deepspeed`)."""
    tag = tag or read_latest(load_dir)
    if tag is None:
        raise CheckpointError(f"{load_dir} has no 'latest' file; pass the tag to convert")
    out_tag = check_tag(tag if out_tag is None else out_tag)  # before anything is read or written
    src = open_deepspeed(load_dir, tag, trust_pickles=trust_pickles)
    if src is None:
        raise CheckpointError(f"{os.path.join(load_dir, tag)} is not a DeepSpeed checkpoint (no "
                              f"mp_rank_00_model_states.pt or zero_pp_rank_0_mp_rank_00_model_states.pt)")
    os.makedirs(save_dir, exist_ok=True)
    lock = SaveLock.acquire(save_dir, out_tag)  # one writer at a time into save_dir (a training job's saves too)
    tmp = new_temp_dir(save_dir, out_tag)
    try:
        os.makedirs(tmp)
        items, entries = _items(src)
        written = write_safetensors(os.path.join(tmp, RANK_FILE), items, metadata={"format": "pt"})
        del items
        for e in entries:
            e.crc32 = written.tensor_crc32[e.key]
        buf = io.BytesIO()
        torch.save(src.common, buf)
        data = buf.getvalue()
        files = {RANK_FILE: FileInfo(0, written.bytes, written.crc32, written.header_crc32),
                 COMMON_FILE: FileInfo(0, len(data), write_file_synced(os.path.join(tmp, COMMON_FILE), data))}
        m = src.meta
        meta = CheckpointMetadata(tag=out_tag, world_size=m.world_size, zero_stage=m.zero_stage,
                                  train_dtype=m.train_dtype, tensors=m.tensors, aliases=m.aliases, entries=entries,
                                  files=files, optimizer=m.optimizer)
        meta.locate_entries()
        write_file_synced(os.path.join(tmp, METADATA_FILE), meta.to_json().encode())
        fsync_dir(tmp)
        lock.check()
        final = commit(save_dir, tmp, out_tag, save_latest=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    finally:
        lock.release()
        src.reader.close()
    logger.info("converted DeepSpeed checkpoint %s to %s", src.path, final)
    return final
