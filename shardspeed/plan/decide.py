"""``decide(config, world_size, facts) -> Plan``: every decision about a run, in one pure function.

Pure: it reads the config and the facts it is given, creates no process group and no tensor, so it is
tested with plain objects. The config is read, parsed and loaded once, here (the builder never sees it);
every contradiction between keys, or between the config and the model's facts, is a
:class:`~shardspeed.errors.ConfigError` naming the keys.
"""
from __future__ import annotations

from types import MappingProxyType
from typing import Any, Optional

import torch

from ..config import ShardspeedConfig, load_config, parse_config
from ..errors import ConfigError
from .precision_modes import AutocastPlan, autocast_plan, cast_plan, master_dtype, state_dtype
from .sections import (
    config_source,
    experts_plan,
    optimizer_plan,
    pipeline_plan,
    read_given,
    report_plan,
    with_micro_batch,
)
from .types import (
    BatchPlan,
    CheckpointingPlan,
    LossScalePlan,
    MeshPlan,
    ModelFacts,
    PlacementPlan,
    Plan,
    PrecisionPlan,
    SavePlan,
    ShardingPlan,
    TensorParallelPlan,
    ZeroPlusPlan,
)

_DTYPES = MappingProxyType({"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16})
#: ``torch_autocast`` in fp16 without the fp16 block: DeepSpeed's torch.amp.GradScaler at its defaults (scale
#: 2**16, halved on each overflow, doubled after 2000 steps without one, no floor)
GRAD_SCALER = LossScalePlan(enabled=True, initial_scale_power=16, window=2000, hysteresis=1, min_scale=2.0 ** -24)


def autocast_scales(autocast: Optional[AutocastPlan], fp16_enabled: bool) -> bool:
    """fp16 autocast takes GradScaler's dynamic scale unless the fp16 block scales already."""
    return autocast is not None and autocast.dtype == torch.float16 and not fp16_enabled


def decide(config: Any, world_size: int, facts: Optional[ModelFacts] = None, *,
           mesh: Optional[MeshPlan] = None, micro_batch: Optional[int] = None) -> Plan:
    """The plan of a run of ``world_size`` ranks. ``config``: a dict, a JSON path or a parsed
    ``ShardspeedConfig``, read, parsed and loaded here only. ``mesh``: sizes that come from elsewhere (a user's
    ``mpu``), checked against the config's instead of derived from it. ``micro_batch``: the micro-batch of a
    config that gives no batch size (the estimator prices one; None: such a config is refused)."""
    facts = facts if facts is not None else ModelFacts()
    given = with_micro_batch(config, micro_batch) if micro_batch is not None else read_given(config)
    parsed = parse_config(given)
    mesh = _mesh(parsed, world_size, facts, mesh)
    cfg = load_config(parsed, world_size=mesh.batch_world)
    _check(cfg, mesh, facts)
    assert cfg.train_batch_size is not None and cfg.train_micro_batch_size_per_gpu is not None
    assert cfg.gradient_accumulation_steps is not None  # load_config resolved the trio
    return Plan(
        mesh=mesh, sharding=sharding_plan(cfg, mesh, pipelined=facts.pipeline_stages is not None),
        placement=placement_plan(cfg), precision=precision_plan(cfg),
        batch=BatchPlan(cfg.train_batch_size, cfg.train_micro_batch_size_per_gpu, cfg.gradient_accumulation_steps,
                        drop_last=bool(cfg.dataloader_drop_last)),
        checkpointing=checkpointing_plan(cfg),
        pipeline=pipeline_plan(cfg, mesh.pipe, pipelined=facts.pipeline_stages is not None),
        tensor_parallel=TensorParallelPlan(size=mesh.model, preset_model=cfg.tensor_parallel.preset_model,
                                           partition_config=cfg.tensor_parallel.partition_config,
                                           sequence_parallel=bool(cfg.tensor_parallel.sequence_parallel)),
        save=SavePlan(async_save=bool(cfg.checkpoint.async_save), tag_validation=cfg.checkpoint.tag_validation),
        optimizer=optimizer_plan(cfg), experts=experts_plan(cfg), report=report_plan(cfg),
        source=config_source(given, parsed, cfg),
    )


def _mesh(cfg: ShardspeedConfig, world: int, facts: ModelFacts, given: Optional[MeshPlan]) -> MeshPlan:
    pipe, tp, seq = _pipe_size(cfg, facts), _tp_size(cfg, facts), int(cfg.sequence_parallel_size)
    if given is not None:
        if seq > 1 and seq != given.sequence:
            raise ConfigError(f"sequence_parallel_size {seq} disagrees with mpu=, whose sequence-parallel group has "
                              f"size {given.sequence}; make them agree")
        for key, want, got in (("pipeline.stages", pipe, given.pipe), ("tensor_parallel.autotp_size", tp, given.model)):
            if want > 1 and want != got:
                raise ConfigError(f"{key} {want} disagrees with mpu=, whose groups have size {got}; remove {key} "
                                  f"(the mpu decides the groups) or make them agree")
        return given
    if world % (pipe * tp * seq):
        by_seq = f" × sequence_parallel_size {seq}" if seq > 1 else ""
        raise ConfigError(f"world {world} is not divisible by pipeline.stages {pipe} × tensor_parallel.autotp_size "
                          f"{tp}{by_seq} = {pipe * tp * seq}")
    if pipe > 1 and facts.pipeline_stages is None:
        raise ConfigError(f"pipeline.stages {pipe} needs a shardspeed.pipe.PipelineModule model; build it as "
                          f"PipelineModule(layers=..., num_stages={pipe}) or set pipeline.stages to 1")
    declared = ("sequence",) if "sequence_parallel_size" in cfg.model_fields_set else ()
    ep = _expert_size(cfg, facts, world // (pipe * tp * seq))
    return MeshPlan(pipe=pipe, data=world // (pipe * tp * seq * ep), expert=ep, sequence=seq, model=tp,
                    declared=declared + (("expert",) if ep > 1 or facts.ep_size is not None else ()))


def _expert_size(cfg: ShardspeedConfig, facts: ModelFacts, data_ranks: int) -> int:
    """The mesh's expert dimension: the model's largest MoE ``ep_size``, else ``expert_parallel.autoep_size``
    (when enabled); it divides the ranks that hold the same dense parameters (data × expert)."""
    ep_cfg = cfg.expert_parallel
    auto = int(ep_cfg.autoep_size) if ep_cfg.enabled else 1
    if facts.ep_size is not None and facts.ep_size > 1 and auto > 1 and auto != facts.ep_size:
        raise ConfigError(f"expert_parallel.autoep_size {auto} disagrees with the model's MoE layers (ep_size "
                          f"{facts.ep_size}); make them equal or disable expert_parallel")
    ep = max(facts.ep_size or 1, auto)
    if data_ranks % ep:
        key = "expert_parallel.autoep_size" if auto > 1 else f"MoE(ep_size={ep})"
        raise ConfigError(f"{key} {ep} must divide the {data_ranks} data-parallel ranks (world / (pipeline.stages "
                          f"× tensor_parallel.autotp_size × sequence_parallel_size))")
    if ep > 1 and cfg.use_data_before_expert_parallelism:
        raise ConfigError("use_data_before_expert_parallelism true (expert groups strided over the data ranks) is "
                          "not supported; set it to false (expert-parallel ranks are neighbours)")
    return ep


def _pipe_size(cfg: ShardspeedConfig, facts: ModelFacts) -> int:
    """A PipelineModule's num_stages (``pipeline.stages`` must agree when set), else ``pipeline.stages``."""
    stages = cfg.pipeline.stages
    if facts.pipeline_stages is not None:
        if stages != "auto" and int(stages) != facts.pipeline_stages:
            raise ConfigError(f"pipeline.stages {stages} disagrees with the PipelineModule's num_stages "
                              f"{facts.pipeline_stages}; remove pipeline.stages or make them agree")
        return facts.pipeline_stages
    return cfg.pipeline.num_stages


def _tp_size(cfg: ShardspeedConfig, facts: ModelFacts) -> int:
    """``tensor_parallel.autotp_size`` (0/1: none), else what tp_model_init recorded (they must agree)."""
    size = int(cfg.tensor_parallel.autotp_size)
    if facts.tp_size is None:
        return max(size, 1)
    if size > 0 and size != facts.tp_size:
        raise ConfigError(f"tensor_parallel.autotp_size {size} disagrees with tp_model_init(tp_size="
                          f"{facts.tp_size}); make them equal or drop one")
    return facts.tp_size


def _check(cfg: ShardspeedConfig, mesh: MeshPlan, facts: ModelFacts) -> None:
    """Contradictions between keys, or between the config and the model, that the config alone cannot see."""
    stage = cfg.zero_optimization.stage
    if facts.built_sharded and stage != 3:
        raise ConfigError(f"the model was built under shardspeed.zero.Init (parameters sharded at construction), "
                          f"which needs zero_optimization.stage 3; the config says stage {stage}")
    if mesh.sequence > 1 and (mesh.pipe > 1 or facts.pipeline_stages is not None):
        raise ConfigError(f"sequence_parallel_size {mesh.sequence} with pipeline parallelism (pipeline.stages "
                          f"{mesh.pipe}): not supported; set sequence_parallel_size to 1 or use one pipeline stage")
    if facts.pipeline_stages is not None and cfg.tensor_parallel.sequence_parallel and mesh.model > 1:
        raise ConfigError("tensor_parallel.sequence_parallel with a PipelineModule: stages exchange whole-sequence "
                          "activations (the pipeline's layers are not sequence-split); set sequence_parallel to "
                          "false")


def reduce_op_for(stage: int, reduce_scatter: bool = True) -> str:
    """ZeRO's gradient collective: all-reduce at stage 0; reduce-scatter at stages 1-3, unless
    ``reduce_scatter`` (DeepSpeed's key) is false at stages 1-2 (all-reduce, each rank keeping its part)."""
    return "reduce_scatter" if stage >= 1 and (reduce_scatter or stage == 3) else "all_reduce"


def sharding_plan(cfg: ShardspeedConfig, mesh: MeshPlan, pipelined: bool = False) -> ShardingPlan:
    """ZeRO's decisions for ``cfg.zero_optimization.stage``. ``pipelined``: a pipeline schedule's
    micro-batches accumulate locally, one reduction at the boundary."""
    z = cfg.zero_optimization
    stage = z.stage
    alive = {2: 3}.get(stage)
    return ShardingPlan(
        stage=stage, partition_optimizer=stage >= 1, partition_gradients=stage >= 2,
        partition_parameters=stage == 3, reduce_op=reduce_op_for(stage, bool(z.reduce_scatter)),
        reduce_every_micro_step=stage >= 2 and not pipelined, gather_after_step=stage in (1, 2),
        overlap=bool(z.overlap_comm), unit_world=1 if stage == 0 else mesh.shard_size,
        reduce_bucket=int(z.reduce_bucket_size), buckets_alive=alive,
        prefetch_bucket=int(z.prefetch_bucket_size), persistence_threshold=int(z.param_persistence_threshold),
        max_live_parameters=int(z.max_live_parameters),
        gather_16bit_weights_on_save=bool(z.gather_16bit_weights_on_model_save), zeropp=zeropp_plan(cfg, mesh),
        summed_ranks=mesh.sequence if cfg.sequence_parallel_gradients == "sum" else 1,
    )


def zeropp_plan(cfg: ShardspeedConfig, mesh: MeshPlan) -> ZeroPlusPlan:
    """ZeRO++'s keys: stage 3 only; hpZ's partition divides the ranks ZeRO shards over."""
    z = cfg.zero_optimization
    hpz = max(int(z.zero_hpz_partition_size), 1)
    weights = "all" if z.zero_quantized_weights else "frozen" if z.zero_quantized_nontrainable_weights else "none"
    keys = [k for k, on in (("zero_quantized_weights", z.zero_quantized_weights),
                            ("zero_quantized_nontrainable_weights", z.zero_quantized_nontrainable_weights),
                            ("zero_quantized_gradients", z.zero_quantized_gradients),
                            ("zero_hpz_partition_size", hpz > 1)) if on]
    if keys and z.stage != 3:
        raise ConfigError(f"zero_optimization.{keys[0]} is ZeRO++, which works on stage-3 collectives; set "
                          f"zero_optimization.stage to 3 or remove {keys[0]}")
    for key in ("zero_quantized_weights_bits", "zero_quantized_gradients_bits"):
        if getattr(z, key) not in (4, 8):
            raise ConfigError(f"zero_optimization.{key} must be 8 or 4, not {getattr(z, key)}")
    if z.zero_quantization_block_size % 2:
        raise ConfigError(f"zero_optimization.zero_quantization_block_size must be even (int4 packs two values a "
                          f"byte), not {z.zero_quantization_block_size}")
    if hpz > 1 and mesh.shard_size % hpz:
        raise ConfigError(f"zero_optimization.zero_hpz_partition_size {hpz} must divide the {mesh.shard_size} "
                          f"data-parallel ranks stage 3 shards over")
    return ZeroPlusPlan(weights=weights, weight_bits=int(z.zero_quantized_weights_bits),
                        gradient_bits=int(z.zero_quantized_gradients_bits) if z.zero_quantized_gradients else 0,
                        block=int(z.zero_quantization_block_size), hpz=hpz)


def checkpointing_plan(cfg: ShardspeedConfig) -> CheckpointingPlan:
    """``activation_checkpointing``: ``enabled`` checkpoints every block; ``configure`` when the config has the
    block at all (a config without it leaves a user's earlier ``checkpointing.configure()`` in force)."""
    ck = cfg.activation_checkpointing
    return CheckpointingPlan(
        blocks=bool(ck.enabled), policy=ck.policy, configure="activation_checkpointing" in cfg.model_fields_set,
        partitioned=bool(ck.partition_activations), on_host=bool(ck.cpu_checkpointing),
        contiguous=bool(ck.contiguous_memory_optimization), checkpoints_per_forward=ck.number_checkpoints,
        synchronize=bool(ck.synchronize_checkpoint_boundary), profile=bool(ck.profile),
    )


def placement_plan(cfg: ShardspeedConfig) -> PlacementPlan:
    """``offload_param`` / ``offload_optimizer``: "cpu" is host memory, "nvme" files under ``nvme_path``."""
    z = cfg.zero_optimization
    where = {"none": "device", "cpu": "host", "nvme": "file"}
    op, oo = z.offload_param, z.offload_optimizer
    return PlacementPlan(
        params=where[op.device] if op is not None else "device",
        optimizer=where[oo.device] if oo is not None else "device",
        params_path=op.nvme_path if op is not None else None,
        optimizer_path=oo.nvme_path if oo is not None else None,
        pin_memory=bool(oo.pin_memory) if oo is not None else True,
        params_pin_memory=bool(op.pin_memory) if op is not None else True,
        tile_elems=int(z.sub_group_size), buffer_count=int(oo.buffer_count) if oo is not None else 4,
        ratio=float(oo.ratio) if oo is not None else 1.0,
    )


def precision_plan(cfg: ShardspeedConfig) -> PrecisionPlan:
    """Compute dtype from fp16/bf16, collectives in ``communication_data_type``, accumulation in
    ``data_types.grad_accum_dtype`` (default: the compute dtype); overflowing steps are skipped with fp16 and,
    unless ``bf16.check_grad_overflow`` is false, in every dtype (DeepSpeed skips them at stages 1-3)."""
    f = cfg.fp16
    name = cfg.data_types.grad_accum_dtype if cfg.data_types is not None else None
    autocast = autocast_plan(cfg)
    return PrecisionPlan(
        compute=cfg.train_dtype, reduce=cfg.comm_dtype, master=master_dtype(cfg), states=state_dtype(cfg),
        autocast=autocast,
        cast=cast_plan(cfg),
        accumulate=_DTYPES[name] if name is not None else cfg.train_dtype,
        loss_scale=LossScalePlan(enabled=bool(f.enabled), static_scale=float(f.loss_scale),
                                 initial_scale_power=int(f.initial_scale_power), window=int(f.loss_scale_window),
                                 hysteresis=int(f.hysteresis), consecutive_hysteresis=bool(f.consecutive_hysteresis),
                                 min_scale=float(f.min_loss_scale)) if not autocast_scales(autocast, f.enabled)
        else GRAD_SCALER,
        check_overflow=bool(f.enabled) or bool(cfg.bf16.check_grad_overflow) or autocast_scales(autocast, False),
        predivide_factor=float(cfg.gradient_predivide_factor) if cfg.prescale_gradients else 1.0,
    )
