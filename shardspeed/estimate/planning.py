"""The plan the estimator prices: a config and the sizes the caller gives, decided by :func:`shardspeed.plan.decide`.

The estimator reads no config itself: stage, partitioning, placement, precision, buckets, prefetch, batch,
mesh and the optimizer are the :class:`~shardspeed.plan.Plan`'s (or, before a world size is known, the plan
module's decision of one section: :func:`~shardspeed.plan.sharding_of`, ...), and a contradiction is the
plan's :class:`~shardspeed.errors.ConfigError`.
"""
from __future__ import annotations

from types import MappingProxyType
from typing import Any, Dict, Mapping, Optional

import torch

from ..errors import ConfigError
from ..plan import MeshPlan, ModelFacts, OptimizerPlan, Plan, decide, optimizer_of, precision_of, sharding_of

#: fp32 optimizer-state bytes per parameter element, by optimizer name (lower case)
OPTIMIZER_STATE_BYTES: Mapping[str, int] = MappingProxyType({"adam": 8, "adamw": 8, "lamb": 8, "fusedadam": 8, "cpuadam": 8,
                                         "onebitadam": 8, "adagrad": 4, "lion": 4, "sgd": 4, "rmsprop": 4,
                                         "muon": 4})


def precision_keys(dtype: str) -> Dict[str, Any]:
    """The config keys that train in ``dtype`` ("fp32", "bf16" or "fp16"), a fresh dict: the estimate command's
    ``--dtype`` without a config."""
    return {"bf16": {"bf16": {"enabled": True}}, "fp16": {"fp16": {"enabled": True}}, "fp32": {}}[dtype]


def plan_for(config: Any = None, world_size: int = 1, *, tp: Optional[int] = None, pp: Optional[int] = None,
             mesh: Optional[MeshPlan] = None, micro_batch: Optional[int] = None, zero_init: bool = False,
             ep: Optional[int] = None) -> Plan:
    """The plan of training with ``config`` on ``world_size`` ranks. ``pp`` > 1: the model is a pipeline of
    ``pp`` stages (``ModelFacts.pipeline_stages``); ``tp`` > 1: it is split ``tp`` ways as ``tp_model_init``
    would (``ModelFacts.tp_size``); None or 1 leave both to the config (``pipeline.stages``,
    ``tensor_parallel.autotp_size``). ``mesh``: sizes given from elsewhere (a user's mpu). ``micro_batch``:
    the micro-batch of a config that gives no batch size (default 1; None is DeepSpeed's defaults at
    micro-batch 1). ``zero_init``: the model is built under ``shardspeed.zero.Init`` (stage 3 only). ``ep`` > 1:
    the model's MoE layers spread their experts over ``ep`` ranks (``ModelFacts.ep_size``)."""
    for name, value in (("world_size", world_size), ("tp", tp), ("pp", pp)):
        if value is not None and (not isinstance(value, int) or value < 1):
            raise ConfigError(f"{name} must be a positive integer, got {value!r}")
    facts = ModelFacts(pipeline_stages=pp if pp is not None and pp > 1 else None,
                       tp_size=tp if tp is not None and tp > 1 else None, built_sharded=zero_init,
                       ep_size=ep if ep is not None and ep > 1 else None)
    return decide(config, world_size, facts, mesh=mesh, micro_batch=micro_batch or 1)


def prefetch_bucket(config: Any) -> int:
    """Stage 3's ``prefetch_bucket_size`` (elements; it bounds a unit's size), as the plan decides it."""
    return sharding_of(config).prefetch_bucket


def train_dtype(config: Any) -> torch.dtype:
    """The plan's compute dtype for ``config``."""
    return precision_of(config).compute


def autocast_dtype(config: Any) -> Optional[torch.dtype]:
    """The dtype ``torch_autocast`` runs the forward in (None: no autocast; torch's CPU default when unnamed)."""
    ac = precision_of(config).autocast
    if ac is None:
        return None
    return ac.dtype if ac.dtype is not None else torch.get_autocast_dtype("cpu")


def state_bytes(step: OptimizerPlan, muon_share: Optional[float] = None) -> float:
    """fp32 optimizer-state bytes per element of the plan's optimizer (AdamW's 8 when it names none). Muon: 4
    (one momentum, no second moment) on the share ``muon_share`` of the elements it steps, its AdamW's 8 on
    the rest (unknown share: all 8)."""
    name = optimizer_name(step)
    if name == "muon":
        share = muon_share or 0.0
        return OPTIMIZER_STATE_BYTES["muon"] * share + OPTIMIZER_STATE_BYTES["adamw"] * (1.0 - share)
    return OPTIMIZER_STATE_BYTES.get(name, 8)


#: the optimizers the offloaded step runs tile by tile (``offload/master.py``); others take its generic path
TILED_OPTIMIZERS = frozenset({"adam", "adamw", "fusedadam", "cpuadam"})


def optimizer_name(step: OptimizerPlan) -> str:
    """The plan's optimizer type, lower case (AdamW when it names none)."""
    return step.optimizer.type.lower() if step.optimizer is not None else "adamw"


def steps_in_tiles(step: OptimizerPlan) -> bool:
    """Whether an offloaded step runs tile by tile through the copier (Adam/AdamW), not whole on the host."""
    return optimizer_name(step) in TILED_OPTIMIZERS


def optimizer_state_bytes(config: Any, muon_share: Optional[float] = None) -> float:
    """fp32 optimizer-state bytes per element of the config's optimizer (AdamW's 8 when it names none)."""
    return state_bytes(optimizer_of(config), muon_share)
