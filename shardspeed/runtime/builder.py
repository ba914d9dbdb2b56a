"""The one place that reads the config and decides which runtime parts to assemble."""
from __future__ import annotations

import dataclasses
import logging
import math
from typing import Any, Callable, Dict, Iterable, List, Optional, Sequence, Tuple

import torch
import torch.nn as nn

from ..autotune.probe import build_profile_window
from ..config import ShardspeedConfig, load_config, parse_config
from ..dist.comms import Collectives, CommsLogger
from ..dist.init import init_distributed
from ..dist.topology import Topology, mesh_sizes
from ..errors import ConfigError
from ..offload import OffloadedMasterWeights, plan_from_config
from ..offload.param_file import FilePlacement, NvmeParamFile
from ..optim import build_optimizer, build_scheduler, rebuild_optimizer
from ..parallel.tp.setup import setup_tensor_parallel, tp_size_for
from ..pipe.engine import PipelineEngine
from ..pipe.module import PipelineModule
from ..pipe.plan import pipeline_stages, plan_pipeline, require_pipeline_module
from ..pipe.ties import TiedGradients, build_tie_groups
from ..precision import build_loss_scaler
from ..utils import groups as ds_groups
from ..zero.layout import group_by_size
from ..zero.master import MasterWeights
from ..zero.placement import DevicePlacement, HostPlacement, ShardPlacement
from ..zero.reducer import GradientReducer, ReducePolicy
from ..zero.stage3 import build_stage3_units
from ..zero.unit import FlatParamUnit
from .dataloader import build_dataloader
from .engine import Engine, EngineParts

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
    # keep dtypes apart: one flat buffer has one dtype
    by_dtype: Dict[torch.dtype, List[nn.Parameter]] = {}
    for p in params:
        if id(p) not in single:
            by_dtype.setdefault(p.dtype, []).append(p)
    for plist in by_dtype.values():
        for idx in group_by_size([p.numel() for p in plist], bucket_elems):
            units.append(FlatParamUnit([plist[i] for i in idx], world=world, rank=rank, index=len(units)))
    return units


def _optimizer_factory(cfg: ShardspeedConfig, groups: List[dict], client_optimizer) -> Callable[[List[dict]], Any]:
    hyper = [{k: v for k, v in g.items() if k != "params"} for g in groups]

    def make(piece_groups: List[dict]):
        full = [dict(hyper[g.pop("_group")], **g) for g in (dict(x) for x in piece_groups)]
        if cfg.optimizer is not None:
            return build_optimizer(cfg.optimizer, full)
        if callable(client_optimizer) and not isinstance(client_optimizer, torch.optim.Optimizer):
            return client_optimizer(full)
        return rebuild_optimizer(client_optimizer, full)

    return make


def _scheduler(cfg: ShardspeedConfig, optimizer, client_scheduler):
    if cfg.scheduler is not None:
        return build_scheduler(cfg.scheduler, optimizer)
    if client_scheduler is None:
        return None
    if callable(client_scheduler) and not hasattr(client_scheduler, "step"):
        return client_scheduler(optimizer)
    client_scheduler.optimizer = optimizer  # a scheduler built on the user's optimizer: point it at ours
    return client_scheduler


