"""One job: the builder, which assembles the engine's parts from what :func:`shardspeed.plan.decide` decided (the
Plan alone; this module reads no config)."""
from __future__ import annotations

import dataclasses
import logging
import math
from typing import Any, Callable, ContextManager, Dict, Iterable, List, Optional, Sequence, Tuple

import torch
import torch.nn as nn

from ..autotune.probe import build_profile_window
from ..checkpointing import configure_from_plan
from ..comm.collectives import Collectives, CommsLogger
from ..comm.quantize import BlockCodec
from ..errors import ConfigError
from ..mesh.current import CURRENT, EngineScope
from ..mesh.init import init_distributed
from ..mesh.mpu import MeshMPU
from ..mesh.topology import Topology, TopologyRegistry
from ..moe.utils import has_moe_layers, largest_ep_size
from ..monitor.timers import Timers
from ..offload import OffloadedMasterWeights, OffloadPlan
from ..offload.param_file import FilePlacement, NvmeParamFile
from ..optim import build_optimizer, build_scheduler, retarget_optimizer
from ..parallel.tp.setup import TP_ARGS_ATTR, setup_tensor_parallel
from ..pipe.module import PipelineModule
from ..pipe.plan import plan_pipeline
from ..pipe.ties import TiedGradients, build_tie_groups
from ..plan import (
    CommsLoggerPlan,
    FlopsProfilerPlan,
    LossScalePlan,
    MeshPlan,
    ModelFacts,
    OptimizerPlan,
    PlacementPlan,
    Plan,
    decide,
)
from ..precision import build_loss_scaler
from ..precision.casting import COMM_DTYPE_ATTR
from ..zero.init import init_shard_of, refuse_deepspeed_partitioned
from ..zero.layout import group_by_size
from ..zero.master import MasterWeights
from ..zero.owned_unit import ReduceOp, ReducePolicy
from ..zero.parameter_offload import attach_parameter_offload
from ..zero.placement import DevicePlacement, HostPlacement, ShardPlacement
from ..zero.root import ZeroRoot
from ..zero.stage3_units import build_stage3_units
from ..zero.unit import FlatParamUnit
from .dataloader import build_dataloader
from .engine import Engine
from .experts import ExpertParts, broadcast_module_state, build_flat_units, prepare_experts
from .forward_engine import ForwardEngine
from .muon_parts import bind_muon, muon_groups
from .parts import EngineParts
from .pipeline_engine import PipelineEngine
from .precision_setup import prepare_precision
from .sequence_parallel.attention_check import check_attention_on_first_forward

logger = logging.getLogger("shardspeed")


def _param_groups(module: nn.Module, model_parameters, optimizer) -> List[dict]:
    """Normalise the user's parameters into a list of groups (dicts with 'params' and hyper-parameters)."""
    if isinstance(optimizer, torch.optim.Optimizer):
        return [dict(g) for g in optimizer.param_groups]
    if model_parameters is None:
        return [{"params": list(module.parameters())}]
    items = list(model_parameters)
    if items and isinstance(items[0], dict):
        return [dict(g, params=list(g["params"])) for g in items]
    if items and isinstance(items[0], tuple):  # named_parameters()
        items = [p for _, p in items]
    return [{"params": items}]


def _trainable_in_grad_order(module: nn.Module, groups: List[dict]) -> Tuple[List[nn.Parameter], Dict[int, int]]:
    """Trainable parameters, deduplicated (tied weights once), in the order autograd tends to produce their
    gradients (reverse of registration), and the group index of each."""
    group_of: Dict[int, int] = {}
    for gi, g in enumerate(groups):
        for p in g["params"]:
            group_of.setdefault(id(p), gi)
    seen, ordered = set(), []
    for p in module.parameters():
        if id(p) in seen or not p.requires_grad or id(p) not in group_of:
            continue
        seen.add(id(p))
        ordered.append(p)
    ordered.reverse()
    return ordered, group_of


