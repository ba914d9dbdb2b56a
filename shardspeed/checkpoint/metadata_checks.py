"""Checks of a checkpoint's metadata before anything of it is read (it is untrusted input: docs/checkpoints.md,
"Security"): its files confined to its folder and of their recorded sizes, every file an entry reads listed,
checksums present from format 3 on, a sane tensor table (:func:`check_files`), and each entry a load uses
against the header of the tensor it points to (:func:`check_stored`)."""
from __future__ import annotations

import math
import os
from typing import Any, Dict, List, Mapping, Optional, Sequence

from ..errors import CheckpointError
from .format import NAME_TO_DTYPE, ShardReader, confined_path
from .metadata import (
    CHECKSUM_VERSION,
    COMMON_FILE,
    METADATA_FILE,
    WEIGHT,
    CheckpointMetadata,
    Entry,
    TensorInfo,
    rank_file,
)
from .slices import Spec, local_shape


def check_files(meta: CheckpointMetadata, ckpt_dir: str) -> None:
    """Before anything of the checkpoint is read: every file it lists is a plain name of a file inside
    ``ckpt_dir`` (symlinks resolved) with the size recorded at save time (one stat per file), every file
    an entry names is listed, from format 3 on every file and tensor carries its checksum, and the
    tensor table is sane (:func:`check_table`). Raises one line per problem."""
    where = os.path.join(ckpt_dir, METADATA_FILE)
    for name, info in sorted(meta.files.items()):
        path = confined_path(ckpt_dir, name, where)
        if not os.path.isfile(path):
            raise CheckpointError(f"checkpoint file {path} (written by rank {info.rank}) is missing")
        size = os.path.getsize(path)
        if size != info.bytes:
            raise CheckpointError(
                f"checkpoint file {path} (written by rank {info.rank}) has {size} bytes, expected {info.bytes}: "
                f"it is truncated or was overwritten"
            )
    named = _named_files(meta, where)
    if meta.version >= CHECKSUM_VERSION:
        _check_checksums(meta, named, where)
    check_table(meta, where)


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _named_files(meta: CheckpointMetadata, where: str) -> Dict[str, List[Optional[int]]]:
    """Per file an entry (or a rank's RNG state) reads from, the checksums recorded for its tensors; raises
    when one of those files is not listed under ``files`` (only listed files are read)."""
    named: Dict[str, List[Optional[int]]] = {}
    for e in meta.entries:
        if e.file or e.elementwise:  # "" only for a value kept in the metadata itself
            if e.file not in meta.files:
                raise CheckpointError(f"{where}: entry {e.tensor!r} ({e.state or 'weights'}) names the file "
                                      f"{e.file!r}, which is not listed under 'files'; the metadata is corrupt or "
                                      f"crafted")
            named.setdefault(e.file, []).append(e.crc32)
    for rank, rec in meta.rng.items():
        tensors = rec.get("tensors") if isinstance(rec, dict) else None
        if not tensors or not str(rank).isdigit():  # a loader reads rank r's state under the key str(r)
            continue
        file = rank_file(int(rank))
        if file not in meta.files or not isinstance(tensors, dict):
            raise CheckpointError(f"{where}: the RNG state of rank {rank!r} is in {file!r}, which is not listed "
                                  f"under 'files'; the metadata is corrupt or crafted")
        named.setdefault(file, []).extend(tensors.values())
    return named


def _check_checksums(meta: CheckpointMetadata, named: Dict[str, List[Optional[int]]], where: str) -> None:
    """Format 3 on: every file has its CRC-32, every file tensors are read from its header's, and every tensor
    its own (a null one would switch the check off)."""
    for name, info in sorted(meta.files.items()):
        if not _is_int(info.crc32) or (name in named and not _is_int(info.header_crc32)):
            raise CheckpointError(f"{where}: file {name!r} has a null or missing checksum (format version "
                                  f"{meta.version} records one for every file); the metadata is corrupt or crafted")
    for name, crcs in sorted(named.items()):
        if not all(_is_int(c) for c in crcs):
            raise CheckpointError(f"{where}: a tensor in {name!r} has a null or missing checksum (format version "
                                  f"{meta.version} records one for every tensor); the metadata is corrupt or crafted")


