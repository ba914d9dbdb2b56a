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
from .format import fsync_dir, is_plain_name, maybe_crash, write_bytes_atomic
from .metadata import METADATA_FILE

if TYPE_CHECKING:
    from .save_lock import SaveLock

LATEST = "latest"
#: the most bytes read from a ``latest`` file (a tag is one directory name: at most 255 bytes on Linux)
LATEST_MAX_BYTES = 4096


def check_tag(tag: object, where: str = "") -> str:
    """``tag`` as a string when it is a plain directory name inside the save directory; raises a one-line
    :class:`CheckpointError` otherwise. The one check for every tag, whether given (``save_checkpoint``,
    ``load_checkpoint(tag=)``, ``convert --tag/--out-tag``, ``consolidate --tag``) or read (``latest``):
    no path separator, not ``.``/``..``/empty (so ``{dir}/{tag}`` stays in ``{dir}``), none of the suffixes
    a save uses for its temporary and moved-aside copies, not ``latest``, and no control characters or
    leading/trailing whitespace (``latest`` is stripped when read, by us as by DeepSpeed, so such a tag
    could never be found again). ``where``: what the tag came from, for the message."""
    tag = str(tag)
    bad = (not is_plain_name(tag) or tag == LATEST or ".tmp-" in tag or ".old-" in tag
           or tag != tag.strip() or any(ord(c) < 32 or ord(c) == 127 for c in tag))
    if bad:
        src = f"{where} names an" if where else "an"
        raise CheckpointError(f"{src} invalid checkpoint tag {tag!r}: use a plain "
                              f"directory name such as 'global_step100' (no '/', '..', whitespace at either end "
                              f"or control characters)")
    return tag


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
    """The tag ``{load_dir}/latest`` names (checked by :func:`check_tag`), or None when there is no such file."""
    path = os.path.join(load_dir, LATEST)
    if not os.path.isfile(path):
        return None
    try:
        with open(path, "rb") as f:
            raw = f.read(LATEST_MAX_BYTES + 1)
        text = raw.decode("utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise CheckpointError(f"{path} cannot be read as a tag ({exc}); pass the tag explicitly") from None
    if len(raw) > LATEST_MAX_BYTES:
        raise CheckpointError(f"{path} is over {LATEST_MAX_BYTES} bytes: it names no checkpoint tag; pass the tag "
                              f"explicitly")
    return check_tag(text.strip(), where=path)


def resolve(load_dir: str, tag: str) -> str:
    """The directory holding committed checkpoint ``tag``: ``{tag}``, or a complete ``{tag}.old-*`` left by a
    save that was killed between its two renames. ``tag`` must pass :func:`check_tag`."""
    tag = check_tag(tag)
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