def _build_units(params: List[nn.Parameter], bucket_elems: int, world: int, rank: int,
                 alone: Sequence[nn.Parameter] = ()) -> List[FlatParamUnit]:
    """Units of at most ``bucket_elems`` elements, one dtype each; each parameter of ``alone`` in a unit of
    its own."""
    units: List[FlatParamUnit] = []
    single = {id(p) for p in alone}
    for p in params:
        if id(p) in single:
            units.append(FlatParamUnit([p], world=world, rank=rank, index=len(units)))
    # keep dtypes apart: one flat buffer has one dtype (and, under torch_autocast, one wire dtype)
    by_dtype: Dict[Tuple[torch.dtype, Optional[torch.dtype]], List[nn.Parameter]] = {}
    for p in params:
        if id(p) not in single:
            by_dtype.setdefault((p.dtype, getattr(p, COMM_DTYPE_ATTR, None)), []).append(p)
    for plist in by_dtype.values():
        for idx in group_by_size([p.numel() for p in plist], bucket_elems):
            units.append(FlatParamUnit([plist[i] for i in idx], world=world, rank=rank, index=len(units)))
    return units


def _optimizer_factory(step: OptimizerPlan, groups: List[dict], client_optimizer) -> Callable[[List[dict]], Any]:
    hyper = [{k: v for k, v in g.items() if k != "params"} for g in groups]

    def make(piece_groups: List[dict]):
        full = [dict(hyper[g.pop("_group")], **g) for g in (dict(x) for x in piece_groups)]
        if step.optimizer is not None:
            return build_optimizer(step.optimizer, full)
        if callable(client_optimizer) and not isinstance(client_optimizer, torch.optim.Optimizer):
            return client_optimizer(full)
        return retarget_optimizer(client_optimizer, full)  # the user's object is the one stepped

    return make


def _scheduler(step: OptimizerPlan, optimizer, client_scheduler):
    if step.scheduler is not None:
        return build_scheduler(step.scheduler, optimizer)
    if client_scheduler is None:
        return None
    if callable(client_scheduler) and not hasattr(client_scheduler, "step"):
        return client_scheduler(optimizer)
    client_scheduler.optimizer = optimizer  # a scheduler built on the user's optimizer: point it at ours
    return client_scheduler


def build_comms_logger(cl: CommsLoggerPlan) -> CommsLogger:
    """The plan's ``comms_logger`` (or the config's block: the same fields): records, per-call lines
    (`verbose`), the ops profiled (`prof_all` / `prof_ops`) and callers (`debug`) when `enabled`; the byte
    totals are always kept."""
    on = bool(cl.enabled)
    return CommsLogger(keep_records=on, verbose=on and bool(cl.verbose), debug=on and bool(cl.debug),
                       ops=None if (cl.prof_all or not on) else cl.prof_ops)


