"""What the builder hands the engine: :class:`EngineParts`, every part typed and built before the engine."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Dict, Iterable, Optional, Union

import torch
import torch.nn as nn

from ..checkpoint.async_save import AsyncSaves
from ..comm.collectives import Collectives, CommsLogger
from ..errors import ShardspeedError
from ..mesh.current import EngineScope
from ..mesh.topology import Topology
from ..monitor.timers import Timers
from ..optim.schedules import SchedulerLike
from ..precision.loss_scaler import DynamicLossScaler, StaticLossScaler
from ..zero.master import MasterWeights
from ..zero.root import ZeroRoot

if TYPE_CHECKING:  # pragma: no cover
    from ..autotune.probe import ProfileWindow
    from ..monitor.step_events import StepEvents
    from ..parallel.tp.inputs import InputConsistencyCheck
    from ..plan import Plan
    from ..profiling.engine_profiler import StepFlopsProfiler


@dataclass(frozen=True)
class EngineParts:
    """Everything the engine orchestrates; built by the builder from the plan."""

    module: nn.Module
    topology: Topology
    collectives: Collectives
    comms_logger: CommsLogger
    zero: ZeroRoot  # the units under their root: gradient reduction at every stage, gathers at stage 3
    master: MasterWeights
    loss_scaler: Union[StaticLossScaler, DynamicLossScaler]
    lr_scheduler: Optional[SchedulerLike]  # a torch LR scheduler, one of shardspeed.optim.schedules, the user's
    train_batch_size: int
    micro_batch_size: int
    gradient_accumulation_steps: int
    gradient_clipping: float
    zero_stage: int
    train_dtype: torch.dtype
    timers: Timers  # wall_clock_breakdown (disabled timers cost nothing); the root times its end-of-backward wait too
    steps_per_print: Optional[int] = None
    wall_clock_breakdown: bool = False
    memory_breakdown: bool = False  # each steps_per_print line logs engine.memory_breakdown()
    training_dataloader: Optional[Iterable] = None
    gather_16bit_weights_on_save: bool = False  # stage 3: save_16bit_model gathers the units
    plan: Optional[Plan] = None  # the plan the parts were built from: DeepSpeed's getters answer from it
    config_dict: Optional[Dict[str, Any]] = None  # engine.config: the config as given (DeepSpeed's engine.config)
    flops_profiler: Optional[StepFlopsProfiler] = None  # flops_profiler.enabled
    monitor: Optional[StepEvents] = None  # a monitor block is enabled
    input_check: Optional[InputConsistencyCheck] = None  # TP: the first forwards' inputs agree over the model group
    profile_window: Optional[ProfileWindow] = None  # autotuning.enabled: a tuner's trial
    #: tensor parallelism: the world's collectives, for checkpoints (every rank writes its own file into one
    #: checkpoint); None when the data group is the checkpoint's world
    world_collectives: Optional[Collectives] = None
    async_save: bool = False  # checkpoint.async_save: save_checkpoint's default
    tag_validation: str = "WARN"  # checkpoint.tag_validation: ranks saving under different tags
    async_saves: AsyncSaves = field(default_factory=AsyncSaves)  # the save in flight, its writer group
    scope: EngineScope = field(default_factory=EngineScope)  # what DeepSpeed's module-level functions see of it
    autocast: Optional[torch.dtype] = None  # torch_autocast: the forward runs under torch.autocast(device, this)


def move_inputs(obj, device: torch.device, dtype: torch.dtype):
    """Tensors go to the engine's device; floating-point ones take the training dtype (as model weights do)."""
    if torch.is_tensor(obj):
        if obj.is_floating_point() and obj.dtype != dtype:
            return obj.to(device=device, dtype=dtype)
        return obj.to(device) if obj.device != device else obj
    if isinstance(obj, tuple):
        return tuple(move_inputs(o, device, dtype) for o in obj)
    if isinstance(obj, list):
        return [move_inputs(o, device, dtype) for o in obj]
    if isinstance(obj, dict):
        return {k: move_inputs(v, device, dtype) for k, v in obj.items()}
    return obj


def no_move_error(what: str, device: torch.device, dtype: torch.dtype) -> ShardspeedError:
    """``engine.to(...)`` / ``half()`` / ...: why the engine does not move or cast."""
    return ShardspeedError(
        f"engine.{what}: the engine's parameters are views of its flat ZeRO buffers on {device} in {dtype}, and "
        f"the fp32 master weights and optimizer state would not follow. Choose the device (LOCAL_RANK / the "
        f"accelerator) and dtype (bf16/fp16 in the config) before shardspeed.initialize; move or cast the model "
        f"before initializing.")
