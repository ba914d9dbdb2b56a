"""Files created where another user may have planted a link, and the processes that own files.

A folder shared with other users (a team's checkpoint folder, a world-writable scratch disk) may hold a
symbolic link at the name a writer is about to create: ``open(name, "w")`` follows it and truncates the
link's target. Every file shardspeed writes is therefore either

- created new with ``O_CREAT | O_EXCL | O_NOFOLLOW`` (:func:`create_new`: an existing name, link or not,
  fails with ``FileExistsError``), and opened again by name only with ``O_NOFOLLOW`` and a check that it is
  still the same file (:func:`reopen`); or
- written in a private folder made for it beside its final name (``mkdtemp``: an unpredictable name, mode
  0o700, so nobody else can place anything in it), then moved onto the final name with ``os.replace``
  (:func:`replacing`, :func:`write_atomic`), which replaces a link rather than writing through it.

Also :func:`process_alive` and :func:`host_name`, used to judge whether the owner of a lock or a swap
folder is still running.
"""
from __future__ import annotations

import contextlib
import errno
import os
import shutil
import socket
import tempfile
from typing import Callable, Iterator, Optional

_NOFOLLOW = int(getattr(os, "O_NOFOLLOW", 0))
_CLOEXEC = int(getattr(os, "O_CLOEXEC", 0))


def create_new(path: str, flags: int = os.O_WRONLY, mode: int = 0o666) -> int:
    """A descriptor of a file created at ``path`` by this call (``FileExistsError`` if anything, a link
    included, is there already). ``flags``: the access mode and any extra flags."""
    return os.open(path, flags | os.O_CREAT | os.O_EXCL | _NOFOLLOW | _CLOEXEC, mode)


def same_file(fd_a: int, fd_b: int) -> bool:
    a, b = os.fstat(fd_a), os.fstat(fd_b)
    return (a.st_dev, a.st_ino) == (b.st_dev, b.st_ino)


def reopen(path: str, fd: int, flags: int, opener: Callable[..., Optional[int]] = os.open) -> Optional[int]:
    """``path`` (the file open as ``fd``) opened again with ``flags | O_NOFOLLOW`` through ``opener``
    (``os.open``, or :func:`~shardspeed.utils.direct_io.open_direct`, which may return None). If the name
    now leads to another file, the new descriptor is closed and ``FileExistsError`` raised."""
    other = opener(path, flags | _NOFOLLOW)
    if other is not None and not same_file(fd, other):
        os.close(other)
        raise FileExistsError(errno.EEXIST, "the file was replaced by another one while open", path)
    return other


def fsync_path(path: str, directory: bool = False) -> None:
    """``fsync`` a file by name without following a link, or a folder (``directory``: through a link, as the
    user's save folder may be one; nothing is written through it); file systems that refuse it for
    folders are let be."""
    kind = getattr(os, "O_DIRECTORY", 0) if directory else _NOFOLLOW
    try:
        fd = os.open(path, os.O_RDONLY | _CLOEXEC | kind)
    except OSError:
        if not directory:
            raise
        return
    try:
        os.fsync(fd)
    except OSError:
        if not directory:
            raise
    finally:
        os.close(fd)


@contextlib.contextmanager
def replacing(path: str, sync: bool = True) -> Iterator[str]:
    """A name to write the new content of ``path`` at, in a private folder made beside ``path``
    (``<name>.tmp-<random>/<name>``: the same base name, which ``torch.save`` records in its archive). When
    the block ends without an error, the file is fsynced (``sync``) and moved onto ``path`` with
    ``os.replace`` and the folder synced; either way the private folder is removed."""
    folder, name = os.path.split(os.path.abspath(path))
    staging = tempfile.mkdtemp(prefix=f"{name}.tmp-", dir=folder)
    try:
        staged = os.path.join(staging, name)
        yield staged
        if sync:
            fsync_path(staged)
        os.replace(staged, os.path.join(folder, name))
        fsync_path(folder, directory=True)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def write_atomic(path: str, data: bytes, mode: int = 0o666) -> None:
    """``path`` holding ``data``: written in a private folder (:func:`replacing`), fsynced, then moved
    onto ``path``. A reader sees the old content or the new one, never a part."""
    with replacing(path) as staged:
        fd = create_new(staged, os.O_WRONLY, mode)
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
        finally:
            os.close(fd)


def host_name() -> str:
    return socket.gethostname() or "localhost"


def process_alive(pid: int) -> bool:
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
