"""NVMe swap folders: the checked ``nvme_path`` and one private folder per job, rank, attempt and process.

``nvme_path/shardspeed-swap-<job>/rank<R>-attempt<A>-pid<P>-<host>/<kind>-*`` (:func:`make_swap_dir`),
where the job is torchrun's ``TORCHELASTIC_RUN_ID`` (else a hash of ``MASTER_ADDR:MASTER_PORT``, else
``local``) and the attempt its ``TORCHELASTIC_RESTART_COUNT``.

- **Owned and private.** The job and rank folders are made with mode 0o700 and, before use, must be real
  folders of this user that nobody else can write (:func:`check_private_dir`); ``nvme_path`` itself must
  belong to this user or root, and be writable by others only with the sticky bit (as ``/tmp``). Else a
  :class:`~shardspeed.errors.ConfigError` names the folder and what is wrong: a folder another user made
  first at the predictable name is refused, not used.
- **Owned by a live process.** Each ``<kind>-*`` folder holds ``owner.lock``, locked (``flock``) by the
  process that made it for as long as the folder is in use (:class:`SwapDir`). A new folder's maker first
  removes, under the whole ``nvme_path`` (every job: ``shardspeed run`` gives each launch a new job id),
  the folders made on this host whose owner is gone: the lock is free, or (a folder without the file)
  the process named in the rank folder no longer exists; and, of its own job and rank, those of older
  attempts (:func:`remove_dead_swap`). One log line names them.
:func:`remove_swap_dir` deletes a folder and its emptied parents.
"""
from __future__ import annotations

import fcntl
import hashlib
import logging
import os
import re
import shutil
import stat
import tempfile
from typing import List, Optional, Tuple

from ..errors import ConfigError
from ..utils.safe_files import create_new, host_name, process_alive

logger = logging.getLogger("shardspeed")

#: The file in each swap folder that its live owner holds locked.
OWNER_FILE = "owner.lock"
JOB_PREFIX = "shardspeed-swap-"


def check_nvme_path(path: str, needed_bytes: int, what: str = "the optimizer state") -> str:
    """Create ``path`` if needed and check it is a writable directory with room for ``needed_bytes``.

    Raises :class:`ConfigError` naming the problem and the fix. Returns the absolute path.
    """
    path = os.path.abspath(os.path.expanduser(path))
    try:
        os.makedirs(path, mode=0o700, exist_ok=True)
    except OSError as e:
        raise ConfigError(f"offload nvme_path {path!r} cannot be created ({e.strerror}); give an existing, "
                          f"writable directory on a local disk") from e
    if not os.path.isdir(path):
        raise ConfigError(f"offload nvme_path {path!r} is not a directory")
    if not os.access(path, os.W_OK | os.X_OK):
        raise ConfigError(f"offload nvme_path {path!r} is not writable by this process (uid {os.getuid()}); "
                          f"fix its permissions or choose another directory")
    _check_root(path)
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
    return _safe_name(host_name())


def _check_root(path: str) -> None:
    """``nvme_path`` belongs to this user or root, and others may write into it only with the sticky bit
    (then nobody else can rename or delete the swap folders in it)."""
    st = os.stat(path)
    if st.st_uid not in (os.geteuid(), 0):
        raise ConfigError(f"offload nvme_path {path!r} is owned by uid {st.st_uid}, not this user (uid "
                          f"{os.geteuid()}) or root: use a folder of your own")
    if st.st_mode & 0o022 and not st.st_mode & stat.S_ISVTX:
        raise ConfigError(f"offload nvme_path {path!r} is writable by other users (mode "
                          f"{stat.S_IMODE(st.st_mode):#o}) without the sticky bit, so they could replace the "
                          f"swap folders in it: `chmod +t` or `chmod go-w` it, or use a folder of your own")


def check_private_dir(path: str) -> None:
    """Raise a :class:`ConfigError` unless ``path`` is a folder (not a link) of this user that no one else
    may write into."""
    st = os.lstat(path)
    problem = None
    if stat.S_ISLNK(st.st_mode) or not stat.S_ISDIR(st.st_mode):
        problem = "is not a folder (a symbolic link or a file is there)"
    elif st.st_uid != os.geteuid():
        problem = f"is owned by uid {st.st_uid}, not this user (uid {os.geteuid()}): another user made it"
    elif st.st_mode & 0o022:
        problem = f"is writable by other users (mode {stat.S_IMODE(st.st_mode):#o})"
    if problem:
        raise ConfigError(f"offload nvme_path: the swap folder {path} {problem}; shardspeed swaps only into "
                          f"folders it made for this user (mode 0o700): remove it, or choose another nvme_path")


def _make_private(path: str) -> None:
    """Make the folder ``path`` (mode 0o700) unless it exists, then :func:`check_private_dir` it."""
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        pass
    check_private_dir(path)


def _tree_bytes(path: str) -> int:
    total = 0
    for d, _, files in os.walk(path):
        for name in files:
            try:
                total += os.lstat(os.path.join(d, name)).st_size
            except OSError:
                pass
    return total


