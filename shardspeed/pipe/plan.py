"""The builder's pipeline decisions: the pipe dimension's size, this rank's stages, the schedule."""
from __future__ import annotations

import torch.nn as nn

from ..dist.comms import Collectives, CommsLogger
from ..dist.topology import Topology
from ..errors import ConfigError
from .engine import PipeParts
from .module import PipelineModule
from .partition import rank_of_stage, stages_of_rank


def pipeline_stages(pcfg, model: nn.Module) -> int:
    """The pipe dimension: a PipelineModule's ``num_stages`` (``pipeline.stages`` must agree when set), else
    ``pipeline.stages`` ("auto": 1)."""
    if isinstance(model, PipelineModule):
        if pcfg.stages != "auto" and int(pcfg.stages) != model.num_stages:
            raise ConfigError(f"pipeline.stages {pcfg.stages} disagrees with the PipelineModule's num_stages "
                              f"{model.num_stages}; remove pipeline.stages or make them agree")
        return model.num_stages
    return pcfg.num_stages


def require_pipeline_module(stages: int, model: nn.Module) -> None:
    """More than one stage needs a PipelineModule (the layers to cut into stages)."""
    if stages > 1 and not isinstance(model, PipelineModule):
        raise ConfigError(f"pipeline.stages {stages} needs a shardspeed.pipe.PipelineModule model (got "
                          f"{type(model).__name__}); build it as PipelineModule(layers=..., num_stages={stages}) "
                          f"or set pipeline.stages to 1")


def plan_pipeline(model: PipelineModule, pcfg, topo: Topology, log: CommsLogger) -> PipeParts:
    """This rank's stages for the schedule (rebuilding the module's layers when they differ from the ones
    built at construction) and the pipe group's collectives."""
    if topo.user_mpu is not None:
        raise ConfigError("a PipelineModule with initialize(mpu=...) is not supported: the pipeline engine builds "
                          "its own mesh; drop mpu=")
    p, v, name = topo.pipe_size, pcfg.chunks_per_rank, pcfg.schedule
    if name in ("1f1b", "gpipe") and v != 1:
        raise ConfigError(f"pipeline.schedule {name!r} runs one stage per rank; set pipeline.virtual_stages to 1 "
                          f"or use \"interleaved_1f1b\"")
    stage_ids = stages_of_rank(topo.pipe_rank, p, v, name)
    total = p * v
    if model.stage_ids != stage_ids or len(model.parts) - 1 != total:
        model.assign_stages(total, stage_ids)
    return PipeParts(schedule=name, virtual_stages=v, total_stages=total, stage_ids=stage_ids,
                     pipe_comm=Collectives.over(topo.pipe_group, log), world_comm=Collectives.over(None, log),
                     last_stage_pipe_rank=rank_of_stage(total - 1, p, v, name))
