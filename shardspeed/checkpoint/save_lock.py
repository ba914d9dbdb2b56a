"""One writer per checkpoint folder: a lock file that rank 0 holds for the whole of a save.

Two jobs saving into one folder would each remove the other's temporary folder as a leftover
(:func:`.commit.remove_stale`) and move ``latest`` back and forth. Rank 0 therefore creates
``{save_dir}/.shardspeed-save.lock`` (``O_EXCL``: exactly one creator wins) holding its host, pid, the time
and the tag, before touching anything else in the folder, and deletes it once the save is committed or
has failed (an asynchronous save: once its background commit is done). A save that finds the file raises a
:class:`~shardspeed.errors.CheckpointError` naming the owner, unless the owner is certainly gone:

- it ran on this host and its process no longer exists (a killed job): the lock is taken over, with a
  warning;
- it was an earlier attempt of this same elastic job (torchrun's ``TORCHELASTIC_RUN_ID``, a lower
  ``TORCHELASTIC_RESTART_COUNT``): torchrun stops every worker of an attempt before the next one starts.

A lock left on another host by a process that is gone cannot be told from a live one: the error says to
delete the file once no job is saving there.
"""
from __future__ import annotations

import json
import logging
import os
import time
from typing import Any, Dict, Optional

from ..errors import CheckpointError
from ..utils.safe_files import create_new, host_name, process_alive

logger = logging.getLogger("shardspeed")

LOCK_FILE = ".shardspeed-save.lock"


def _elastic_job() -> Dict[str, Any]:
    run = os.environ.get("TORCHELASTIC_RUN_ID", "")
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    if not run or run == "none":
        return {}
    return {"job": run, "attempt": int(attempt) if attempt.isdigit() else 0}


def _read(path: str) -> Optional[bytes]:
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
    except FileNotFoundError:
        return None
    except OSError:  # a link, unreadable: not a lock of ours, and not ours to judge
        return b""
    try:
        return os.read(fd, 1 << 16)
    finally:
        os.close(fd)


def _owner(data: bytes) -> Dict[str, Any]:
    try:
        owner = json.loads(data)
    except ValueError:
        return {}
    return owner if isinstance(owner, dict) else {}


def _describe(owner: Dict[str, Any]) -> str:
    if not owner:
        return "an unknown writer (the lock file is empty or unreadable)"
    return (f"host {owner.get('host')!r} pid {owner.get('pid')} (tag {owner.get('tag')!r}, since "
            f"{owner.get('time')})")


def _gone(owner: Dict[str, Any]) -> Optional[str]:
    """Why the lock's owner is certainly not running any more, or None."""
    me = _elastic_job()
    pid = owner.get("pid")
    if owner.get("host") == host_name() and isinstance(pid, int) and not process_alive(pid):
        return "its process is gone"
    if me and owner.get("job") == me["job"] and isinstance(owner.get("attempt"), int) \
            and owner["attempt"] < me["attempt"]:
        return f"it was attempt {owner['attempt']} of this elastic job, now at attempt {me['attempt']}"
    return None


class SaveLock:
    """The lock of one save folder, held by this process (:meth:`acquire`; :meth:`release`)."""

    def __init__(self, path: str, content: bytes):
        self.path = path
        self.content = content
        self.held = True

    @classmethod
    def acquire(cls, save_dir: str, tag: str) -> SaveLock:
        """Create the lock of ``save_dir`` (which must exist), taking over one whose owner is gone; a live
        owner's raises a :class:`CheckpointError` naming it. Other ``OSError`` (a read-only or full disk)
        propagate."""
        path = os.path.join(save_dir, LOCK_FILE)
        record = {"host": host_name(), "pid": os.getpid(), "tag": tag,
                  "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), **_elastic_job()}
        content = json.dumps(record).encode()
        for _ in range(3):
            try:
                fd = create_new(path, os.O_WRONLY, 0o644)
            except FileExistsError:
                found = _read(path)
                if found is None:  # released meanwhile: try again
                    continue
                owner = _owner(found)
                why = _gone(owner)
                if why is None:
                    raise CheckpointError(
                        f"another job is saving into {save_dir}: its lock {path} is held by {_describe(owner)}. "
                        f"Give each job its own save folder, or delete the lock once no job saves there") from None
                _take_over(path, found, owner, why)
                continue
            try:
                os.write(fd, content)
                os.fsync(fd)
            except BaseException:
                os.close(fd)
                os.remove(path)
                raise
            os.close(fd)
            return cls(path, content)
        raise CheckpointError(f"could not take the lock {path}: other writers keep taking it; give each job "
                              f"its own save folder")

    def check(self) -> None:
        """Raise a :class:`CheckpointError` unless this process still holds the lock (its file is ours)."""
        found = _read(self.path) if self.held else None
        if found != self.content:
            raise CheckpointError(f"the save lock {self.path} is no longer this process's (now "
                                  f"{_describe(_owner(found or b''))}): another job saves into this folder")

    def release(self) -> None:
        """Delete the lock file if it is still ours (idempotent)."""
        if not self.held:
            return
        self.held = False
        if _read(self.path) == self.content:
            try:
                os.remove(self.path)
            except FileNotFoundError:
                pass
        else:
            logger.warning("save lock %s was taken by another writer during this save", self.path)


def _take_over(path: str, found: bytes, owner: Dict[str, Any], why: str) -> None:
    """Remove the stale lock ``path`` whose content was ``found``: moved aside under a new name first, so
    that a lock another process created meanwhile is put back rather than deleted."""
    aside = f"{path}.stale-{os.getpid()}-{os.urandom(4).hex()}"
    try:
        os.rename(path, aside)
    except FileNotFoundError:
        return
    if _read(aside) != found:  # not the one judged stale: a new owner's; put it back
        try:
            os.link(aside, path)
        except OSError:
            pass
        os.remove(aside)
        return
    os.remove(aside)
    logger.warning("checkpoint save lock %s: took over the lock of %s (%s)", path, _describe(owner), why)
