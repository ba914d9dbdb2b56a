"""The plan: frozen dataclasses that say what a run is, in decisions rather than config sections.

:func:`shardspeed.plan.decide` makes one from a config, a world size and a few facts about the model; the
builder assembles the engine from it, and the estimator and the autotuner price it. Nothing here holds a
process group or a tensor.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, Optional, Tuple

import torch

from ..mesh.topology import MESH_DIMS, mesh_dims
from .precision_modes import AutocastPlan, CastPlan

#: Pipeline schedules whose ranks each run two chunks placed as a V (stage r and 2p - 1 - r).
V_SCHEDULES: Tuple[str, ...] = ("zbv", "dualpipev")


@dataclass(frozen=True)
class ModelFacts:
    """What the plan needs to know about the model, read from it by the caller (the plan never sees it).

    ``pipeline_stages``: a ``PipelineModule``'s ``num_stages`` (None: not a pipeline module).
    ``tp_size``: the ``tp_size`` that ``tp_model_init`` recorded on the model (None: not called).
    ``built_sharded``: its parameters were built under ``shardspeed.zero.Init``.
    ``ep_size``: the largest ``ep_size`` of its ``shardspeed.moe.MoE`` layers (None: no MoE layer)."""

    pipeline_stages: Optional[int] = None
    tp_size: Optional[int] = None
    built_sharded: bool = False
    ep_size: Optional[int] = None


@dataclass(frozen=True)
class MeshPlan:
    """Sizes of the named mesh dimensions (a size-1 dimension costs nothing); world = their product."""

    pipe: int = 1
    data: int = 1
    expert: int = 1
    sequence: int = 1
    model: int = 1
    #: the optional dimensions (expert, sequence) the device mesh has even at size 1, because the config
    #: names them (``sequence_parallel_size``): the socket expert and sequence parallelism plug into
    declared: Tuple[str, ...] = ()

    @property
    def dims(self) -> Tuple[str, ...]:
        """The device mesh's dimensions, in order: pipe, data and model always, expert and sequence when
        larger than 1 or declared."""
        return mesh_dims(self.sizes, self.declared)

    @property
    def world(self) -> int:
        return self.pipe * self.data * self.expert * self.sequence * self.model

    @property
    def sizes(self) -> Dict[str, int]:
        return {d: getattr(self, d) for d in MESH_DIMS}

    @property
    def shard_size(self) -> int:
        """Ranks ZeRO partitions dense parameters over: those holding the same ones (data × expert × sequence)."""
        return self.data * self.expert * self.sequence

    @property
    def expert_shard_size(self) -> int:
        """Ranks ZeRO partitions expert parameters over: the expert-data group (data × sequence), the ranks
        with this rank's expert coordinate, which hold the same experts."""
        return self.data * self.sequence

    @property
    def batch_world(self) -> int:
        """The data-parallel degree of the batch arithmetic (global = micro × accumulation × this): ZeRO's
        ranks less the sequence dimension, whose ranks share each sample's sequence (expert ranks read
        different samples)."""
        return self.shard_size // self.sequence


@dataclass(frozen=True)
class ZeroPlusPlan:
    """ZeRO++ at stage 3 (all off by default).

    ``weights``: "all" (qwZ: every parameter all-gather carries ``weight_bits``-bit codes), "frozen" (only
    units without trainable parameters), or "none". ``gradient_bits``: qgZ, the gradient reduction is an
    all-to-all of codes summed in fp32 (0: a plain reduce-scatter). ``block``: values per fp32 scale.
    ``hpz``: ranks of the secondary partition (hpZ): after a unit's forward its parameters stay split over
    the ``hpz`` consecutive data ranks of a node, and backward gathers inside them (1: off)."""

    weights: str = "none"
    weight_bits: int = 8
    gradient_bits: int = 0
    block: int = 256
    hpz: int = 1

    @property
    def enabled(self) -> bool:
        return self.weights != "none" or self.gradient_bits > 0 or self.hpz > 1


@dataclass(frozen=True)
class ShardingPlan:
    """What ZeRO partitions, how gradients are reduced, and how stage 3 gathers.

    ``reduce_op``: "all_reduce" or "reduce_scatter". ``reduce_every_micro_step``: reduce each backward and keep
    only the shard (stages 2-3 outside a pipeline); otherwise gradients accumulate locally until the
    boundary. ``unit_world``: ranks a flat unit is split over (1 at stage 0). ``buckets_alive``: the bound
    on full-size gradient buckets alive at once during a backward, the one being filled included (stage 2:
    3, two reductions in flight while the next fills). Stage 3 (None here) bounds them in elements instead,
    one largest unit's worth, measured by the builder (``stage3_units.largest_unit_numel``): a block-sized
    unit's reduction finishes before the next block's gradients are collected, while smaller units keep
    several in flight. Stages 0-1: None, they keep their buckets anyway."""

    stage: int
    partition_optimizer: bool
    partition_gradients: bool
    partition_parameters: bool
    reduce_op: str
    reduce_every_micro_step: bool
    gather_after_step: bool
    overlap: bool
    unit_world: int
    reduce_bucket: int
    buckets_alive: Optional[int]
    prefetch_bucket: int
    persistence_threshold: int
    max_live_parameters: int
    gather_16bit_weights_on_save: bool
    zeropp: ZeroPlusPlan = ZeroPlusPlan()
    #: ranks of the reduce group whose gradients are summed, not averaged: the sequence ranks under
    #: ``sequence_parallel_gradients`` "sum" (DeepSpeed divides by data only), else 1
    summed_ranks: int = 1