def build_engine(
    model: nn.Module,
    config,
    optimizer=None,
    model_parameters: Optional[Iterable] = None,
    training_data=None,
    lr_scheduler=None,
    collate_fn=None,
    dist_init_required: Optional[bool] = None,
    mpu=None,
) -> Engine:
    """Assemble an engine: the plan (:func:`shardspeed.plan.decide`) decides, this function builds its parts."""
    if not isinstance(model, nn.Module):
        raise ConfigError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    refuse_deepspeed_partitioned(model)  # DeepSpeed's own zero.Init placeholders: one line, not a bad forward
    if dist_init_required is not False:
        init_distributed()
    user_topo = _user_topology(mpu)
    plan = decide(config, torch.distributed.get_world_size(), model_facts(model), mesh=_given_mesh(user_topo))
    report = plan.report
    forward_only = _check_optimizer(plan.optimizer, optimizer, lr_scheduler)
    topo = user_topo or Topology.from_mesh(pipe=plan.mesh.pipe, model=plan.mesh.model, dims=plan.mesh.dims,
                                           sequence=plan.mesh.sequence, expert=plan.mesh.expert)
    comms_logger = build_comms_logger(report.comms_logger)
    collectives = Collectives(topo, comms_logger)
    pipe_plan = None
    if isinstance(model, PipelineModule):  # this rank's stages, built before anything reads the parameters
        pipe_plan = plan_pipeline(model, plan.pipeline, topo, comms_logger)
        model_parameters = _current_parameters(model, model_parameters)
    scope = _scope(plan, model, topo, comms_logger)  # what utils.groups and checkpointing see of the engine
    experts = prepare_experts(model, plan, topo, comms_logger)
    groups = _param_groups(model, model_parameters, optimizer)
    model.to(device=topo.device)
    autocast = prepare_precision(model, plan.precision, topo.device)
    tp_state, ties, groups = _model_parallel(plan, model, topo, comms_logger, pipe_plan, groups)
    groups = muon_groups(plan.optimizer.optimizer, model, groups, experts=has_moe_layers(model)[0])
    broadcast_module_state(model, collectives, experts)
    comms_logger.reset()

    params, group_of = _trained(model, groups, forward_only)
    timers = Timers(report.wall_clock_breakdown, topo.device)
    zero = _zero_parts(plan, model, params, ties, collectives, topo, timers, experts)
    master = _master_weights(plan, zero, collectives, group_of,
                             (lambda _groups: None) if forward_only
                             else _optimizer_factory(plan.optimizer, groups, optimizer), forward_only)
    bind_muon(master, collectives, group_of)
    if zero.sharded:
        _link_stage3(zero, master, model)
    parts = EngineParts(
        module=model, topology=topo, collectives=collectives, comms_logger=comms_logger, zero=zero,
        master=master, loss_scaler=_loss_scaler(plan.precision.loss_scale, plan.precision.compute),
        lr_scheduler=_scheduler(plan.optimizer, master.optimizer, lr_scheduler),
        train_batch_size=plan.batch.global_batch, micro_batch_size=plan.batch.micro_batch,
        gradient_accumulation_steps=plan.batch.accumulation_steps, gradient_clipping=plan.optimizer.gradient_clipping,
        zero_stage=plan.sharding.stage, train_dtype=plan.precision.compute, timers=timers,
        steps_per_print=report.steps_per_print, wall_clock_breakdown=report.wall_clock_breakdown,
        memory_breakdown=report.memory_breakdown,
        training_dataloader=_dataloader(plan, training_data, collate_fn, topo, shuffle=pipe_plan is None), plan=plan,
        config_dict=plan.source.given if plan.source is not None else None, tag_validation=plan.save.tag_validation,
        gather_16bit_weights_on_save=plan.sharding.gather_16bit_weights_on_save, async_save=plan.save.async_save,
        flops_profiler=_flops_profiler(report.flops_profiler, model, master.units, topo),
        monitor=_monitor(plan, collectives, comms_logger, topo),
        input_check=tp_state.input_check if tp_state is not None else None,
        profile_window=build_profile_window(report.trial, plan.batch, master.units, topo.device),
        world_collectives=Collectives.over(None, comms_logger) if topo.model_size > 1 else None, scope=scope,
        autocast=autocast,
    )
    engine: Engine
    if pipe_plan is not None:
        tied = TiedGradients(ties, master.units, plan.precision.accumulate) if ties else None
        engine = PipelineEngine(parts, dataclasses.replace(pipe_plan, tied=tied))
    else:
        engine = ForwardEngine(parts) if forward_only else Engine(parts)
        check_attention_on_first_forward(model, topo.sequence_size)  # SP's attention, not the plain one
    CURRENT.register(scope)  # the current engine until destroy()
    if report.config_dump is not None and engine.global_rank == 0:
        logger.info("shardspeed config:\n%s", report.config_dump)
    return engine


def _scope(plan: Plan, model: nn.Module, topo: Topology, log: CommsLogger) -> EngineScope:
    """What DeepSpeed's module-level functions (utils.groups, checkpointing) see of the new engine: its topology,
    its activation checkpointing (configured from the plan), the meshes it shares with the engines alive."""
    return EngineScope(topo, (configure_from_plan(plan.checkpointing, model, topo, log),
                              CURRENT.scope().part(TopologyRegistry)))


def _trained(model: nn.Module, groups, forward_only: bool):
    """The parameters the engine trains, in gradient order, and their groups; none for a forward-only engine
    (no flat units at stages 0-2, no masters; stage 3 still shards)."""
    params, group_of = _trainable_in_grad_order(model, groups)
    if forward_only:
        return [], {}
    if not params:
        raise ConfigError("the model has no trainable parameters (all have requires_grad=False)")
    return params, group_of