def _owner_gone(folder: str, pid: int) -> Tuple[bool, Optional[int]]:
    """Whether ``folder``'s owner is gone, and a descriptor holding its owner lock (None without the file):
    kept until the folder is removed. Without the owner file (a folder being made, or made by an older
    version), the owner is gone when process ``pid`` of this host is."""
    try:
        fd = os.open(os.path.join(folder, OWNER_FILE), os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError:
        return not process_alive(pid), None
    except OSError:  # a link or unreadable: not a folder of ours to judge
        return False, None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:  # held: its owner lives
        os.close(fd)
        return False, None
    return True, fd


def _reclaim_rank_dir(rank_dir: str, pid: int, older: bool) -> List[Tuple[str, int]]:
    """Remove the ``<kind>-*`` folders of ``rank_dir`` whose owner is gone (all of them with ``older``),
    then ``rank_dir`` itself once empty and its process gone."""
    removed: List[Tuple[str, int]] = []
    for name in sorted(os.listdir(rank_dir)):
        folder = os.path.join(rank_dir, name)
        gone, fd = (True, None) if older else _owner_gone(folder, pid)
        if not gone:
            continue
        try:
            nbytes = _tree_bytes(folder)
            shutil.rmtree(folder, ignore_errors=True)
            removed.append((folder, nbytes))
        finally:
            if fd is not None:
                os.close(fd)
    if older or not process_alive(pid):
        try:
            os.rmdir(rank_dir)
        except OSError:  # not empty: a live owner's folder is still in it
            pass
    return removed


def remove_dead_swap(root: str, rank: int, attempt: int) -> List[Tuple[str, int]]:
    """Remove the swap folders under ``root`` (every job's) made on this host whose owner is gone, and the
    folders of this job's ``rank`` made by an older attempt; never this process's, another host's (its
    processes cannot be judged from here) or one not owned by this user. Logs one line naming each removed
    folder and its bytes; returns ``(path, bytes)`` of each."""
    host, me, job = _host(), os.getpid(), JOB_PREFIX + swap_job_id()
    removed: List[Tuple[str, int]] = []
    try:
        jobs = sorted(n for n in os.listdir(root) if n.startswith(JOB_PREFIX))
    except OSError:
        return []
    for job_name in jobs:
        job_dir = os.path.join(root, job_name)
        try:
            check_private_dir(job_dir)
            entries = sorted(os.listdir(job_dir))
        except (ConfigError, OSError):  # another user's, or gone meanwhile: not ours to clean
            continue
        for name in entries:
            m = _RANK_DIR.match(name)
            if m is None or m[4] != host or int(m[3]) == me:
                continue
            rank_dir = os.path.join(job_dir, name)
            try:
                check_private_dir(rank_dir)
                older = job_name == job and int(m[1]) == rank and int(m[2]) < attempt
                removed += _reclaim_rank_dir(rank_dir, int(m[3]), older)
            except (ConfigError, OSError):
                continue
        if job_name != job:
            try:
                os.rmdir(job_dir)
            except OSError:
                pass
    if removed:
        logger.warning("NVMe swap (rank %d): removed %d swap folder(s) under %s whose process is gone (a killed "
                       "run or an older attempt): %s", rank, len(removed), root,
                       "; ".join(f"{p} ({n} bytes, {n / 2**30:.2f} GiB)" for p, n in removed))
    return removed


class SwapDir:
    """A private swap folder of this process (:func:`make_swap_dir`), its owner lock held until
    :meth:`remove`."""

    def __init__(self, root: str, path: str, owner_fd: int):
        self.root, self.path, self._owner_fd = root, path, owner_fd

    def remove(self) -> None:
        """Delete the folder (:func:`remove_swap_dir`), then let its owner lock go (idempotent)."""
        remove_swap_dir(self.path)
        fd, self._owner_fd = self._owner_fd, -1
        if fd >= 0:
            os.close(fd)


def _hold_owner(folder: str) -> int:
    """Create ``folder``'s owner file and lock it for as long as the returned descriptor is open. The file
    gets its name only once locked: a sweep never finds it free while its owner lives."""
    new = os.path.join(folder, f".{OWNER_FILE}.new")
    fd = create_new(new, os.O_RDWR, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        os.write(fd, f"{host_name()} {os.getpid()}\n".encode())
        os.rename(new, os.path.join(folder, OWNER_FILE))
    except BaseException:
        os.close(fd)
        raise
    return fd


def make_swap_dir(nvme_path: str, kind: str, rank: int, needed_bytes: int, what: str) -> SwapDir:
    """Check ``nvme_path`` (:func:`check_nvme_path`), remove the swap folders whose owner is gone
    (:func:`remove_dead_swap`, before the free-space check counts them) and make a fresh private folder
    ``<nvme_path>/shardspeed-swap-<job>/rank<R>-attempt<A>-pid<P>-<host>/<kind>-*``, owned by this process
    (its ``owner.lock`` locked). :meth:`SwapDir.remove` undoes it."""
    root = check_nvme_path(nvme_path, 0, what)
    job_dir = os.path.join(root, f"{JOB_PREFIX}{swap_job_id()}")
    _make_private(job_dir)
    attempt = swap_attempt()
    remove_dead_swap(root, rank, attempt)
    check_nvme_path(root, needed_bytes, what)
    rank_dir = os.path.join(job_dir, f"rank{rank}-attempt{attempt}-pid{os.getpid()}-{_host()}")
    for tries in range(3):
        try:
            _make_private(job_dir)
            _make_private(rank_dir)
            folder = tempfile.mkdtemp(prefix=f"{kind}-", dir=rank_dir)
            try:
                return SwapDir(root, folder, _hold_owner(folder))
            except BaseException:
                remove_swap_dir(folder)
                raise
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