def build_comms_logger(cl) -> CommsLogger:
    """The `comms_logger` block: records, per-call lines (`verbose`), the ops profiled (`prof_all` /
    `prof_ops`) and callers (`debug`) when `enabled`; the byte totals are always kept."""
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
    if not isinstance(model, nn.Module):
        raise ConfigError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if dist_init_required is not False:
        init_distributed()
    cfg = parse_config(config)  # the mesh sizes are in the config; the batch sizes need the mesh's data size
    topo = _topology(cfg, mpu, model, tp_size_for(model, int(cfg.tensor_parallel.autotp_size)))
    cfg = load_config(cfg, world_size=topo.dp_size)
    zero = cfg.zero_optimization
    stage = zero.stage
    train_dtype = cfg.train_dtype

    comms_logger = build_comms_logger(cfg.comms_logger)
    collectives = Collectives(topo, comms_logger)

    if cfg.optimizer is None and optimizer is None:
        raise ConfigError(
            "no optimizer: add an 'optimizer' block to the config (e.g. {\"type\": \"AdamW\", \"params\": "
            "{\"lr\": 1e-3}}) or pass optimizer= to shardspeed.initialize"
        )
    if cfg.optimizer is not None and optimizer is not None:
        raise ConfigError(
            f"two optimizers: the config's 'optimizer' block ({cfg.optimizer.type}) and optimizer= "
            f"({type(optimizer).__name__}); keep one"
        )
    if stage != 3 and any(getattr(p, "_shardspeed_init", None) is not None for p in model.parameters()):
        raise ConfigError(
            f"the model was built under shardspeed.zero.Init (parameters sharded at construction), which needs "
            f"zero_optimization.stage 3; the config says stage {stage}"
        )
    pipe_plan = None
    if isinstance(model, PipelineModule):  # this rank's stages, built before anything reads the parameters
        pipe_plan = plan_pipeline(model, cfg.pipeline, topo, comms_logger)
        model_parameters = _current_parameters(model, model_parameters)
    _activation_checkpointing(cfg, model, topo, comms_logger)
    groups = _param_groups(model, model_parameters, optimizer)
    model.to(device=topo.device)
    if train_dtype != torch.float32:
        model.to(dtype=train_dtype)
    tp_state, ties, groups = _model_parallel(cfg, model, topo, comms_logger, pipe_plan, groups)
    _broadcast_module_state(model, collectives)
    comms_logger.reset()

    params, group_of = _trainable_in_grad_order(model, groups)
    if not params:
        raise ConfigError("the model has no trainable parameters (all have requires_grad=False)")
    accum_dtype = _accum_dtype(cfg)
    policy = ReducePolicy.for_stage(
        stage, overlap=bool(zero.overlap_comm), reduce_scatter=bool(zero.reduce_scatter), accum_dtype=accum_dtype, comm_dtype=cfg.comm_dtype,
        predivide_factor=float(cfg.gradient_predivide_factor) if cfg.prescale_gradients else 1.0,
    )
    if pipe_plan is not None:  # a schedule's micro-batches accumulate locally; one reduction at the boundary
        policy = dataclasses.replace(policy, every_micro_step=False)
    manager = None
    if stage == 3:
        units, manager = build_stage3_units(model, zero, collectives, topo.dp_rank,
                                            placement=_shard_placement(zero.offload_param, topo.dp_rank))
        reducer = GradientReducer(units, collectives, policy, max_in_flight=1,
                                  on_unit_ready=manager.on_unit_grads_ready,
                                  first_order=manager.backward_order_guess)
    else:
        world = 1 if stage == 0 else topo.dp_size
        alone = [p for t in ties for p in t.params]  # tied copies: one unit each, split alike on every stage
        units = _build_units(params, int(zero.reduce_bucket_size), world, topo.dp_rank if world > 1 else 0, alone)
        reducer = GradientReducer(units, collectives, policy, max_in_flight=2 if stage == 2 else None)
    master_kwargs: Dict[str, Any] = dict(sharded=stage >= 1, gather_after_step=stage in (1, 2), check_overflow=_check_overflow(cfg))
    offload = plan_from_config(zero.offload_optimizer, int(zero.sub_group_size))
    master: MasterWeights
    if offload is not None:  # masters and optimizer state on the host or on disk (shardspeed.offload)
        master = OffloadedMasterWeights(units, reducer, collectives, group_of,
                                        _optimizer_factory(cfg, groups, optimizer), plan=offload, **master_kwargs)
    else:
        master = MasterWeights(units, reducer, collectives, group_of, _optimizer_factory(cfg, groups, optimizer),
                               **master_kwargs)
    if manager is not None:
        manager.master = master
    # load_config resolved the batch trio
    assert cfg.train_batch_size is not None and cfg.train_micro_batch_size_per_gpu is not None
    assert cfg.gradient_accumulation_steps is not None
    parts = EngineParts(
        module=model, topology=topo, collectives=collectives, comms_logger=comms_logger, reducer=reducer,
        master=master, loss_scaler=_loss_scaler(cfg), lr_scheduler=_scheduler(cfg, master.optimizer, lr_scheduler),
        train_batch_size=cfg.train_batch_size, micro_batch_size=cfg.train_micro_batch_size_per_gpu,
        gradient_accumulation_steps=cfg.gradient_accumulation_steps, gradient_clipping=float(cfg.gradient_clipping),
        zero_stage=stage, train_dtype=train_dtype, steps_per_print=cfg.steps_per_print,
        wall_clock_breakdown=cfg.wall_clock_breakdown, param_manager=manager,
        training_dataloader=_dataloader(cfg, training_data, collate_fn, topo), config=cfg,
        gather_16bit_weights_on_save=bool(zero.gather_16bit_weights_on_model_save),
        flops_profiler=_flops_profiler(cfg, model, master.units, topo),
        monitor=_monitor(cfg, collectives, comms_logger, topo),
        input_check=tp_state.input_check if tp_state is not None else None,
        profile_window=build_profile_window(cfg, master.units, topo.device),
    )
    if cfg.memory_breakdown:
        parts.extras["memory_breakdown"] = True  # logged with each steps_per_print line
    engine: Engine
    if pipe_plan is not None:
        pipe_plan.tied = TiedGradients(ties, master.units, accum_dtype) if ties else None
        engine = PipelineEngine(parts, pipe_plan)
    else:
        engine = Engine(parts)
    ds_groups.set_topology(topo)
    if cfg.dump_state and engine.global_rank == 0:
        logger.info("shardspeed config:\n%s", cfg.model_dump_json(indent=2))
    return engine