def _link_stage3(zero: ZeroRoot, master, model: nn.Module) -> None:
    """GatheredParameters' edits of a shard reach the masters; DeepSpeed's handle on the hooks (TRL's
    ``engine.optimizer.parameter_offload``)."""
    zero.add_shard_listener(master.refresh_from_shard)
    attach_parameter_offload(master.optimizer, zero, model)


def _given_mesh(user_topo: Optional[Topology]) -> Optional[MeshPlan]:
    """The mesh sizes of a user's groups (``mpu=``), which the plan checks the config against."""
    if user_topo is None:
        return None
    return MeshPlan(pipe=user_topo.pipe_size, data=user_topo.batch_world, model=user_topo.model_size,
                    sequence=user_topo.sequence_size)


def _user_topology(mpu) -> Optional[Topology]:
    """The groups of ``initialize(mpu=...)``: a shardspeed ``MeshMPU`` (e.g. the one
    ``register_with_transformers`` returns) brings its Topology as is; any other object is read as a
    Megatron-style mpu."""
    if mpu is None:
        return None
    if isinstance(mpu, MeshMPU):
        return mpu.topology
    return Topology.from_mpu(mpu)


def model_facts(model: nn.Module) -> ModelFacts:
    """What the plan needs to know about ``model``: a PipelineModule's stages, tp_model_init's size, and
    whether zero.Init built it sharded."""
    recorded = getattr(model, TP_ARGS_ATTR, None)
    return ModelFacts(pipeline_stages=model.num_stages if isinstance(model, PipelineModule) else None,
                      tp_size=int(recorded["tp_size"]) if recorded is not None else None,
                      built_sharded=any(init_shard_of(p) is not None for p in model.parameters()),
                      ep_size=largest_ep_size(model) if has_moe_layers(model)[0] else None)


def _check_optimizer(step: OptimizerPlan, optimizer, lr_scheduler) -> bool:
    """At most one optimizer: the config's block or ``optimizer=``. Returns True when there is none (a
    forward-only engine, as DeepSpeed builds for inference), which then takes no LR schedule."""
    if step.optimizer is None and optimizer is None:
        if step.scheduler is not None or lr_scheduler is not None:
            raise ConfigError("an LR schedule without an optimizer: add an 'optimizer' block to the config (e.g. "
                              "{\"type\": \"AdamW\", \"params\": {\"lr\": 1e-3}}) or pass optimizer=, or drop "
                              "the schedule for a forward-only engine")
        return True
    if step.optimizer is not None and optimizer is not None:
        raise ConfigError(
            f"two optimizers: the config's 'optimizer' block ({step.optimizer.type}) and optimizer= "
            f"({type(optimizer).__name__}); keep one"
        )
    return False


def _reduce_policy(plan: Plan) -> ReducePolicy:
    sh, pr = plan.sharding, plan.precision
    zpp = sh.zeropp
    codec = BlockCodec(zpp.gradient_bits, zpp.block) if zpp.gradient_bits else None
    return ReducePolicy(ReduceOp(sh.reduce_op), sh.reduce_every_micro_step, sh.overlap, pr.accumulate, pr.reduce,
                        pr.predivide_factor, grad_codec=codec, summed_ranks=sh.summed_ranks)


