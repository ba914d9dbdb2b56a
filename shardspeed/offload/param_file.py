"""offload_param with ``device: nvme``: the stage-3 parameter shards of this rank in one file.

One file per rank (``nvme_path/shardspeed-param-rank<r>-*/params.bin``), one region per unit at a
4 KiB-aligned offset, preallocated at start (``posix_fallocate``) after the same checks as the optimizer
store (:func:`~shardspeed.offload.store.check_nvme_path`). A unit's shard is read into a temporary host
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
from typing import Dict, Sequence

import torch

from ..errors import ConfigError
from .store import _rw_all, check_nvme_path

logger = logging.getLogger("shardspeed")

_ALIGN = 4096


class NvmeParamFile:
    """This rank's shards of the given stage-3 units, one region per unit in one preallocated file."""

    def __init__(self, nvme_path: str, units: Sequence, rank: int):
        self.offsets: Dict[int, int] = {}
        total = 0
        for u in units:
            self.offsets[u.index] = total
            nbytes = u.layout.chunk_size * torch.empty((), dtype=u.dtype).element_size()
            total += -(-nbytes // _ALIGN) * _ALIGN
        self.nbytes = total
        root = check_nvme_path(nvme_path, total, what="the parameter shards")
        self.dir = tempfile.mkdtemp(prefix=f"shardspeed-param-rank{rank}-", dir=root)
        self.path = os.path.join(self.dir, "params.bin")
        try:
            self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
        except OSError as e:
            shutil.rmtree(self.dir, ignore_errors=True)
            raise ConfigError(f"offload_param nvme_path {root!r}: cannot create the parameter file "
                              f"({e.strerror})") from e
        try:
            if total:
                os.posix_fallocate(self.fd, 0, total)  # a full disk fails now, not mid-training
        except OSError as e:
            os.close(self.fd)
            shutil.rmtree(self.dir, ignore_errors=True)
            raise ConfigError(f"offload_param nvme_path {root!r}: cannot preallocate the parameter file "
                              f"({e.strerror}); need {total / 2**30:.2f} GiB") from e
        self._finalizer = weakref.finalize(self, NvmeParamFile._cleanup, self.fd, self.dir)
        logger.info("NVMe parameter shards: %s (%.2f GiB)", self.path, total / 2**30)

    def read(self, unit) -> torch.Tensor:
        """A fresh host copy of the unit's shard (writing into it does not change the file)."""
        out = torch.empty(unit.layout.chunk_size, dtype=unit.dtype)
        if out.numel():
            _rw_all(os.preadv, self.fd, out, self.offsets[unit.index], "read")
        return out

    def write(self, unit, t: torch.Tensor, lo: int = 0) -> None:
        """Store ``t`` (cast to the unit's dtype) as elements ``[lo, lo + t.numel())`` of the unit's shard."""
        if lo < 0 or lo + t.numel() > unit.layout.chunk_size:
            raise ValueError(f"unit {unit.index}: write of [{lo}, {lo + t.numel()}) outside its shard of "
                             f"{unit.layout.chunk_size} elements")
        src = t.detach().reshape(-1).to(device="cpu", dtype=unit.dtype).contiguous()
        if src.numel():
            _rw_all(os.pwritev, self.fd, src, self.offsets[unit.index] + lo * src.element_size(), "write")

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
