"""What ``initialize`` does for tensor parallelism (called by the builder with the config's values)."""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Dict, Optional

import torch
import torch.nn as nn

from ...comm.collectives import CommsLogger
from ...errors import ConfigError
from ...mesh.topology import Topology
from ...zero.tags import init_shard_of
from .apply import TPReport, apply_tensor_parallel
from .comm import TPGroup
from .inputs import InputConsistencyCheck, model_group_ranks

logger = logging.getLogger("shardspeed")

#: The attribute `tp_model_init` records its arguments under.
TP_ARGS_ATTR = "shardspeed_tp_args"


def tp_model_init(model: nn.Module, tp_size: int, dtype: torch.dtype, config: Optional[Any] = None,
                  **kwargs: Any) -> nn.Module:
    """DeepSpeed's ``deepspeed.tp_model_init``: record the tensor-parallel size (and dtype) on ``model``;
    ``initialize`` splits the model (the config's ``tensor_parallel.autotp_size`` wins where set; a
    different value is an error). Returns ``model``."""
    if not isinstance(tp_size, int) or isinstance(tp_size, bool) or tp_size < 1:
        raise ConfigError(f"tp_model_init: tp_size must be a positive integer, got {tp_size!r}")
    if kwargs:
        raise ConfigError(f"tp_model_init: unsupported argument(s) {sorted(kwargs)}")
    setattr(model, TP_ARGS_ATTR, {"tp_size": tp_size, "dtype": dtype})
    return model


@dataclass
class TensorParallelState:
    group: TPGroup
    report: TPReport
    input_check: InputConsistencyCheck


@torch.no_grad()
def _broadcast_over(group: TPGroup, model: nn.Module) -> None:
    """The model group starts from its rank 0's full weights (before slicing)."""
    seen = set()
    for t in list(model.parameters()) + list(model.buffers()):
        if id(t) not in seen and t.numel():
            seen.add(id(t))
            group.comm.broadcast(t.data, 0)


def setup_tensor_parallel(model: nn.Module, topo: Topology, log: CommsLogger, *, preset_model: Optional[str],
                          partition_config: Optional[Dict[str, Any]], sequence_parallel: bool,
                          train_dtype: torch.dtype) -> Optional[TensorParallelState]:
    """Split ``model`` over the topology's model group (None when that group has one rank)."""
    if topo.model_size == 1:
        return None
    if topo.model_group is None:
        raise ConfigError("tensor parallelism needs the model group: build it from tensor_parallel.autotp_size or "
                          "give mpu= a get_tensor_model_parallel_group()")
    if any(init_shard_of(p) is not None for p in model.parameters()):
        raise ConfigError("tensor_parallel.autotp_size > 1 with a model built under shardspeed.zero.Init: build the "
                          "model normally (its layers are split before ZeRO shards them)")
    recorded = getattr(model, TP_ARGS_ATTR, None)
    if recorded is not None and recorded["dtype"] not in (None, train_dtype):
        raise ConfigError(f"tp_model_init(dtype={recorded['dtype']}) disagrees with the config's training dtype "
                          f"{train_dtype} (the fp16/bf16 blocks); make them agree")
    group = TPGroup.of(topo, log)
    _broadcast_over(group, model)
    report = apply_tensor_parallel(model, group, preset_model=preset_model, partition_config=partition_config,
                                   sequence_parallel=sequence_parallel)
    return TensorParallelState(group, report, InputConsistencyCheck(group, model_group_ranks(topo.model_group)))
