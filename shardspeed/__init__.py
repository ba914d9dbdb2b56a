"""shardspeed: ZeRO-sharded training for PyTorch, a drop-in for DeepSpeed configs.

    engine, optimizer, loader, scheduler = shardspeed.initialize(model=model, config="ds_config.json")
"""
from __future__ import annotations

from types import MappingProxyType
from typing import Any, Iterable, Optional, Tuple

from . import checkpointing, comm, zero
from .comm import init_distributed  # DeepSpeed's signature (dist_backend=, timedelta timeout; backend= too)
from .compat.alias import module_getattr
from .errors import CheckpointError, ConfigError, DistributedError, LossScaleError, ShardspeedError
from .mesh.init import shutdown_distributed
from .parallel.tp.setup import tp_model_init

__version__ = "0.1.0"


def initialize(
    args: Any = None,
    model=None,
    optimizer=None,
    model_parameters: Optional[Iterable] = None,
    training_data=None,
    lr_scheduler=None,
    mpu=None,
    dist_init_required: Optional[bool] = None,
    collate_fn=None,
    config=None,
    config_params=None,
) -> Tuple[Any, Any, Any, Any]:
    """Build a training engine for ``model`` from a DeepSpeed-format ``config`` (dict or JSON path).

    Returns ``(engine, optimizer, training_dataloader, lr_scheduler)`` like ``deepspeed.initialize``;
    the data loader is None unless ``training_data`` is given. ``optimizer`` may be a torch optimizer
    (moved onto the fp32 master weights, in place: the returned optimizer is that object, whose
    ``param_groups`` are the live ones) or a callable taking parameter groups. ``mpu`` is a
    Megatron-style model-parallel unit: ZeRO then shards over ``mpu.get_data_parallel_group()`` (as in
    DeepSpeed) instead of the data dimension of the mesh built from the config.
    """
    from .errors import RequiredArgumentError
    from .monitor.log import setup_logging
    from .runtime.builder import build_engine

    setup_logging()
    if model is None:
        raise RequiredArgumentError("initialize() needs model=")
    if config is None:
        config = config_params
    if config is None and args is not None:
        config = getattr(args, "deepspeed_config", None) or getattr(args, "deepscale_config", None) \
            or getattr(args, "config", None)
    engine = build_engine(model, config, optimizer=optimizer, model_parameters=model_parameters,
                          training_data=training_data, lr_scheduler=lr_scheduler, collate_fn=collate_fn,
                          dist_init_required=dist_init_required, mpu=mpu)
    return engine, engine.optimizer, engine.training_dataloader, engine.lr_scheduler


__all__ = [
    "initialize", "init_distributed", "shutdown_distributed", "ShardspeedError", "ConfigError", "DistributedError",
    "CheckpointError", "LossScaleError", "__version__", "checkpointing", "comm", "zero", "tp_model_init",
]

from .runtime.arguments import add_config_arguments  # noqa: E402  (DeepSpeed's top-level name)

__all__ += ["add_config_arguments"]

# a DeepSpeed name shardspeed does not mirror fails here with one line (``import shardspeed as deepspeed``);
# DeepSpeed's other top-level names (DeepSpeedEngine is the engine class) are imported when first asked for
_LAZY = MappingProxyType({"DeepSpeedEngine": ("shardspeed.runtime.engine", "Engine"),
         "get_accelerator": ("shardspeed.accelerator", "get_accelerator"),
         "PipelineModule": ("shardspeed.pipe", "PipelineModule"),
         "DeepSpeedConfig": ("shardspeed.runtime.config", "DeepSpeedConfig")})
_missing = module_getattr(__name__)


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        module, attr = _LAZY[name]
        return getattr(importlib.import_module(module), attr)
    return _missing(name)