@dataclass(frozen=True)
class PlacementPlan:
    """Where each state lives: "device", "host" or "file" (NVMe).

    ``params``: stage-3 parameter shards between gathers. ``optimizer``: fp32 masters and optimizer states.
    ``tile_elems``: elements per offloaded optimizer tile (sub_group_size)."""

    params: str = "device"
    optimizer: str = "device"
    params_path: Optional[str] = None
    optimizer_path: Optional[str] = None
    pin_memory: bool = True
    params_pin_memory: bool = True
    tile_elems: int = 1_000_000_000
    buffer_count: int = 4
    ratio: float = 1.0


@dataclass(frozen=True)
class LossScalePlan:
    """fp16's loss scaling (DeepSpeed's semantics); ``dynamic`` False means a static ``static_scale``."""

    enabled: bool = False
    static_scale: float = 0.0
    initial_scale_power: int = 16
    window: int = 1000
    hysteresis: int = 2
    consecutive_hysteresis: bool = False
    min_scale: float = 1.0

    @property
    def dynamic(self) -> bool:
        return self.enabled and self.static_scale == 0


@dataclass(frozen=True)
class PrecisionPlan:
    """Dtypes of computation, masters (fp32, or bf16 with ``bf16_master_weights_and_grads``), optimizer states
    (``states``: fp32, or bf16 with ``bf16_optimizer_states``), gradient collectives and gradient accumulation;
    ``autocast``: ``torch_autocast`` (None: off); ``cast``: how the
    module's parameters and buffers are cast (``data_types``)."""

    compute: torch.dtype = torch.float32
    master: torch.dtype = torch.float32
    states: torch.dtype = torch.float32
    reduce: torch.dtype = torch.float32
    accumulate: torch.dtype = torch.float32
    loss_scale: LossScalePlan = LossScalePlan()
    check_overflow: bool = True
    predivide_factor: float = 1.0
    autocast: Optional[AutocastPlan] = None
    cast: CastPlan = CastPlan()


@dataclass(frozen=True)
class BatchPlan:
    """The batch arithmetic, resolved: global = micro × accumulation × data-parallel size (``MeshPlan.batch_world``)."""

    global_batch: int
    micro_batch: int
    accumulation_steps: int
    drop_last: bool = False  # the training data loader drops the last incomplete batch


@dataclass(frozen=True)
class CheckpointingPlan:
    """Activation checkpointing: ``blocks`` checkpoints every transformer block with ``policy``;
    ``configure``: these settings replace whatever shardspeed.checkpointing holds.

    What every checkpoint does: ``partitioned`` splits its saved inputs over the model (tensor-parallel)
    dimension; ``on_host`` keeps them in host memory; ``contiguous`` copies the partitions into one
    preallocated buffer per input position, sized by ``checkpoints_per_forward`` (the checkpointed blocks one
    forward runs); ``synchronize`` synchronises the device around each forward and backward; ``profile``
    times them."""

    blocks: bool = False
    policy: str = "full"
    configure: bool = False
    partitioned: bool = False
    on_host: bool = False
    contiguous: bool = False
    checkpoints_per_forward: Optional[int] = None
    synchronize: bool = False
    profile: bool = False


@dataclass(frozen=True)
class SavePlan:
    """Checkpoint saves: ``async_save`` is ``save_checkpoint``'s default (write and commit in the background)."""

    async_save: bool = False
    tag_validation: str = "WARN"  # ranks saving under different tags: "WARN", "IGNORE" or "FAIL"


@dataclass(frozen=True)
class PipelinePlan:
    """The pipeline schedule (meaningful when the mesh's pipe dimension is > 1 or the model is a pipeline):
    ``virtual_stages`` is the stages each pipe rank runs, resolved for the schedule."""

    stages: int = 1
    schedule: str = "1f1b"
    virtual_stages: int = 1


@dataclass(frozen=True)
class TensorParallelPlan:
    """How the model dimension splits layers."""

    size: int = 1
    preset_model: Optional[str] = None
    partition_config: Any = None
    sequence_parallel: bool = False