def _zero_parts(plan: Plan, model: nn.Module, params: List[nn.Parameter], ties, collectives: Collectives,
                topo: Topology, timers: Timers, experts: Optional[ExpertParts] = None) -> ZeroRoot:
    """The flat units under their root (stage 3: sharded, gathered around use), as the plan says."""
    sh = plan.sharding
    policy = _reduce_policy(plan)

    def epilogue() -> ContextManager:  # the end-of-backward launch-and-wait, timed as backward_allreduce
        return timers("backward_allreduce")

    if sh.partition_parameters:
        node = CURRENT.scope().part(TopologyRegistry).node_group(topo, sh.zeropp.hpz) if sh.zeropp.hpz > 1 else None
        return build_stage3_units(model, sh, collectives, topo.shard_rank, policy,
                                  placement=_shard_placement(plan.placement, topo.shard_rank),
                                  secondary=Collectives.over(node, collectives.log) if node else None,
                                  expert_comm=experts.comm if experts else None,
                                  is_expert=experts.is_expert if experts else lambda p: False,
                                  epilogue_timer=epilogue)
    alone = [p for t in ties for p in t.params]  # tied copies: one unit each, split alike on every stage
    flat = build_flat_units(params, _build_units, sh.reduce_bucket, sh.unit_world,
                            topo.shard_rank if sh.unit_world > 1 else 0, alone, experts or ExpertParts())
    return ZeroRoot(flat, collectives, policy, max_buckets=sh.buckets_alive, epilogue_timer=epilogue)


def _master_weights(plan: Plan, zero: ZeroRoot, collectives: Collectives, group_of: Dict[int, int],
                    make_optimizer, forward_only: bool = False) -> MasterWeights:
    """fp32 masters and the optimizer: on the device, or (offload_optimizer) on the host or in files; none of
    either for a forward-only engine."""
    sh, pl = plan.sharding, plan.placement
    kwargs: Dict[str, Any] = dict(sharded=sh.partition_optimizer, gather_after_step=sh.gather_after_step,
                                  check_overflow=plan.precision.check_overflow)
    if pl.optimizer == "device" or forward_only:
        return MasterWeights(zero.units, zero, collectives, group_of, make_optimizer,
                             master_dtype=plan.precision.master, **kwargs)
    offload = OffloadPlan(device="cpu" if pl.optimizer == "host" else "nvme", nvme_path=pl.optimizer_path,
                          buffer_count=pl.buffer_count, pin_memory=pl.pin_memory, ratio=pl.ratio,
                          tile_elems=pl.tile_elems)
    return OffloadedMasterWeights(zero.units, zero, collectives, group_of, make_optimizer, plan=offload,
                                  master_dtype=plan.precision.master, state_dtype=plan.precision.states, **kwargs)


def _model_parallel(plan: Plan, model: nn.Module, topo: Topology, log: CommsLogger, pipe_plan,
                    groups: List[dict]):
    """Split the layers over the model group (tensor parallelism), then tie the pipeline's shared weights,
    before ZeRO builds units of them. Returns (the TP state or None, the tie groups, the parameter groups
    pointed at the slices that replaced the full parameters)."""
    tp = plan.tensor_parallel
    tp_state = setup_tensor_parallel(model, topo, log, preset_model=tp.preset_model,
                                     partition_config=tp.partition_config, sequence_parallel=tp.sequence_parallel,
                                     train_dtype=plan.precision.compute)
    if tp_state is not None:  # the user's parameter groups name the full parameters: point them at the slices
        groups = [dict(g, params=[tp_state.report.replaced.get(id(p), p) for p in g["params"]]) for g in groups]
    ties = build_tie_groups(model, topo, pipe_plan.schedule, pipe_plan.virtual_stages, log) \
        if isinstance(model, PipelineModule) and pipe_plan is not None else []
    return tp_state, ties, groups


def _flops_profiler(fp: FlopsProfilerPlan, model: nn.Module, units, topo: Topology):
    """``flops_profiler.enabled``: the step profiler, counting parameters at their true sizes (stage 3 holds
    placeholders of the shards between gathers)."""
    if not fp.enabled:
        return None
    from ..profiling.engine_profiler import StepFlopsProfiler

    sizes = {id(p): math.prod(shape) for u in units for p, shape in zip(u.params, u.shapes)}
    return StepFlopsProfiler(model, profile_step=fp.profile_step, module_depth=fp.module_depth,
                             top_modules=fp.top_modules, detailed=fp.detailed, output_file=fp.output_file,
                             recompute_fwd_factor=float(fp.recompute_fwd_factor),
                             param_numel=lambda p: sizes.get(id(p), p.numel()), device=topo.device)


