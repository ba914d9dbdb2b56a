"""offload_param with ``device: nvme``: the stage-3 parameter shards of this rank in one file.

One file per rank (``nvme_path/shardspeed-param-rank<r>-*/params.bin``), one region per unit at a
4 KiB-aligned offset, preallocated as each unit is built with its :class:`FilePlacement`
(``posix_fallocate``) after the same checks as the optimizer store
(:func:`~shardspeed.offload.store.check_nvme_path`). A unit's shard is read into a temporary host
tensor when it is needed (gather, checkpoints, masters) and written back after the optimizer step, so
host memory for parameters is bounded by the units gathered at once, not by the model. I/O is
``os.preadv``/``os.pwritev`` through the page cache. The directory is removed on :meth:`close`, when the
object is collected, or at interpreter exit.
"""
from __future__ import annotations

import logging
import os
import shutil
import tempfile
import weakref

import torch

from ..errors import ConfigError
from ..zero.placement import ShardPlacement
from .store import _rw_all, check_nvme_path

logger = logging.getLogger("shardspeed")

_ALIGN = 4096


class NvmeParamFile:
    """This rank's stage-3 parameter shards in one file, one region per unit (:meth:`reserve`).

    The file grows by one preallocated region per reservation, made when a unit is constructed with a
    :class:`FilePlacement`, so a disk that is too small fails at start, not mid-training."""

    def __init__(self, nvme_path: str, rank: int):
        self.nbytes = 0
        self.root = check_nvme_path(nvme_path, 0, what="the parameter shards")
        self.dir = tempfile.mkdtemp(prefix=f"shardspeed-param-rank{rank}-", dir=self.root)
        self.path = os.path.join(self.dir, "params.bin")
        try:
            self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
        except OSError as e:
            shutil.rmtree(self.dir, ignore_errors=True)
            raise ConfigError(f"offload_param nvme_path {self.root!r}: cannot create the parameter file "
                              f"({e.strerror})") from e
        self._finalizer = weakref.finalize(self, NvmeParamFile._cleanup, self.fd, self.dir)
        logger.info("NVMe parameter shards: %s", self.path)

    def reserve(self, numel: int, dtype: torch.dtype) -> int:
        """Append a region for ``numel`` elements of ``dtype`` (4 KiB-aligned, preallocated); returns its
        byte offset."""
        nbytes = -(-numel * torch.empty((), dtype=dtype).element_size() // _ALIGN) * _ALIGN
        check_nvme_path(self.root, nbytes, what=f"the parameter shards ({self.nbytes / 2**30:.2f} GiB "
                                                f"reserved so far)")
        offset = self.nbytes
        try:
            if nbytes:
                os.posix_fallocate(self.fd, offset, nbytes)  # a full disk fails now, not mid-training
        except OSError as e:
            raise ConfigError(f"offload_param nvme_path {self.root!r}: cannot preallocate the parameter file "
                              f"({e.strerror}); need {(offset + nbytes) / 2**30:.2f} GiB") from e
        self.nbytes = offset + nbytes
        return offset

    def read(self, offset: int, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """A fresh host copy of the region at ``offset`` (writing into it does not change the file)."""
        out = torch.empty(numel, dtype=dtype)
        if out.numel():
            _rw_all(os.preadv, self.fd, out, offset, "read")
        return out

    def write(self, offset: int, numel: int, dtype: torch.dtype, t: torch.Tensor, lo: int = 0) -> None:
        """Store ``t`` (cast to ``dtype``) as elements ``[lo, lo + t.numel())`` of the region at ``offset``
        (``numel`` elements)."""
        if lo < 0 or lo + t.numel() > numel:
            raise ValueError(f"write of [{lo}, {lo + t.numel()}) outside its shard of {numel} elements")
        src = t.detach().reshape(-1).to(device="cpu", dtype=dtype).contiguous()
        if src.numel():
            _rw_all(os.pwritev, self.fd, src, offset + lo * src.element_size(), "write")

    @staticmethod
    def _cleanup(fd: int, directory: str) -> None:
        try:
            os.close(fd)
        except OSError:
            pass
        shutil.rmtree(directory, ignore_errors=True)

    def close(self) -> None:
        """Close and delete the parameter file (the shards are gone afterwards)."""
        self._finalizer()


class FilePlacement(ShardPlacement):
    """A unit's shard in a region of ``param_file`` (offload_param nvme). Nothing is kept in memory: each
    read is a fresh host copy (gathers, masters, checkpoints), changes are written with :meth:`write`.
    The file is shared by the units of a rank; :meth:`close` deletes it (for all of them)."""

    where = "file"
    in_file = True

    def __init__(self, param_file: NvmeParamFile) -> None:
        self.file = param_file
        self.offset = -1
        self.numel = 0
        self.dtype = torch.float32
        self._device = torch.device("cpu")

    def hold(self, shard: torch.Tensor, device: torch.device) -> None:
        self.numel, self.dtype, self._device = shard.numel(), shard.dtype, device
        self.offset = self.file.reserve(self.numel, self.dtype)
        self.write(shard)

    def read(self) -> torch.Tensor:
        return self.file.read(self.offset, self.numel, self.dtype)

    def write(self, t: torch.Tensor, lo: int = 0) -> None:
        self.file.write(self.offset, self.numel, self.dtype, t, lo)

    def to_device_for_gather(self) -> torch.Tensor:
        return self.read().to(self._device)  # a synchronous read, then the host→device copy

    def close(self) -> None:
        self.file.close()

    def __repr__(self) -> str:
        return f"FilePlacement({self.file.path}@{self.offset}, {self.numel} × {self.dtype})"