@dataclass(frozen=True)
class TypedBlock:
    """An ``{"type": ..., "params": {...}}`` block of the config: an optimizer or an LR schedule by name."""

    type: str
    params: Dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class OptimizerPlan:
    """The optimizer step: the optimizer and LR schedule the config names (None: the user's objects, or none:
    a forward-only engine), and the global gradient norm's clip (0: off)."""

    optimizer: Optional[TypedBlock] = None
    scheduler: Optional[TypedBlock] = None
    gradient_clipping: float = 0.0


@dataclass(frozen=True)
class ExpertsPlan:
    """AutoEP: ``convert`` replaces the experts of a Hugging Face model's MoE blocks (found by ``preset_model``
    or ``moe_layer_pattern``, held in ``expert_pattern``) with expert-parallel ones at initialize."""

    convert: bool = False
    preset_model: Optional[str] = None
    moe_layer_pattern: Optional[str] = None
    expert_pattern: Optional[str] = None
    use_grouped_mm: bool = True


@dataclass(frozen=True)
class CommsLoggerPlan:
    """What the collectives record: every call (``prof_all``) or those of ``prof_ops`` when ``enabled``, each
    printed (``verbose``) with its caller (``debug``); byte totals are always kept."""

    enabled: bool = False
    verbose: bool = False
    prof_all: bool = True
    debug: bool = False
    prof_ops: Tuple[str, ...] = ()


@dataclass(frozen=True)
class FlopsProfilerPlan:
    """The step profiler (``enabled``): which step it profiles and what its report shows."""

    enabled: bool = False
    profile_step: int = 1
    module_depth: int = -1
    top_modules: int = 1
    detailed: bool = True
    output_file: Optional[str] = None
    recompute_fwd_factor: float = 0.0


@dataclass(frozen=True)
class LogDirPlan:
    """A monitor writing files under ``output_path``/``job_name`` (TensorBoard, CSV)."""

    output_path: str = ""
    job_name: str = "DeepSpeedJobName"


@dataclass(frozen=True)
class WandbPlan:
    project: str = "deepspeed"
    group: Optional[str] = None
    team: Optional[str] = None


@dataclass(frozen=True)
class CometPlan:
    samples_log_interval: int = 100
    project: Optional[str] = None
    workspace: Optional[str] = None
    api_key: Optional[str] = field(default=None, repr=False)
    experiment_name: Optional[str] = None
    experiment_key: Optional[str] = None
    online: Optional[bool] = None
    mode: Optional[str] = None


@dataclass(frozen=True)
class MonitorPlan:
    """The monitors written to: one plan per enabled monitor, None for the others."""

    tensorboard: Optional[LogDirPlan] = None
    csv: Optional[LogDirPlan] = None
    wandb: Optional[WandbPlan] = None
    comet: Optional[CometPlan] = None

    @property
    def enabled(self) -> bool:
        return any(m is not None for m in (self.tensorboard, self.csv, self.wandb, self.comet))


@dataclass(frozen=True)
class TrialPlan:
    """An autotuning trial: measure optimizer steps ``start_step``..``end_step``, write the metrics to
    ``metric_path`` (None: ``autotuning_metric.json`` in the working directory) and exit."""

    start_step: int = 3
    end_step: int = 5
    metric_path: Optional[str] = None


@dataclass(frozen=True)
class ReportPlan:
    """What the engine reports: a progress line every ``steps_per_print`` steps (with the memory breakdown),
    timers (``wall_clock_breakdown``), collectives, monitors, the FLOPs profiler and an autotuning trial's
    window (None: not a trial). ``config_dump``: the resolved config, secrets masked, that rank 0 logs at
    initialize (``dump_state``; None: not logged)."""

    steps_per_print: Optional[int] = None
    wall_clock_breakdown: bool = False
    memory_breakdown: bool = False
    config_dump: Optional[str] = None
    comms_logger: CommsLoggerPlan = CommsLoggerPlan()
    monitors: MonitorPlan = MonitorPlan()
    flops_profiler: FlopsProfilerPlan = FlopsProfilerPlan()
    trial: Optional[TrialPlan] = None


@dataclass(frozen=True)
class ConfigSource:
    """The config the plan was decided from, for the engine's ``config`` (``given``: the dict given, as
    DeepSpeed keeps it) and ``shardspeed_config`` (``loaded``: the validated config) properties only: no part
    reads it, each reads its own decisions."""

    given: Dict[str, Any]
    loaded: Any


@dataclass(frozen=True)
class Plan:
    """Everything :func:`~shardspeed.plan.decide` decided; the builder assembles the engine from this alone."""

    mesh: MeshPlan
    sharding: ShardingPlan
    placement: PlacementPlan
    precision: PrecisionPlan
    batch: BatchPlan
    checkpointing: CheckpointingPlan
    pipeline: PipelinePlan
    tensor_parallel: TensorParallelPlan
    save: SavePlan = SavePlan()
    optimizer: OptimizerPlan = OptimizerPlan()
    experts: ExpertsPlan = ExpertsPlan()
    report: ReportPlan = ReportPlan()
    source: Optional[ConfigSource] = field(default=None, repr=False, compare=False)
