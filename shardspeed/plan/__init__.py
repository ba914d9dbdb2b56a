"""One pure plan decides what a run is: :func:`decide` (config, world size, model facts) -> :class:`Plan`."""
from __future__ import annotations

from .decide import checkpointing_plan, decide, placement_plan, precision_plan, sharding_plan
from .lookup import checkpointing_of, optimizer_of, precision_of, sharding_of, tile_elems_of
from .sections import check_schedule
from .types import (
    MESH_DIMS,
    V_SCHEDULES,
    BatchPlan,
    CheckpointingPlan,
    CommsLoggerPlan,
    ConfigSource,
    ExpertsPlan,
    FlopsProfilerPlan,
    LossScalePlan,
    MeshPlan,
    ModelFacts,
    MonitorPlan,
    OptimizerPlan,
    PipelinePlan,
    PlacementPlan,
    Plan,
    PrecisionPlan,
    ReportPlan,
    SavePlan,
    ShardingPlan,
    TensorParallelPlan,
    TrialPlan,
    TypedBlock,
)
from .variants import zero_variant

__all__ = ["decide", "sharding_plan", "placement_plan", "precision_plan", "checkpointing_plan", "MESH_DIMS", "Plan",
           "ModelFacts", "MeshPlan", "ShardingPlan", "PlacementPlan", "PrecisionPlan", "LossScalePlan", "BatchPlan",
           "CheckpointingPlan", "PipelinePlan", "TensorParallelPlan", "zero_variant", "checkpointing_of",
           "optimizer_of", "precision_of", "sharding_of", "tile_elems_of", "check_schedule", "V_SCHEDULES",
           "CommsLoggerPlan", "ConfigSource", "ExpertsPlan", "FlopsProfilerPlan", "MonitorPlan", "OptimizerPlan",
           "ReportPlan", "SavePlan", "TrialPlan", "TypedBlock"]
