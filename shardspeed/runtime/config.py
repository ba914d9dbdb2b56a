"""``deepspeed.runtime.config.DeepSpeedConfig``: a config (dict or JSON path) parsed and validated by
shardspeed's loader, with the batch sizes resolved for the data-parallel size, under DeepSpeed's attribute
names (``train_batch_size``, ``zero_optimization_stage``, ``zero_config``, ``float16_config``...).

The data-parallel size is DeepSpeed's: ``mpu.get_data_parallel_world_size()`` when an ``mpu`` is given, else
the process group's size divided by ``sequence_parallel_size``, else 1 when no process group is running.
"""
from __future__ import annotations

import copy
import os
from typing import Any, Dict, Optional, Union

import torch.distributed as dist

from ..compat.alias import module_getattr, not_provided
from ..config.loader import load_config, parse_config, read_json

# DeepSpeed's names of the config's optimizer types (``"optimizer": {"type": ...}``, matched case-insensitively)
ADAGRAD_OPTIMIZER = "adagrad"
ADAM_OPTIMIZER = "adam"
ADAMW_OPTIMIZER = "adamw"
LAMB_OPTIMIZER = "lamb"
LION_OPTIMIZER = "lion"


def _world_and_rank(raw: Dict[str, Any], mpu: Any) -> tuple:
    if not dist.is_available() or not dist.is_initialized():
        return 1, 0
    if mpu is not None and hasattr(mpu, "get_data_parallel_world_size"):
        return int(mpu.get_data_parallel_world_size()), dist.get_rank()
    return dist.get_world_size() // int(raw.get("sequence_parallel_size", 1) or 1), dist.get_rank()


class DeepSpeedConfig:
    """``DeepSpeedConfig(config, mpu=None)``: ``config`` a dict (not modified) or a path to a JSON file."""

    def __init__(self, config: Union[str, os.PathLike, Dict[str, Any]], mpu: Any = None, mesh_device: Any = None):
        if mesh_device is not None:
            raise not_provided("deepspeed.runtime.config.DeepSpeedConfig(mesh_device=...)")
        raw = copy.deepcopy(config) if isinstance(config, dict) else read_json(config)
        self._param_dict: Dict[str, Any] = raw
        self.world_size, self.global_rank = _world_and_rank(raw, mpu)
        self._model = load_config(parse_config(raw), world_size=self.world_size)
        m = self._model
        self.train_batch_size = m.train_batch_size
        self.train_micro_batch_size_per_gpu = m.train_micro_batch_size_per_gpu
        self.gradient_accumulation_steps = m.gradient_accumulation_steps
        self.zero_config = m.zero_optimization
        self.zero_optimization_stage = int(m.zero_optimization.stage)
        self.zero_enabled = self.zero_optimization_stage > 0
        self.float16_config = m.fp16
        self.bfloat16_config = m.bf16
        self.gradient_clipping = m.gradient_clipping
        self.gradient_allreduce_op = m.gradient_allreduce_op
        self.steps_per_print = m.steps_per_print
        self.wall_clock_breakdown = m.wall_clock_breakdown
        self.prescale_gradients = m.prescale_gradients
        self.gradient_predivide_factor = m.gradient_predivide_factor
        self.dataloader_drop_last = m.dataloader_drop_last
        self.zero_allow_untested_optimizer = m.zero_allow_untested_optimizer
        self.memory_breakdown = m.memory_breakdown
        self.dump_state = m.dump_state
        self.activation_checkpointing_config = m.activation_checkpointing
        self.optimizer_name, self.optimizer_params = self._named_block(m.optimizer, lower=True)
        self.scheduler_name, self.scheduler_params = self._named_block(m.scheduler, lower=False)

    @staticmethod
    def _named_block(block: Any, lower: bool) -> tuple:
        if block is None:
            return None, None
        return (block.type.lower() if lower else block.type), dict(block.params)

    @property
    def fp16_enabled(self) -> bool:
        return bool(self.float16_config.enabled)

    @property
    def bfloat16_enabled(self) -> bool:
        return bool(self.bfloat16_config.enabled)

    @property
    def loss_scale(self) -> float:
        return float(self.float16_config.loss_scale)

    @property
    def gradient_accumulation_dtype(self) -> Optional[str]:
        return self._model.data_types.grad_accum_dtype

    @property
    def shardspeed_config(self) -> Any:
        """The validated shardspeed config model (what ``shardspeed.initialize`` takes as well)."""
        return self._model

    def print_user_config(self) -> None:
        import json
        import logging

        logging.getLogger("shardspeed").info("  json = %s", json.dumps(self._param_dict, sort_keys=True, indent=4))


__getattr__ = module_getattr(__name__)
