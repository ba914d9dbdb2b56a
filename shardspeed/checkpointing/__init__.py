"""Activation checkpointing: DeepSpeed's ``deepspeed.checkpointing`` API on torch's non-reentrant checkpoint.

    import shardspeed.checkpointing as checkpointing
    checkpointing.configure(engine.mpu, deepspeed_config=cfg)   # or let the engine do it from its config
    x = checkpointing.checkpoint(block, x)                      # in the model's forward
    engine.enable_activation_checkpointing(policy="selective")  # or wrap every transformer block

The engine configures it from its plan with :func:`configure_from_plan`. See docs/activation-checkpointing.md.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Optional

from .core import (
    ActivationCheckpointing,
    apply,
    checkpoint,
    checkpoint_function,
    checkpoint_with,
    configure,
    current,
    get_cuda_rng_tracker,
    is_configured,
    model_group_comm,
    model_parallel_cuda_manual_seed,
    model_parallel_reconfigure_tp_seed,
    non_reentrant_checkpoint,
    partition_activations_in_checkpoint,
    profile_totals,
    reset,
    set_num_layers,
    settings,
)
from .policy import SAVED_OPS, selective_policy
from .rng import CudaRNGStatesTracker, RNGStatesTracker
from .saved import partition_span
from .settings import CheckpointSettings
from .wrap import checkpoint_blocks, find_blocks, uncheckpoint_blocks

if TYPE_CHECKING:
    import torch.nn as nn

    from ..comm.collectives import CommsLogger
    from ..mesh.topology import Topology
    from ..plan import CheckpointingPlan

__all__ = [
    "checkpoint", "configure", "is_configured", "reset", "get_cuda_rng_tracker", "model_parallel_cuda_manual_seed",
    "model_parallel_reconfigure_tp_seed", "CudaRNGStatesTracker", "RNGStatesTracker", "CheckpointSettings",
    "checkpoint_function", "checkpoint_with", "checkpoint_blocks", "uncheckpoint_blocks", "find_blocks", "apply",
    "model_group_comm", "profile_totals", "settings", "non_reentrant_checkpoint", "partition_activations_in_checkpoint",
    "set_num_layers", "selective_policy", "SAVED_OPS", "partition_span", "ActivationCheckpointing", "current",
    "configure_from_plan",
]


def configure_from_plan(plan: CheckpointingPlan, model: nn.Module, topology: Topology,
                        log: Optional[CommsLogger] = None) -> ActivationCheckpointing:
    """A new engine's activation checkpointing, from its plan: the current one's successor
    (:meth:`~.core.ActivationCheckpointing.successor`), configured with the plan's settings (over
    ``topology``'s tensor-parallel group) when the config has the block or nothing configured it yet, so a
    configure() the user called before initialize survives a config without the block; ``plan.blocks`` also
    checkpoints every transformer block of ``model``. The engine registers it (its scope) when built."""
    own = current().successor()
    if plan.configure or not own.configured:
        own.apply(CheckpointSettings.from_plan(plan), model_group_comm(topology, log))
    if plan.blocks:
        checkpoint_blocks(model, policy=plan.policy)
    return own
