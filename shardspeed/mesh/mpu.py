"""DeepSpeed's names for the groups of a `Topology` (the "mpu" interface Megatron and DeepSpeed use).

Semantics follow DeepSpeed's ``PipelineParallelGrid`` (``deepspeed/runtime/pipe/topology.py``), which is
what a DeepSpeed engine's ``mpu`` is under pipeline parallelism:

- data parallel: the topology's ``batch`` group (data × expert, the ranks reading different samples; ZeRO's
  ``shard`` group too unless the sequence dimension is > 1);
- sequence parallel: the ``sequence`` dimension; sequence-data parallel: the ``shard`` group (data × expert ×
  sequence) ZeRO shards over (DeepSpeed's ``seq_data_parallel_group``);
- pipe parallel (also ``pipeline_model_parallel``): the ``pipe`` dimension; the rank is the stage;
- slice parallel (also ``tensor_model_parallel``): the ``model`` dimension (tensor slicing);
- model parallel: the ``pipe_model`` group, every rank holding part of the same model replica. Without
  pipeline stages this is the tensor-parallel group, as in ``deepspeed.utils.groups``.
"""
from __future__ import annotations

from typing import List, Optional

import torch.distributed as dist

from ..errors import DistributedError
from .topology import Topology


class MeshMPU:
    """The ``get_{data,model,tensor_model,pipe,pipeline_model,slice}_parallel_{group,rank,world_size}``
    interface over one `Topology`."""

    def __init__(self, topology: Topology):
        self.topology = topology

    def _group(self, group: Optional[dist.ProcessGroup], what: str) -> dist.ProcessGroup:
        if group is None:  # None would mean the whole world to torch: never hand that out by accident
            raise DistributedError(f"this topology has no {what} group (it was built from a data-parallel "
                                   f"group alone, or from a user mpu without one)")
        return group

    # ---- data parallel: the batch group (ZeRO's shard group unless sequence > 1) ---------------------------
    def get_data_parallel_group(self) -> Optional[dist.ProcessGroup]:
        return self.topology.batch_group

    def get_data_parallel_rank(self) -> int:
        return self.topology.batch_rank

    def get_data_parallel_world_size(self) -> int:
        return self.topology.batch_world

    def get_data_parallel_group_ranks(self) -> List[int]:
        group = self.topology.batch_group
        return list(range(dist.get_world_size())) if group is None else list(dist.get_process_group_ranks(group))

    # ---- sequence parallel, and sequence × data: the shard group (ZeRO's) ---------------------------------
    def get_sequence_parallel_group(self) -> dist.ProcessGroup:
        return self._group(self.topology.sequence_group, "sequence-parallel")

    def get_sequence_parallel_rank(self) -> int:
        return self.topology.sequence_rank

    def get_sequence_parallel_world_size(self) -> int:
        return self.topology.sequence_size

    def get_sequence_data_parallel_group(self) -> Optional[dist.ProcessGroup]:
        return self.topology.shard_group

    def get_sequence_data_parallel_rank(self) -> int:
        return self.topology.shard_rank

    def get_sequence_data_parallel_world_size(self) -> int:
        return self.topology.shard_size

    # ---- model parallel: the pipe_model group -------------------------------------------------------
    def get_model_parallel_group(self) -> dist.ProcessGroup:
        return self._group(self.topology.pipe_model_group, "model-parallel")

    def get_model_parallel_rank(self) -> int:
        return self.topology.pipe_model_rank

    def get_model_parallel_world_size(self) -> int:
        return self.topology.pipe_model_size

    # ---- tensor (slice) parallel: the mesh's model dimension ----------------------------------------------
    def get_tensor_model_parallel_group(self) -> dist.ProcessGroup:
        return self._group(self.topology.model_group, "tensor-parallel")

    def get_tensor_model_parallel_rank(self) -> int:
        return self.topology.model_rank

    def get_tensor_model_parallel_world_size(self) -> int:
        return self.topology.model_size

    def get_tensor_model_parallel_src_rank(self) -> int:
        """The global rank of tensor-parallel rank 0 in this rank's tensor-parallel group."""
        group = self.topology.model_group
        return dist.get_rank() if group is None else dist.get_global_rank(group, 0)

    get_slice_parallel_group = get_tensor_model_parallel_group
    get_slice_parallel_rank = get_tensor_model_parallel_rank
    get_slice_parallel_world_size = get_tensor_model_parallel_world_size

    # ---- pipe parallel: the mesh's pipe dimension -------------------------------------------------------
    def get_pipe_parallel_group(self) -> dist.ProcessGroup:
        return self._group(self.topology.pipe_group, "pipe-parallel")

    def get_pipe_parallel_rank(self) -> int:
        return self.topology.pipe_rank

    def get_pipe_parallel_world_size(self) -> int:
        return self.topology.pipe_size

    get_pipeline_model_parallel_group = get_pipe_parallel_group
    get_pipeline_model_parallel_rank = get_pipe_parallel_rank
    get_pipeline_model_parallel_world_size = get_pipe_parallel_world_size

    def get_stage_id(self) -> int:
        return self.topology.pipe_rank

    def get_global_rank(self) -> int:
        return dist.get_rank()

    def __repr__(self) -> str:
        p, m, t = self.topology.pipe_size, self.topology.model_size, self.topology
        seq = f", sequence={t.sequence_size}" if t.sequence_size > 1 else ""
        return f"MeshMPU(pipe={p}, data={t.batch_world}{seq}, model={m}, rank={dist.get_rank()})"


def mpu_for(topology: Topology):
    """What ``engine.mpu`` is: the user's own object when ``initialize(mpu=...)`` got one (as in
    DeepSpeed), else a `MeshMPU` over the engine's topology."""
    return topology.user_mpu if topology.user_mpu is not None else MeshMPU(topology)
