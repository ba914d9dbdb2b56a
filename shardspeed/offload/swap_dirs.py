"""NVMe swap folders: the checked ``nvme_path`` and one folder per job, rank, attempt and process.

``nvme_path/shardspeed-swap-<job>/rank<R>-attempt<A>-pid<P>-<host>/<kind>-*`` (:func:`make_swap_dir`),
where the job is torchrun's ``TORCHELASTIC_RUN_ID`` (else a hash of ``MASTER_ADDR:MASTER_PORT``, else
``local``) and the attempt its ``TORCHELASTIC_RESTART_COUNT``. A new folder's maker first removes the
folders of its own job and rank left by dead processes or older attempts (:func:`remove_dead_swap`);
:func:`remove_swap_dir` deletes a folder and its emptied parents.
"""
from __future__ import annotations

import hashlib
import logging
import os
import re
import shutil
import socket
import tempfile
from typing import List, Tuple

from ..errors import ConfigError

logger = logging.getLogger("shardspeed")


def check_nvme_path(path: str, needed_bytes: int, what: str = "the optimizer state") -> str:
    """Create ``path`` if needed and check it is a writable directory with room for ``needed_bytes``.

    Raises :class:`ConfigError` naming the problem and the fix. Returns the absolute path.
    """
    path = os.path.abspath(os.path.expanduser(path))
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as e:
        raise ConfigError(f"offload nvme_path {path!r} cannot be created ({e.strerror}); give an existing, "
                          f"writable directory on a local disk") from e
    if not os.path.isdir(path):
        raise ConfigError(f"offload nvme_path {path!r} is not a directory")
    if not os.access(path, os.W_OK | os.X_OK):
        raise ConfigError(f"offload nvme_path {path!r} is not writable by this process (uid {os.getuid()}); "
                          f"fix its permissions or choose another directory")
    free = shutil.disk_usage(path).free
    if free < needed_bytes:
        raise ConfigError(f"offload nvme_path {path!r} has {free / 2**30:.2f} GiB free; this rank "
                          f"needs {needed_bytes / 2**30:.2f} GiB for {what}: free space or choose another disk")
    return path


_RANK_DIR = re.compile(r"^rank(\d+)-attempt(\d+)-pid(\d+)-(.+)$")


def _safe_name(text: str, limit: int = 64) -> str:
    safe = re.sub(r"[^A-Za-z0-9._-]", "_", text)
    return safe if len(safe) <= limit else hashlib.sha1(text.encode()).hexdigest()[:16]


def swap_job_id() -> str:
    """This job's name in swap folder names: torchrun's ``TORCHELASTIC_RUN_ID`` (the same in every attempt of
    an elastic job; its default ``none`` does not count), else a hash of ``MASTER_ADDR:MASTER_PORT``, else
    ``local``."""
    run = os.environ.get("TORCHELASTIC_RUN_ID", "")
    if run and run != "none":
        return _safe_name(run)
    addr, port = os.environ.get("MASTER_ADDR", ""), os.environ.get("MASTER_PORT", "")
    if addr and port:
        return "m" + hashlib.sha1(f"{addr}:{port}".encode()).hexdigest()[:12]
    return "local"


def swap_attempt() -> int:
    """torchrun's ``TORCHELASTIC_RESTART_COUNT`` (0 without torchrun)."""
    value = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    return int(value) if value.isdigit() else 0


def _host() -> str:
    return _safe_name(socket.gethostname() or "host")


def _alive(pid: int) -> bool:
    """Whether process ``pid`` of this host is running (a zombie is not)."""
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except FileNotFoundError:
        return False
    except (OSError, IndexError):
        return True


def _tree_bytes(path: str) -> int:
    total = 0
    for d, _, files in os.walk(path):
        for name in files:
            try:
                total += os.lstat(os.path.join(d, name)).st_size
            except OSError:
                pass
    return total


def remove_dead_swap(job_dir: str, rank: int, attempt: int) -> List[Tuple[str, int]]:
    """Remove the swap folders of ``rank`` in ``job_dir`` (this job's) made on this host by a process that is
    gone or by an older attempt; never this process's own, another rank's, another host's or another job's.
    Logs one line naming each removed folder and its bytes; returns ``(path, bytes)`` of each."""
    try:
        entries = sorted(os.listdir(job_dir))
    except OSError:
        return []
    host, me = _host(), os.getpid()
    removed: List[Tuple[str, int]] = []
    for name in entries:
        m = _RANK_DIR.match(name)
        if m is None or int(m[1]) != rank or m[4] != host:
            continue
        a, pid = int(m[2]), int(m[3])
        if pid == me or (a >= attempt and _alive(pid)):
            continue
        path = os.path.join(job_dir, name)
        nbytes = _tree_bytes(path)
        shutil.rmtree(path, ignore_errors=True)
        removed.append((path, nbytes))
    if removed:
        logger.warning("NVMe swap: removed %d folder(s) that dead attempts of this job left for rank %d: %s",
                       len(removed), rank, "; ".join(f"{p} ({n} bytes, {n / 2**30:.2f} GiB)" for p, n in removed))
    return removed


def make_swap_dir(nvme_path: str, kind: str, rank: int, needed_bytes: int, what: str) -> Tuple[str, str]:
    """Check ``nvme_path`` (:func:`check_nvme_path`), remove this job's dead swap folders of ``rank``
    (:func:`remove_dead_swap`, before the free-space check counts them) and make a fresh folder
    ``<nvme_path>/shardspeed-swap-<job>/rank<R>-attempt<A>-pid<P>-<host>/<kind>-*``. Returns
    ``(nvme_path as an absolute path, the new folder)``; :func:`remove_swap_dir` undoes it."""
    root = check_nvme_path(nvme_path, 0, what)
    job_dir = os.path.join(root, f"shardspeed-swap-{swap_job_id()}")
    attempt = swap_attempt()
    remove_dead_swap(job_dir, rank, attempt)
    check_nvme_path(root, needed_bytes, what)
    rank_dir = os.path.join(job_dir, f"rank{rank}-attempt{attempt}-pid{os.getpid()}-{_host()}")
    for tries in range(3):
        try:
            os.makedirs(rank_dir, exist_ok=True)
            return root, tempfile.mkdtemp(prefix=f"{kind}-", dir=rank_dir)
        except FileNotFoundError:  # an engine closing meanwhile removed the empty parent: make it again
            if tries == 2:
                raise
        except OSError as e:
            raise ConfigError(f"offload nvme_path {root!r}: cannot create the swap folder {rank_dir!r} "
                              f"({e.strerror})") from e
    raise AssertionError("unreachable")


def remove_swap_dir(directory: str) -> None:
    """Delete a folder of :func:`make_swap_dir`, and its rank and job folders once they are empty."""
    shutil.rmtree(directory, ignore_errors=True)
    parent = os.path.dirname(directory)
    for d in (parent, os.path.dirname(parent)):
        try:
            os.rmdir(d)
        except OSError:  # still holds another engine's folder (or is gone)
            break