def _model_parallel(cfg: ShardspeedConfig, model: nn.Module, topo: Topology, log: CommsLogger, pipe_plan,
                    groups: List[dict]):
    """Split the layers over the model group (tensor parallelism), then tie the pipeline's shared weights,
    before ZeRO builds units of them. Returns (the TP state or None, the tie groups, the parameter groups
    pointed at the slices that replaced the full parameters)."""
    tp = cfg.tensor_parallel
    if pipe_plan is not None and tp.sequence_parallel and topo.model_size > 1:
        raise ConfigError("tensor_parallel.sequence_parallel with a PipelineModule: stages exchange whole-sequence "
                          "activations (the pipeline's layers are not sequence-split); set sequence_parallel to "
                          "false")
    tp_state = setup_tensor_parallel(model, topo, log, preset_model=tp.preset_model,
                                     partition_config=tp.partition_config, sequence_parallel=tp.sequence_parallel,
                                     train_dtype=cfg.train_dtype)
    if tp_state is not None:  # the user's parameter groups name the full parameters: point them at the slices
        groups = [dict(g, params=[tp_state.report.replaced.get(id(p), p) for p in g["params"]]) for g in groups]
    ties = build_tie_groups(model, topo, pipe_plan.schedule, pipe_plan.virtual_stages, log) \
        if isinstance(model, PipelineModule) and pipe_plan is not None else []
    return tp_state, ties, groups


def _activation_checkpointing(cfg: ShardspeedConfig, model: nn.Module, topo: Topology, log: CommsLogger) -> None:
    """``activation_checkpointing``: configure shardspeed.checkpointing from the block (its keys, the mesh's
    tensor-parallel group) when the config has the block or nothing configured it yet, so a configure() the
    user called before initialize survives a config without the block; ``enabled`` also checkpoints every
    transformer block of the model."""
    from ..checkpointing import CheckpointSettings, apply, checkpoint_blocks, is_configured, model_group_comm

    block = cfg.activation_checkpointing
    if "activation_checkpointing" in cfg.model_fields_set or not is_configured():
        apply(CheckpointSettings.from_config(block), model_group_comm(topo, log))
    if block.enabled:
        checkpoint_blocks(model, policy=block.policy)


def _flops_profiler(cfg: ShardspeedConfig, model: nn.Module, units, topo: Topology):
    """``flops_profiler.enabled``: the step profiler, counting parameters at their true sizes (stage 3 holds
    placeholders of the shards between gathers)."""
    fp = cfg.flops_profiler
    if not fp.enabled:
        return None
    from ..profiling.engine_profiler import StepFlopsProfiler

    sizes = {id(p): math.prod(shape) for u in units for p, shape in zip(u.params, u.shapes)}
    return StepFlopsProfiler(model, profile_step=fp.profile_step, module_depth=fp.module_depth,
                             top_modules=fp.top_modules, detailed=fp.detailed, output_file=fp.output_file,
                             recompute_fwd_factor=float(fp.recompute_fwd_factor),
                             param_numel=lambda p: sizes.get(id(p), p.numel()), device=topo.device)


def _topology(cfg: ShardspeedConfig, mpu, model: nn.Module, tp: int) -> Topology:
    """The mesh (pipe × data × model) from the config's sizes (a PipelineModule's num_stages for the pipe
    dimension; ``tp``: the model dimension), or the groups of a user's mpu."""
    stages = pipeline_stages(cfg.pipeline, model)
    if mpu is not None:
        topo = Topology.from_mpu(mpu)
        for key, want, got in (("pipeline.stages", stages, topo.pipe_size),
                               ("tensor_parallel.autotp_size", tp, topo.model_size)):
            if want > 1 and want != got:
                raise ConfigError(f"{key} {want} disagrees with mpu=, whose groups have size {got}; remove {key} "
                                  f"(the mpu decides the groups) or make them agree")
        return topo
    mesh_sizes(torch.distributed.get_world_size(), stages, tp)  # one-line error when the sizes do not divide
    require_pipeline_module(stages, model)
    return Topology.from_mesh(pipe=stages, model=tp)


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


