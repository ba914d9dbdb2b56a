"""``deepspeed.utils.groups`` for shardspeed: the process groups of the current engine.

Scripts written for DeepSpeed call these module-level functions; here they answer from the topology of
the engine current in the process (:data:`shardspeed.mesh.current.CURRENT`): the last engine
:func:`shardspeed.initialize` built and ``engine.destroy()`` has not ended (the same object as
``engine.mpu.topology`` when no user mpu was given), or the one a ``with using(engine):`` block selects
(two engines in one process). With no engine alive they fail with one line. This module keeps no state of
its own. Meanings follow DeepSpeed's pipeline grid (see :mod:`shardspeed.mesh.mpu`): "model parallel" is
pipe × tensor, which without pipeline stages is the tensor-parallel group, as in DeepSpeed's module.
"""
from __future__ import annotations

from typing import Any, ContextManager, Dict, List, Optional

import torch.distributed as dist

from ..errors import ShardspeedError
from ..mesh.current import CURRENT, EngineScope
from ..mesh.mpu import MeshMPU
from ..mesh.topology import Topology


def _current() -> Optional[Topology]:
    scope = CURRENT.get()
    return scope.topology if scope is not None else None


def current_topology() -> Topology:
    """The current engine's topology; one line when no engine is alive."""
    topology = _current()
    if topology is None:
        raise ShardspeedError("shardspeed.utils.groups: no engine yet, or every engine was destroyed; call "
                              "shardspeed.initialize() first")
    return topology


def using(target: Any) -> ContextManager[EngineScope]:
    """``with using(engine):`` (or ``using(engine.mpu.topology)``) these functions answer for that engine in
    the block (the current engine's again after it)."""
    topology = target if isinstance(target, Topology) else getattr(target, "topology", None)
    if not isinstance(topology, Topology):
        raise ShardspeedError(f"shardspeed.utils.groups.using: expected an engine or a Topology, got "
                              f"{type(target).__name__}")
    scope = next((s for s in CURRENT.alive() if s.topology is topology), None)
    return CURRENT.using(scope if scope is not None else EngineScope(topology))


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
    topology = _current()
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


# ---- expert parallelism (DeepSpeed's MoE group getters; group names are "ep_size_N") --------------------
def _expert_topology(group_name: Optional[str] = None) -> Topology:
    topology = current_topology()
    if group_name is not None and group_name != _get_max_expert_size_name():
        raise ShardspeedError(f"shardspeed.utils.groups: no expert group {group_name!r}; the engine's mesh has "
                              f"{_get_max_expert_size_name()!r} (one expert size per engine)")
    return topology


def _get_max_expert_size() -> int:
    """The mesh's expert dimension (1: none)."""
    topology = _current()
    return topology.expert_size if topology is not None else 1


def _get_max_expert_size_name() -> str:
    return f"ep_size_{_get_max_expert_size()}"


def _get_expert_parallel_group(group_name: Optional[str] = None) -> Optional[dist.ProcessGroup]:
    """The ranks holding different experts of one layer (the mesh's expert dimension)."""
    return _expert_topology(group_name).expert_group


def _get_expert_parallel_world_size(group_name: Optional[str] = None) -> int:
    return _expert_topology(group_name).expert_size


def _get_expert_parallel_rank(group_name: Optional[str] = None) -> int:
    return _expert_topology(group_name).expert_rank


def _get_expert_data_parallel_group(group_name: Optional[str] = None) -> Optional[dist.ProcessGroup]:
    """The ranks holding the same experts (expert parameters are reduced and sharded over it)."""
    topology = _expert_topology(group_name)
    return topology.expert_shard_group if topology.expert_size > 1 else topology.shard_group


def _get_expert_data_parallel_world_size(group_name: Optional[str] = None) -> int:
    topology = _expert_topology(group_name)
    return topology.expert_shard_size if topology.expert_size > 1 else topology.shard_size


def _get_expert_data_parallel_rank(group_name: Optional[str] = None) -> int:
    topology = _expert_topology(group_name)
    return topology.expert_shard_rank if topology.expert_size > 1 else topology.shard_rank


def _get_expert_parallel_group_dict() -> Dict[str, Optional[dist.ProcessGroup]]:
    return {_get_max_expert_size_name(): _get_expert_parallel_group()}


def _get_expert_data_parallel_group_dict() -> Dict[str, Optional[dist.ProcessGroup]]:
    return {_get_max_expert_size_name(): _get_expert_data_parallel_group()}


def _get_expert_model_parallel_world_size() -> int:
    """Tensor parallelism inside experts: none (1)."""
    return 1
