"""Pydantic models of the DeepSpeed JSON config, batch arithmetic, and `load_config`.

`load_config(config, world_size)` is the entry point; see docs/config.md for every key.
"""
from .autotuning import AutotuningConfig
from .base import ConfigModel
from .batch import resolve_batch_sizes
from .blocks import (
                     ActivationCheckpointingConfig,
                     AioConfig,
                     CheckpointConfig,
                     CometConfig,
                     CommsLoggerConfig,
                     CSVMonitorConfig,
                     FlopsProfilerConfig,
                     OptimizerConfig,
                     ParallelWriteConfig,
                     PipelineConfig,
                     SchedulerConfig,
                     TensorBoardConfig,
                     TensorParallelConfig,
                     WandbConfig,
)
from .features import IMPLEMENTED_BLOCKS
from .loader import load_config, parse_config
from .models import ShardspeedConfig
from .precision import BF16Config, DataTypesConfig, FP16Config
from .zero import OffloadOptimizerConfig, OffloadParamConfig, ZeroConfig

__all__ = [
    "load_config", "parse_config", "resolve_batch_sizes", "ShardspeedConfig", "ConfigModel",
    "FP16Config", "BF16Config", "DataTypesConfig",
    "ZeroConfig", "OffloadOptimizerConfig", "OffloadParamConfig",
    "OptimizerConfig", "SchedulerConfig", "CheckpointConfig", "ParallelWriteConfig",
    "CommsLoggerConfig", "TensorBoardConfig", "CSVMonitorConfig", "WandbConfig", "CometConfig",
    "FlopsProfilerConfig", "ActivationCheckpointingConfig", "AioConfig", "PipelineConfig", "TensorParallelConfig",
    "IMPLEMENTED_BLOCKS", "AutotuningConfig",
]
