"""Atomic commit of a checkpoint directory, and finding the committed one when loading.

Protocol (rank 0 does the renames; the directory must be on a file system every rank sees):

1. all ranks write into ``{save_dir}/{tag}.tmp-{uuid}/`` and fsync their files;
2. rank 0 writes ``metadata.json`` last (fsync file and directory) once it has every rank's record;
3. rank 0 moves an existing ``{tag}`` aside to ``{tag}.old-{uuid}``, renames the temporary directory to
   ``{tag}``, fsyncs ``save_dir`` and removes the old one;
4. rank 0 writes ``latest`` through a temporary file and ``os.replace``.

A kill before step 3 leaves the previous checkpoint and ``latest`` untouched (the temporary directory is
garbage, removed by the next save). A kill between the two renames of step 3 leaves ``{tag}`` absent and
``{tag}.old-{uuid}`` complete: :func:`resolve` falls back to it. A kill before step 4 leaves ``latest``
naming the previous tag, which still exists.
"""
from __future__ import annotations

import glob
import os
import shutil
import uuid
from typing import TYPE_CHECKING, Optional

from ..errors import CheckpointError
from .format import fsync_dir, maybe_crash, write_bytes_atomic
from .metadata import METADATA_FILE

if TYPE_CHECKING:
    from .save_lock import SaveLock

LATEST = "latest"


def new_temp_dir(save_dir: str, tag: str) -> str:
    return os.path.join(save_dir, f"{tag}.tmp-{uuid.uuid4().hex[:12]}")


def remove_stale(save_dir: str, lock: SaveLock) -> None:
    """Remove leftovers of interrupted saves: temporary directories, and moved-aside old copies whose tag
    was committed after all. Called by rank 0 at the start of a save, holding the folder's save ``lock``
    (:mod:`.save_lock`): another job's save in progress is never taken for a leftover."""
    lock.check()
    for path in glob.glob(os.path.join(save_dir, "*.tmp-*")):
        if os.path.isdir(path):
            shutil.rmtree(path, ignore_errors=True)
    for path in glob.glob(os.path.join(save_dir, "*.old-*")):
        tag = os.path.basename(path).rsplit(".old-", 1)[0]
        if os.path.isfile(os.path.join(save_dir, tag, METADATA_FILE)):
            shutil.rmtree(path, ignore_errors=True)


def commit(save_dir: str, tmp_dir: str, tag: str, save_latest: bool) -> str:
    """Rank 0: make ``tmp_dir`` the checkpoint ``tag`` (replacing an old one of that tag), then ``latest``."""
    final = os.path.join(save_dir, tag)
    old = None
    if os.path.lexists(final):
        old = f"{final}.old-{uuid.uuid4().hex[:12]}"
        os.rename(final, old)
        fsync_dir(save_dir)
        maybe_crash("after_move_old", 0)
    os.rename(tmp_dir, final)
    fsync_dir(save_dir)
    maybe_crash("after_rename", 0)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
    if save_latest:
        write_bytes_atomic(os.path.join(save_dir, LATEST), tag.encode())
    return final


def read_latest(load_dir: str) -> Optional[str]:
    path = os.path.join(load_dir, LATEST)
    if not os.path.isfile(path):
        return None
    with open(path) as f:
        tag = f.read().strip()
    return tag or None


def resolve(load_dir: str, tag: str) -> str:
    """The directory holding committed checkpoint ``tag``: ``{tag}``, or a complete ``{tag}.old-*`` left by a
    save that was killed between its two renames."""
    final = os.path.join(load_dir, tag)
    if os.path.isfile(os.path.join(final, METADATA_FILE)):
        return final
    olds = [p for p in glob.glob(os.path.join(glob.escape(load_dir), glob.escape(tag) + ".old-*"))
            if os.path.isfile(os.path.join(p, METADATA_FILE))]
    if olds:
        return max(olds, key=os.path.getmtime)
    if os.path.isdir(final):
        raise CheckpointError(f"{final} has no {METADATA_FILE}: it is not a complete shardspeed checkpoint")
    raise CheckpointError(f"checkpoint {tag!r} not found in {load_dir}")
