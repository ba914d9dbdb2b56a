"""``deepspeed.utils.groups`` for shardspeed: the process groups of the current engine.

Scripts written for DeepSpeed call these module-level functions; here they answer from the current
topology of the process's :class:`~shardspeed.mesh.topology.TopologyRegistry` (``TOPOLOGIES``): that of
the last engine :func:`shardspeed.initialize` built (the same object as ``engine.mpu.topology`` when no
user mpu was given), or the one a ``with using(topology):`` block selects (two engines in one process).
This module keeps no state of its own. Meanings follow DeepSpeed's pipeline grid (see
:mod:`shardspeed.mesh.mpu`): "model parallel" is pipe × tensor, which without pipeline stages is the
tensor-parallel group, as in DeepSpeed's module.
"""
from __future__ import annotations

from typing import ContextManager, List, Optional

import torch.distributed as dist

from ..errors import ShardspeedError
from ..mesh.mpu import MeshMPU
from ..mesh.topology import TOPOLOGIES, Topology


def set_topology(topology: Optional[Topology]) -> None:
    """Make ``topology`` the one these functions answer from (the builder calls this for each engine)."""
    TOPOLOGIES.set_current(topology)


def current_topology() -> Topology:
    topology = TOPOLOGIES.current()
    if topology is None:
        raise ShardspeedError("shardspeed.utils.groups: no engine yet; call shardspeed.initialize() first")
    return topology


def using(topology: Topology) -> ContextManager[Topology]:
    """``with using(engine.mpu.topology):`` these functions answer for that engine in the block (the
    current engine's again after it)."""
    return TOPOLOGIES.using(topology)


def _mpu() -> MeshMPU:
    return MeshMPU(current_topology())


def get_data_parallel_group() -> Optional[dist.ProcessGroup]:
    return _mpu().get_data_parallel_group()


def get_data_parallel_rank() -> int:
    return _mpu().get_data_parallel_rank()


def get_data_parallel_world_size() -> int:
    return _mpu().get_data_parallel_world_size()


def get_data_parallel_group_ranks() -> List[int]:
    return _mpu().get_data_parallel_group_ranks()


def get_model_parallel_group() -> dist.ProcessGroup:
    return _mpu().get_model_parallel_group()


def get_model_parallel_rank() -> int:
    return _mpu().get_model_parallel_rank()


def get_model_parallel_world_size() -> int:
    return _mpu().get_model_parallel_world_size()


def get_tensor_model_parallel_group() -> dist.ProcessGroup:
    return _mpu().get_tensor_model_parallel_group()


def get_tensor_model_parallel_rank() -> int:
    return _mpu().get_tensor_model_parallel_rank()


def get_tensor_model_parallel_world_size() -> int:
    return _mpu().get_tensor_model_parallel_world_size()


def get_tensor_model_parallel_src_rank() -> int:
    return _mpu().get_tensor_model_parallel_src_rank()


def get_slice_parallel_group() -> dist.ProcessGroup:
    return _mpu().get_slice_parallel_group()


def get_slice_parallel_rank() -> int:
    return _mpu().get_slice_parallel_rank()


def get_slice_parallel_world_size() -> int:
    return _mpu().get_slice_parallel_world_size()


def get_pipe_parallel_group() -> dist.ProcessGroup:
    return _mpu().get_pipe_parallel_group()


def get_pipe_parallel_rank() -> int:
    return _mpu().get_pipe_parallel_rank()


def get_pipe_parallel_world_size() -> int:
    return _mpu().get_pipe_parallel_world_size()


def get_pipeline_model_parallel_group() -> dist.ProcessGroup:
    return _mpu().get_pipeline_model_parallel_group()


def get_pipeline_model_parallel_rank() -> int:
    return _mpu().get_pipeline_model_parallel_rank()


def get_pipeline_model_parallel_world_size() -> int:
    return _mpu().get_pipeline_model_parallel_world_size()


# DeepSpeed's underscored spellings, which integrations (e.g. Hugging Face's) call directly.
_get_data_parallel_group = get_data_parallel_group
_get_data_parallel_rank = get_data_parallel_rank
_get_data_parallel_world_size = get_data_parallel_world_size
_get_data_parallel_group_ranks = get_data_parallel_group_ranks
_get_model_parallel_world_size = get_model_parallel_world_size


def get_sequence_parallel_group() -> dist.ProcessGroup:
    return _mpu().get_sequence_parallel_group()


def get_sequence_parallel_rank() -> int:
    return _mpu().get_sequence_parallel_rank()


def get_sequence_parallel_world_size() -> int:
    """1 when the current engine's mesh has no sequence dimension (DeepSpeed answers 1 without one too)."""
    topology = TOPOLOGIES.current()
    return topology.sequence_size if topology is not None else 1


def get_sequence_data_parallel_group() -> Optional[dist.ProcessGroup]:
    return _mpu().get_sequence_data_parallel_group()


def get_sequence_data_parallel_rank() -> int:
    return _mpu().get_sequence_data_parallel_rank()


def get_sequence_data_parallel_world_size() -> int:
    return _mpu().get_sequence_data_parallel_world_size()


_get_sequence_parallel_group = get_sequence_parallel_group
_get_sequence_parallel_rank = get_sequence_parallel_rank
_get_sequence_parallel_world_size = get_sequence_parallel_world_size
_get_sequence_data_parallel_group = get_sequence_data_parallel_group
_get_sequence_data_parallel_rank = get_sequence_data_parallel_rank
_get_sequence_data_parallel_world_size = get_sequence_data_parallel_world_size