def _current_parameters(model: nn.Module, model_parameters: Optional[Iterable]) -> Optional[Iterable]:
    """A PipelineModule rebuilt for its schedule has new parameters: a plain list of the old ones (taken
    before initialize) is replaced by the module's trainable parameters."""
    if model_parameters is None:
        return None
    items = list(model_parameters)
    live = {id(p) for p in model.parameters()}
    plain = [p for p in items if isinstance(p, torch.Tensor)]
    if plain and len(plain) == len(items) and any(id(p) not in live for p in plain):
        logger.info("model_parameters were taken before the pipeline stages were rebuilt for the schedule: "
                    "training the module's trainable parameters instead")
        return [p for p in model.parameters() if p.requires_grad]
    return items


def _monitor(plan: Plan, collectives: Collectives, comms_logger: CommsLogger, topo: Topology):
    """The monitors of the ``tensorboard``, ``csv_monitor``, ``wandb`` and ``comet`` blocks (None when none is
    enabled). Every rank checks the optional packages (all fail together, at initialize); only global rank 0
    creates directories, writers and runs."""
    from ..monitor.comet import CometMonitor, require_comet
    from ..monitor.csv_monitor import CSVMonitor
    from ..monitor.master import MonitorMaster
    from ..monitor.sink import Sink, require
    from ..monitor.step_events import StepEvents
    from ..monitor.tensorboard import TensorBoardMonitor
    from ..monitor.wandb import WandbMonitor

    monitors = plan.report.monitors
    tb, csv, wb, comet = monitors.tensorboard, monitors.csv, monitors.wandb, monitors.comet
    if not monitors.enabled:
        return None
    if tb is not None:
        require("tensorboard", "tensorboard", "tensorboard")
    if wb is not None:
        require("wandb", "wandb", "wandb")
    if comet is not None:
        require_comet()
    sinks: List[Sink] = []
    if torch.distributed.get_rank() == 0:
        if tb is not None:
            sinks.append(TensorBoardMonitor(tb.output_path, tb.job_name))
        if wb is not None:
            sinks.append(WandbMonitor(wb.project, wb.group, wb.team))
        if csv is not None:
            sinks.append(CSVMonitor(csv.output_path, csv.job_name))
        if comet is not None:
            sinks.append(CometMonitor(comet.samples_log_interval, comet.project, comet.workspace, comet.api_key,
                                      comet.experiment_name, comet.experiment_key, comet.online, comet.mode))
    return StepEvents(MonitorMaster(sinks, enabled=True), collectives=collectives, comms_logger=comms_logger,
                      device=topo.device, world_size=torch.distributed.get_world_size(),
                      write_loss_scale=plan.precision.loss_scale.enabled,
                      write_timers=plan.report.wall_clock_breakdown)


def _shard_placement(placement: PlacementPlan, rank: int) -> Callable[[], ShardPlacement]:
    """Where every stage-3 unit's shard lives between gathers: the device, host memory, or one file per rank
    under the parameters' ``nvme_path``. Returns a factory of one placement per unit."""
    if placement.params == "file":
        assert placement.params_path is not None  # the config requires it for device nvme
        param_file = NvmeParamFile(placement.params_path, rank)
        return lambda: FilePlacement(param_file)
    if placement.params == "host":
        pin = placement.params_pin_memory
        return lambda: HostPlacement(pin)
    return DevicePlacement


def _loss_scaler(ls: LossScalePlan, compute: torch.dtype):
    return build_loss_scaler(compute_dtype=compute,
        fp16_enabled=ls.enabled, loss_scale=ls.static_scale, initial_scale_power=ls.initial_scale_power,
        loss_scale_window=ls.window, hysteresis=ls.hysteresis, consecutive_hysteresis=ls.consecutive_hysteresis,
        min_loss_scale=ls.min_scale,
    )


def _dataloader(plan: Plan, training_data, collate_fn, topo: Topology, shuffle: bool):
    """``training_data``'s loader; a pipeline's is in order, as DeepSpeed's PipelineEngine reads it."""
    if training_data is None:
        return None
    return build_dataloader(training_data, plan.batch.micro_batch, topo, collate_fn=collate_fn,
                            drop_last=plan.batch.drop_last, shuffle=shuffle)
