"""Process-group start-up from torchrun's environment (never a home-made launcher)."""
from __future__ import annotations

import datetime
import logging
import os
import socket
from typing import Any, Dict, Optional

import torch
import torch.distributed as dist

logger = logging.getLogger(__name__)

#: Seconds a collective may wait before every rank fails with an error (a dead or diverged rank).
DEFAULT_TIMEOUT_S = float(os.environ.get("SHARDSPEED_TIMEOUT", "600"))


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def default_backend() -> str:
    """NCCL when CUDA is usable, gloo otherwise."""
    return "nccl" if torch.cuda.is_available() and dist.is_nccl_available() else "gloo"


def init_distributed(
    backend: Optional[str] = None,
    timeout: Optional[float] = None,
    init_method: Optional[str] = None,
) -> None:
    """Create the default process group if there is none.

    Reads torchrun's variables (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT). Without them
    (plain ``python train.py``) a one-process group on loopback is created so the same code path runs.
    ``timeout`` (seconds, default ``SHARDSPEED_TIMEOUT`` or 600) bounds every collective: a rank that
    died or took another path makes the others fail instead of hanging.
    """
    if dist.is_initialized():
        return
    backend = backend or default_backend()
    timeout_s = DEFAULT_TIMEOUT_S if timeout is None else float(timeout)
    kwargs: Dict[str, Any] = dict(backend=backend, timeout=datetime.timedelta(seconds=timeout_s))
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        if backend == "nccl":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        dist.init_process_group(init_method=init_method or "env://", **kwargs)
    else:
        method = init_method or f"tcp://127.0.0.1:{_free_port()}"
        dist.init_process_group(init_method=method, rank=0, world_size=1, **kwargs)
    logger.info("initialised %s process group: rank %d of %d", backend, dist.get_rank(), dist.get_world_size())


def local_device() -> torch.device:
    """The device this rank computes on: its CUDA device under NCCL, else the CPU."""
    if torch.cuda.is_available() and dist.is_initialized() and dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")
