"""The decisions :func:`~shardspeed.plan.decide` makes of the config's run-wide sections: the optimizer step,
AutoEP, the pipeline schedule and what the engine reports (progress, timers, collectives, monitors, the FLOPs
profiler, an autotuning trial). Each builder part receives one of these, never the config."""
from __future__ import annotations

import json
import os
from typing import Any, Optional

from ..config import ShardspeedConfig
from ..config.loader import read_json
from ..config.secrets import mask_secrets
from ..errors import ConfigError
from .types import (
    V_SCHEDULES,
    CometPlan,
    CommsLoggerPlan,
    ConfigSource,
    ExpertsPlan,
    FlopsProfilerPlan,
    LogDirPlan,
    MonitorPlan,
    OptimizerPlan,
    PipelinePlan,
    ReportPlan,
    TrialPlan,
    TypedBlock,
    WandbPlan,
)


def read_given(config: Any) -> Any:
    """``config`` with a JSON path read (once: what the engine keeps as ``engine.config`` is what was parsed)."""
    return read_json(config) if isinstance(config, (str, os.PathLike)) else config


def config_source(given: Any, parsed: ShardspeedConfig, loaded: ShardspeedConfig) -> ConfigSource:
    """The config as given (the dict itself, a file's contents, or the keys set on a ShardspeedConfig) and as
    loaded: what ``engine.config`` and ``engine.shardspeed_config`` show."""
    as_dict = given if isinstance(given, dict) else parsed.model_dump(mode="json", by_alias=True, exclude_unset=True)
    return ConfigSource(given=as_dict, loaded=loaded)


def _block(section: Any) -> Optional[TypedBlock]:
    return TypedBlock(section.type, dict(section.params or {})) if section is not None else None


def optimizer_plan(cfg: ShardspeedConfig) -> OptimizerPlan:
    """The ``optimizer`` and ``scheduler`` blocks and ``gradient_clipping``."""
    return OptimizerPlan(optimizer=_block(cfg.optimizer), scheduler=_block(cfg.scheduler),
                         gradient_clipping=float(cfg.gradient_clipping))


def experts_plan(cfg: ShardspeedConfig) -> ExpertsPlan:
    """``expert_parallel``'s conversion of a Hugging Face model's MoE blocks (its size is the mesh's)."""
    ep = cfg.expert_parallel
    return ExpertsPlan(convert=bool(ep.enabled), preset_model=ep.preset_model, moe_layer_pattern=ep.moe_layer_pattern,
                       expert_pattern=ep.expert_pattern, use_grouped_mm=bool(ep.use_grouped_mm))


def check_schedule(schedule: str, virtual_stages: int) -> None:
    """A pipeline schedule and the stages each rank runs must fit: one for 1F1B and GPipe, two for the V
    schedules (ZBV, DualPipeV)."""
    if schedule in ("1f1b", "gpipe") and virtual_stages != 1:
        raise ConfigError(f"pipeline.schedule {schedule!r} runs one stage per rank; set pipeline.virtual_stages to 1 "
                          f"or use \"interleaved_1f1b\"")
    if schedule in V_SCHEDULES and virtual_stages != 2:
        raise ConfigError(f"pipeline.schedule {schedule!r} runs exactly 2 stages per rank (a V); set "
                          f"pipeline.virtual_stages to 2 (got {virtual_stages})")


def pipeline_plan(cfg: ShardspeedConfig, stages: int, pipelined: bool) -> PipelinePlan:
    """``pipeline``'s schedule, ``virtual_stages`` resolved for it; checked when the model is a pipeline."""
    schedule, chunks = cfg.pipeline.schedule, cfg.pipeline.chunks_per_rank
    if pipelined:
        check_schedule(schedule, chunks)
    return PipelinePlan(stages=stages, schedule=schedule, virtual_stages=chunks)


def monitor_plan(cfg: ShardspeedConfig) -> MonitorPlan:
    """The ``tensorboard``, ``csv_monitor``, ``wandb`` and ``comet`` blocks that are enabled."""
    tb, csv, wb, co = cfg.tensorboard, cfg.csv_monitor, cfg.wandb, cfg.comet
    return MonitorPlan(
        tensorboard=LogDirPlan(tb.output_path, tb.job_name) if tb.enabled else None,
        csv=LogDirPlan(csv.output_path, csv.job_name) if csv.enabled else None,
        wandb=WandbPlan(wb.project, wb.group, wb.team) if wb.enabled else None,
        comet=CometPlan(co.samples_log_interval, co.project, co.workspace, co.api_key, co.experiment_name,
                        co.experiment_key, co.online, co.mode) if co.enabled else None)


def report_plan(cfg: ShardspeedConfig) -> ReportPlan:
    """What the engine reports, from the top-level keys and the ``comms_logger``, monitor, ``flops_profiler``
    and ``autotuning`` blocks."""
    cl, fp, at = cfg.comms_logger, cfg.flops_profiler, cfg.autotuning
    dump = json.dumps(mask_secrets(cfg.model_dump(mode="json")), indent=2) if cfg.dump_state else None
    return ReportPlan(
        steps_per_print=cfg.steps_per_print, wall_clock_breakdown=bool(cfg.wall_clock_breakdown),
        memory_breakdown=bool(cfg.memory_breakdown), config_dump=dump,
        comms_logger=CommsLoggerPlan(enabled=bool(cl.enabled), verbose=bool(cl.verbose), prof_all=bool(cl.prof_all),
                                     debug=bool(cl.debug), prof_ops=tuple(cl.prof_ops)),
        monitors=monitor_plan(cfg),
        flops_profiler=FlopsProfilerPlan(enabled=bool(fp.enabled), profile_step=fp.profile_step,
                                         module_depth=fp.module_depth, top_modules=fp.top_modules,
                                         detailed=bool(fp.detailed), output_file=fp.output_file,
                                         recompute_fwd_factor=float(fp.recompute_fwd_factor)),
        trial=TrialPlan(at.start_profile_step, at.end_profile_step, at.metric_path) if at.enabled else None,
    )


def with_micro_batch(config: Any, micro_batch: int) -> Any:
    """``config`` (None: DeepSpeed's defaults) with ``train_micro_batch_size_per_gpu`` = ``micro_batch`` when it
    gives no batch size at all: the estimator prices one micro-batch (the engine refuses such a config)."""
    if config is None:
        return {"train_micro_batch_size_per_gpu": micro_batch}
    config = read_given(config)
    if isinstance(config, dict) and all(config.get(k) is None for k in ("train_batch_size",
                                                                       "train_micro_batch_size_per_gpu")):
        return {**config, "train_micro_batch_size_per_gpu": micro_batch}
    return config

