"""One pure plan decides what a run is: :func:`decide` (config, world size, model facts) -> :class:`Plan`."""
from __future__ import annotations

from .decide import checkpointing_plan, decide, placement_plan, precision_plan, sharding_plan
from .types import (
    MESH_DIMS,
    BatchPlan,
    CheckpointingPlan,
    LossScalePlan,
    MeshPlan,
    ModelFacts,
    PipelinePlan,
    PlacementPlan,
    Plan,
    PrecisionPlan,
    ShardingPlan,
    TensorParallelPlan,
)
from .variants import zero_variant

__all__ = ["decide", "sharding_plan", "placement_plan", "precision_plan", "checkpointing_plan", "MESH_DIMS", "Plan",
           "ModelFacts", "MeshPlan", "ShardingPlan", "PlacementPlan", "PrecisionPlan", "LossScalePlan", "BatchPlan",
           "CheckpointingPlan", "PipelinePlan", "TensorParallelPlan", "zero_variant"]
