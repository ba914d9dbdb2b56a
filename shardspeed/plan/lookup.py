"""One decision of a config, for code that is handed a config outside the engine: DeepSpeed's
``deepspeed.checkpointing.configure(mpu_, deepspeed_config=...)``, the estimator's helpers that size a model
before a world size is known, and the export to DeepSpeed's layout (the config DeepSpeed will load under).
They read the config here, so that those modules receive typed decisions and never import the config."""
from __future__ import annotations

from typing import Any, Dict, Optional

from ..config import parse_config
from ..config.zero import zero_block
from .decide import checkpointing_plan, precision_plan, sharding_plan
from .sections import optimizer_plan
from .types import CheckpointingPlan, MeshPlan, OptimizerPlan, PrecisionPlan, ShardingPlan


def _parsed(config: Any):
    """A config (dict, JSON path or ShardspeedConfig; None: DeepSpeed's defaults), validated."""
    return parse_config(config if config is not None else {})


def checkpointing_of(config: Any) -> CheckpointingPlan:
    """The activation checkpointing :func:`~shardspeed.plan.decide` makes of ``config``."""
    return checkpointing_plan(_parsed(config))


def sharding_of(config: Any) -> ShardingPlan:
    """ZeRO's decisions for ``config`` on one rank (buckets, prefetch, thresholds: what sizes units)."""
    return sharding_plan(_parsed(config), MeshPlan())


def precision_of(config: Any) -> PrecisionPlan:
    """The dtypes ``config`` trains in."""
    return precision_plan(_parsed(config))


def optimizer_of(config: Any) -> OptimizerPlan:
    """The optimizer and LR schedule ``config`` names."""
    return optimizer_plan(_parsed(config))


def tile_elems_of(ds_config: Optional[Dict[str, Any]]) -> int:
    """``zero_optimization.sub_group_size`` of a DeepSpeed config dict (its default without one): the elements
    of one optimizer tile, which shapes ZeRO-3's optimizer files."""
    return int(zero_block(ds_config).sub_group_size)
