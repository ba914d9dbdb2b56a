"""``shardspeed.comm``: DeepSpeed's ``deepspeed.comm`` names over ``torch.distributed``.

A thin facade for code written against ``deepspeed.comm`` (transformers, accelerate and user scripts call
``get_rank``, ``get_world_size``, ``barrier``...). It adds nothing: the collectives are torch's, on the
default group unless ``group`` is given. The library's own collectives go through
:class:`shardspeed.comm.collectives.Collectives` (logged, errors named).
"""
from __future__ import annotations

import datetime
import os
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch.distributed import ReduceOp

from ..compat.alias import module_getattr
from ..errors import ConfigError
from ..mesh.init import init_distributed as _init_distributed


def init_distributed(dist_backend: Optional[str] = None, auto_mpi_discovery: bool = True,
                     distributed_port: Optional[int] = None, verbose: bool = True, timeout: Any = None,
                     init_method: Optional[str] = None, dist_init_required: Optional[bool] = None,
                     config: Any = None, rank: int = -1, world_size: int = -1,
                     backend: Optional[str] = None) -> None:
    """Create the default process group if there is none (DeepSpeed's signature, also
    ``shardspeed.init_distributed``; see :func:`shardspeed.mesh.init_distributed`). ``timeout`` may be a
    ``timedelta`` or seconds. MPI discovery, ``distributed_port``, ``rank`` and ``world_size`` are read from
    torchrun's environment variables instead. ``backend`` is shardspeed's older name of ``dist_backend``."""
    if backend is not None and dist_backend is not None and backend != dist_backend:
        raise ConfigError(f"init_distributed(dist_backend={dist_backend!r}, backend={backend!r}): the same "
                          "setting twice with two values; give dist_backend only")
    dist_backend = dist_backend if dist_backend is not None else backend
    if dist_init_required is False:
        return
    if rank >= 0 and world_size > 0:
        os.environ.setdefault("RANK", str(rank))
        os.environ.setdefault("WORLD_SIZE", str(world_size))
    if distributed_port is not None:
        os.environ.setdefault("MASTER_PORT", str(distributed_port))
    if isinstance(timeout, datetime.timedelta):
        timeout = timeout.total_seconds()
    _init_distributed(backend=dist_backend, timeout=timeout, init_method=init_method)


def is_initialized() -> bool:
    return dist.is_available() and dist.is_initialized()


def get_rank(group=None) -> int:
    return dist.get_rank(group)


def get_world_size(group=None) -> int:
    return dist.get_world_size(group)


def get_local_rank() -> int:
    return int(os.environ.get("LOCAL_RANK", 0))


def barrier(group=None, async_op: bool = False, device_ids=None):
    return dist.barrier(group=group, async_op=async_op, device_ids=device_ids)


def all_reduce(tensor: torch.Tensor, op=ReduceOp.SUM, group=None, async_op: bool = False):
    return dist.all_reduce(tensor, op=op, group=group, async_op=async_op)


def broadcast(tensor: torch.Tensor, src: int, group=None, async_op: bool = False):
    return dist.broadcast(tensor, src=src, group=group, async_op=async_op)


def all_gather(tensor_list: list, tensor: torch.Tensor, group=None, async_op: bool = False):
    return dist.all_gather(tensor_list, tensor, group=group, async_op=async_op)


def all_gather_into_tensor(output_tensor: torch.Tensor, tensor: torch.Tensor, group=None, async_op: bool = False):
    return dist.all_gather_into_tensor(output_tensor, tensor, group=group, async_op=async_op)


def reduce_scatter_tensor(output_tensor: torch.Tensor, tensor: torch.Tensor, op=ReduceOp.SUM, group=None,
                          async_op: bool = False):
    return dist.reduce_scatter_tensor(output_tensor, tensor, op=op, group=group, async_op=async_op)


def destroy_process_group(group=None) -> None:
    dist.destroy_process_group(group)


__all__ = ["init_distributed", "is_initialized", "get_rank", "get_world_size", "get_local_rank", "barrier",
           "all_reduce", "broadcast", "all_gather", "all_gather_into_tensor", "reduce_scatter_tensor",
           "destroy_process_group", "ReduceOp"]

__getattr__ = module_getattr(__name__)
