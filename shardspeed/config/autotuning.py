"""`autotuning`: DeepSpeed's autotuner block, plus shardspeed's budget keys.

Two readers: `shardspeed autotune` (the search: :mod:`shardspeed.autotune`) and the engine of a trial,
which measures the steps from `start_profile_step` to `end_profile_step`, writes `metric_path` and exits
(:mod:`shardspeed.autotune.probe`), as DeepSpeed's engine does when `enabled` is true.
"""
from __future__ import annotations

from typing import Any, Dict, Literal, Optional

from pydantic import model_validator
from pydantic_core import PydanticCustomError

from .base import ConfigModel, field


class AutotuningConfig(ConfigModel):
    """`autotuning`: what `shardspeed autotune` searches and how a trial reports. With `enabled` true, an
    engine measures steps `start_profile_step`..`end_profile_step`, writes the metrics to `metric_path`
    and exits the process (DeepSpeed's behaviour): the tuner sets it in each trial's config."""

    enabled: bool = field(False, "Profile steps start..end, write metric_path and exit (set by the tuner in "
                          "each trial's config; `shardspeed autotune` runs whether or not it is set).")
    fast: bool = field(True, "Skip the bucket-size dimension (true), or search it too (false).")
    metric: Literal["throughput", "latency", "flops"] = field(
        "throughput", "What the search optimises: samples/s (throughput, flops) or step time (latency).")
    start_profile_step: int = field(3, "First optimizer step measured (earlier steps are warm-up).", ge=1)
    end_profile_step: int = field(5, "Last optimizer step measured; the trial exits after it.", ge=1)
    metric_path: Optional[str] = field(None, "Where a trial writes its metrics (JSON); None: "
                                       "./autotuning_metric.json.")
    model_info_path: Optional[str] = field(None, "DeepSpeed: where its profile run writes model info. The "
                                           "metrics file carries num_params here.", ignored=True)
    model_info: Optional[Dict[str, Any]] = field(None, "DeepSpeed: model facts for its tuner (num_params, "
                                                 "hidden_size, num_layers, profile).", ignored=True)
    mp_size: int = field(1, "Model-parallel size (only 1: tensor/pipeline degrees are not searched yet).",
                         unsupported=True)
    max_train_batch_size: Optional[int] = field(None, "Largest global batch considered; None: the user's "
                                                "global batch is kept.", gt=0)
    min_train_batch_size: int = field(1, "Smallest global batch considered.", gt=0)
    min_train_micro_batch_size_per_gpu: int = field(1, "Smallest micro-batch searched.", gt=0)
    max_train_micro_batch_size_per_gpu: int = field(1024, "Largest micro-batch searched.", gt=0)
    num_tuning_micro_batch_sizes: int = field(3, "DeepSpeed: micro-batch sizes tried around its estimate. "
                                              "Here every power-of-two divisor in range is predicted.",
                                              gt=0, ignored=True)
    tuner_type: Literal["gridsearch", "random", "model_based"] = field(
        "model_based", "model_based: run the best predictions first and stop when none can win; gridsearch "
        "and random: run candidates (that fit) in grid or random order, up to tuner_num_trials.")
    tuner_early_stopping: int = field(5, "Stop after this many trials in a row without a new best.", gt=0)
    tuner_num_trials: int = field(50, "Most trials run (calibration runs included).", gt=0)
    arg_mappings: Optional[Dict[str, str]] = field(
        None, "Config key → script flag (e.g. {\"train_micro_batch_size_per_gpu\": \"--per_device_train_batch"
        "_size\"}): the trial's value is also passed as that flag.")
    results_dir: str = field("autotuning_results", "Where results go: <exp>/, summary.txt, "
                             "ds_config_optimal.json, cmd_optimal.txt.", min_length=1)
    exps_dir: str = field("autotuning_exps", "Where each candidate's experiment description is written.",
                          min_length=1)
    overwrite: bool = field(True, "Rerun an experiment whose results exist (false: reuse them).")
    # shardspeed's extension: the budget.
    device_memory_budget: Optional[float] = field(
        None, "shardspeed: bytes of device memory per rank a config may use (peak; on CPU, the process's "
        "peak RSS). None: the device's total (on CPU: host memory / ranks).", gt=0)
    host_memory_budget: Optional[float] = field(
        None, "shardspeed: bytes of host memory per rank for offloaded states. None: host memory / ranks.", gt=0)
    wall_time_budget: Optional[float] = field(
        None, "shardspeed: seconds the whole search may take (calibration included); None: no limit.", gt=0)
    trial_timeout: float = field(300.0, "shardspeed: seconds one trial may run before its processes are "
                                 "killed (recorded as a timeout).", gt=0)

    @model_validator(mode="after")
    def _check_range(self) -> AutotuningConfig:
        if self.end_profile_step < self.start_profile_step:
            raise PydanticCustomError("profile_steps", "'{key}' = {end} is before start_profile_step = {start}",
                                      {"key": "end_profile_step", "end": self.end_profile_step,
                                       "start": self.start_profile_step})
        if self.max_train_micro_batch_size_per_gpu < self.min_train_micro_batch_size_per_gpu:
            raise PydanticCustomError("mbs", "'{key}' is below min_train_micro_batch_size_per_gpu",
                                      {"key": "max_train_micro_batch_size_per_gpu"})
        return self