def _monitor(cfg: ShardspeedConfig, collectives: Collectives, comms_logger: CommsLogger, topo: Topology):
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

    tb, csv_cfg, wb, comet = cfg.tensorboard, cfg.csv_monitor, cfg.wandb, cfg.comet
    if not (tb.enabled or csv_cfg.enabled or wb.enabled or comet.enabled):
        return None
    if tb.enabled:
        require("tensorboard", "tensorboard", "tensorboard")
    if wb.enabled:
        require("wandb", "wandb", "wandb")
    if comet.enabled:
        require_comet()
    sinks: List[Sink] = []
    if torch.distributed.get_rank() == 0:
        if tb.enabled:
            sinks.append(TensorBoardMonitor(tb.output_path, tb.job_name))
        if wb.enabled:
            sinks.append(WandbMonitor(wb.project, wb.group, wb.team))
        if csv_cfg.enabled:
            sinks.append(CSVMonitor(csv_cfg.output_path, csv_cfg.job_name))
        if comet.enabled:
            sinks.append(CometMonitor(comet.samples_log_interval, comet.project, comet.workspace, comet.api_key,
                                      comet.experiment_name, comet.experiment_key, comet.online, comet.mode))
    return StepEvents(MonitorMaster(sinks, enabled=True), collectives=collectives, comms_logger=comms_logger,
                      device=topo.device, world_size=torch.distributed.get_world_size(),
                      write_loss_scale=bool(cfg.fp16.enabled), write_timers=bool(cfg.wall_clock_breakdown))


def _shard_placement(offload, rank: int) -> Callable[[], ShardPlacement]:
    """Where every stage-3 unit's shard lives between gathers (offload_param): the device, host memory
    (cpu), or one file per rank under ``nvme_path`` (nvme). Returns a factory of one placement per unit."""
    device = offload.device if offload is not None else "none"
    if device == "nvme":
        param_file = NvmeParamFile(offload.nvme_path, rank)
        return lambda: FilePlacement(param_file)
    if device == "cpu":
        pin = bool(offload.pin_memory)
        return lambda: HostPlacement(pin)
    return DevicePlacement


def _check_overflow(cfg: ShardspeedConfig) -> bool:
    """Skip a step whose global gradient norm is inf/nan: always with fp16 (loss scaling needs it), and in
    every other dtype unless ``bf16.check_grad_overflow`` is false (DeepSpeed skips such steps at ZeRO
    stages 1-3 in fp32 and bf16 too)."""
    return bool(cfg.fp16.enabled) or bool(cfg.bf16.check_grad_overflow)


def _accum_dtype(cfg: ShardspeedConfig) -> torch.dtype:
    name = cfg.data_types.grad_accum_dtype if cfg.data_types is not None else None
    if name is None:
        return cfg.train_dtype
    return {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}[name]


def _loss_scaler(cfg: ShardspeedConfig):
    f = cfg.fp16
    return build_loss_scaler(
        fp16_enabled=f.enabled, loss_scale=f.loss_scale, initial_scale_power=f.initial_scale_power,
        loss_scale_window=f.loss_scale_window, hysteresis=f.hysteresis,
        consecutive_hysteresis=f.consecutive_hysteresis, min_loss_scale=f.min_loss_scale,
    )


def _dataloader(cfg, training_data, collate_fn, topo: Topology):
    if training_data is None:
        return None
    return build_dataloader(training_data, cfg.train_micro_batch_size_per_gpu, topo, collate_fn=collate_fn,
                            drop_last=bool(getattr(cfg, "dataloader_drop_last", False)))


@torch.no_grad()
def _broadcast_module_state(model: nn.Module, collectives: Collectives) -> None:
    """Every rank starts from rank 0's parameters and buffers (as DeepSpeed does)."""
    if collectives.world == 1:
        return
    seen = set()
    for t in list(model.parameters()) + list(model.buffers()):
        if id(t) in seen or t.numel() == 0:
            continue
        seen.add(id(t))
        collectives.broadcast(t.data, 0)