def check_table(meta: CheckpointMetadata, where: str) -> None:
    """The tensor table and the entries' ranges are sane: shapes of non-negative integers, known dtypes,
    ranges inside their tensor (or tensor-parallel slice), and no more elements claimed than the files hold
    bytes (every stored element takes at least one): so no reader allocates or writes more than the
    checkpoint holds."""
    total = 0
    for name, t in meta.tensors.items():
        if not isinstance(t.shape, list) or not all(_is_int(d) and d >= 0 for d in t.shape) \
                or t.dtype not in NAME_TO_DTYPE:
            raise CheckpointError(f"{where}: tensor {name!r} has shape {t.shape!r} and dtype {t.dtype!r}; the "
                                  f"metadata is corrupt or crafted")
        total += t.numel
    held = sum(max(int(info.bytes), 0) for n, info in meta.files.items() if n != COMMON_FILE)
    if total > held:
        raise CheckpointError(f"{where}: its tensors have {total} elements but its files hold {held} bytes; the "
                              f"metadata is corrupt or crafted")
    numel = {name: t.numel for name, t in meta.tensors.items()}
    for e in meta.entries:
        n = numel.get(e.tensor)
        if n is None:
            continue
        if e.tp is not None:
            shape = meta.tensors[e.tensor].shape
            n = math.prod(local_shape(shape, _checked_spec(e, shape, where)))
        if not 0 <= e.start <= e.end <= n:
            raise CheckpointError(f"{where}: entry {e.tensor!r} ({e.state or 'weights'}) covers [{e.start}, "
                                  f"{e.end}) of a tensor of {n} elements; the metadata is corrupt or crafted")


def _checked_spec(e: Entry, shape: Sequence[int], where: str) -> Spec:
    spec = e.spec
    if spec is None:
        return None
    dim, blocks, rank, size = spec
    if not (0 <= dim < len(shape) and blocks >= 1 and size >= 1 and 0 <= rank < size
            and shape[dim] % (blocks * size) == 0):
        raise CheckpointError(f"{where}: entry {e.tensor!r} ({e.state or 'weights'}) has the tensor-parallel slice "
                              f"{list(spec)} of shape {list(shape)}; the metadata is corrupt or crafted")
    return spec


def check_stored(reader: ShardReader, entries: Sequence[Entry], tensors: Mapping[str, TensorInfo]) -> None:
    """Entries a reader is about to use, against the tensors their files' headers describe (only headers
    are read): an elementwise entry's stored tensor has exactly ``end - start`` elements, Adam's ``step``
    is one number, and a weight's stored dtype is of its tensor's kind (floating point, or exactly its
    dtype). So nothing is broadcast, cut short or refused half-way through a load or an export."""
    def what(e: Entry) -> str:
        return f"checkpoint {reader.root}: entry {e.tensor!r} ({e.state or 'weights'}) [{e.start}, {e.end})"

    for e in entries:
        if not e.file:
            continue
        shape, dtype = reader.stored(e.file, e.key)
        n = math.prod(shape)
        if (e.elementwise and n != e.end - e.start) or (e.state == "step" and not e.elementwise and n != 1):
            raise CheckpointError(f"{what(e)} names tensor {e.key!r} of {e.file}, which holds {n} element(s); the "
                                  f"metadata does not match the file (corrupt or crafted)")
        info = tensors.get(e.tensor) if e.state == WEIGHT else None
        want = NAME_TO_DTYPE.get(info.dtype) if info is not None else None
        if want is not None and want != dtype and (want.is_floating_point != dtype.is_floating_point
                                                   or not want.is_floating_point):
            raise CheckpointError(f"{what(e)} names tensor {e.key!r} of {e.file}, stored as {dtype}, for a tensor "
                                  f"of dtype {want}; the metadata does not match the file (corrupt or crafted)")
