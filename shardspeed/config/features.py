"""Which config blocks the runtime implements: the registry the config audit checks.

Every block of `ShardspeedConfig` that has an `enabled` key must be listed in `IMPLEMENTED_BLOCKS` (the
builder reads its `enabled`; tests/test_config_audit.py builds an engine with the block enabled and checks
that it does) or be refused at load when enabled (`_UNIMPLEMENTED_BLOCKS` in `models.py`, or a key marked
`not_implemented`). Keys of other blocks that ask for behaviour shardspeed lacks are marked
`not_implemented` (refused when set); keys marked `ignored` are compatibility no-ops that change neither
the results nor what a run writes.
"""
from __future__ import annotations

from types import MappingProxyType
from typing import Mapping

#: block name -> what implements it.
IMPLEMENTED_BLOCKS: Mapping[str, str] = MappingProxyType({
    "fp16": "fp16 training and loss scaling (runtime.builder: train dtype, precision.loss_scaler)",
    "bf16": "bf16 training (runtime.builder: train dtype)",
    "torch_autocast": "the forward under torch.autocast (plan.precision_modes.autocast_plan, runtime.engine.forward; "
                      "runtime.precision_setup tags the parameters that reduce in the autocast dtype)",
    "comms_logger": "the collectives log (dist.comms.CommsLogger, engine.comms_summary)",
    "activation_checkpointing": "shardspeed.checkpointing: the builder configures it from the block and, when "
                                "enabled, checkpoints every transformer block (checkpointing.wrap)",
    "tensorboard": "the TensorBoard monitor (monitor.tensorboard)",
    "csv_monitor": "the CSV monitor (monitor.csv_monitor)",
    "wandb": "the Weights & Biases monitor (monitor.wandb)",
    "comet": "the Comet monitor (monitor.comet)",
    "flops_profiler": "the step flops profiler (profiling.engine_profiler, runtime.builder._flops_profiler)",
    "expert_parallel": "AutoEP: Hugging Face MoE blocks made expert-parallel (runtime.experts.prepare_experts, "
                       "moe.autoep)",
    "autotuning": "a trial's profile window (autotune.probe: measure, write metric_path, exit); "
                  "`shardspeed autotune` (autotune.search)",
})

__all__ = ["IMPLEMENTED_BLOCKS"]
