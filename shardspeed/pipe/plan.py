"""This rank's pipeline stages and schedule, assembled from the plan's pipe dimension (decided by
:func:`shardspeed.plan.decide`)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional

from ..comm.collectives import Collectives, CommsLogger
from ..errors import ConfigError
from ..mesh.topology import Topology
from ..plan import PipelinePlan
from .module import PipelineModule
from .partition import rank_of_stage, stages_of_rank
from .ties import TiedGradients


@dataclass(frozen=True)
class PipeParts:
    """What the builder decided about the pipeline."""

    schedule: str
    virtual_stages: int
    total_stages: int
    stage_ids: List[int]
    pipe_comm: Collectives  # over this rank's pipe group
    world_comm: Collectives  # over the world: checkpoints (every stage writes its layers)
    last_stage_pipe_rank: int
    tied: Optional[TiedGradients] = None


def plan_pipeline(model: PipelineModule, pipeline: PipelinePlan, topo: Topology, log: CommsLogger) -> PipeParts:
    """This rank's stages for the schedule (rebuilding the module's layers when they differ from the ones
    built at construction) and the pipe group's collectives."""
    if topo.user_mpu is not None:
        raise ConfigError("a PipelineModule with initialize(mpu=...) is not supported: the pipeline engine builds "
                          "its own mesh; drop mpu=")
    p, v, name = topo.pipe_size, pipeline.virtual_stages, pipeline.schedule  # checked by the plan
    stage_ids = stages_of_rank(topo.pipe_rank, p, v, name)
    total = p * v
    if model.stage_ids != stage_ids or len(model.parts) - 1 != total:
        model.assign_stages(total, stage_ids)
    return PipeParts(schedule=name, virtual_stages=v, total_stages=total, stage_ids=stage_ids,
                     pipe_comm=Collectives.over(topo.pipe_group, log), world_comm=Collectives.over(None, log),
                     last_stage_pipe_rank=rank_of_stage(total - 1, p, v, name))
