"""What a checkpoint does with its saved inputs and around its forward and backward: one frozen value.

The engine builds it from the plan's :class:`~shardspeed.plan.CheckpointingPlan` (what ``decide`` made of the
config's ``activation_checkpointing`` block); ``configure()`` from its keyword arguments (DeepSpeed's names)
over an optional DeepSpeed-format config, whose plan it takes the same way.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Optional

from ..errors import ConfigError

if TYPE_CHECKING:
    from ..plan import CheckpointingPlan

POLICIES = ("full", "selective")


@dataclass(frozen=True)
class CheckpointSettings:
    """The ``activation_checkpointing`` keys, as `shardspeed.checkpointing.checkpoint` reads them.

    ``synchronize`` is ``synchronize_checkpoint_boundary``; ``policy`` (our extension) is what a checkpointed
    region keeps: ``"full"`` only its inputs, ``"selective"`` also matmul and attention outputs."""

    partition_activations: bool = False
    cpu_checkpointing: bool = False
    contiguous_memory_optimization: bool = False
    number_checkpoints: Optional[int] = None
    synchronize: bool = False
    profile: bool = False
    policy: str = "full"

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise ConfigError(f"activation checkpointing policy {self.policy!r} is unknown; use one of {POLICIES}")
        if self.number_checkpoints is not None and (isinstance(self.number_checkpoints, bool)
                                                    or int(self.number_checkpoints) < 1):
            raise ConfigError(f"number_checkpoints must be a positive integer, got {self.number_checkpoints!r}")
        if self.contiguous_memory_optimization and not self.partition_activations:
            raise ConfigError("contiguous_memory_optimization needs partition_activations (its buffers hold the "
                              "partitions, as in DeepSpeed): enable partition_activations or drop it")
        if self.contiguous_memory_optimization and self.number_checkpoints is None:
            raise ConfigError("contiguous_memory_optimization needs number_checkpoints (how many checkpointed "
                              "blocks one forward runs) to size its buffers: set it")

    @classmethod
    def from_config(cls, block: Any) -> CheckpointSettings:
        """From an `ActivationCheckpointingConfig` (the config's ``activation_checkpointing`` block)."""
        return cls(partition_activations=bool(block.partition_activations),
                   cpu_checkpointing=bool(block.cpu_checkpointing),
                   contiguous_memory_optimization=bool(block.contiguous_memory_optimization),
                   number_checkpoints=block.number_checkpoints,
                   synchronize=bool(block.synchronize_checkpoint_boundary),
                   profile=bool(block.profile), policy=str(block.policy))

    @classmethod
    def from_plan(cls, plan: CheckpointingPlan) -> CheckpointSettings:
        """From the plan's activation checkpointing (:func:`shardspeed.plan.checkpointing_plan`)."""
        return cls(partition_activations=plan.partitioned, cpu_checkpointing=plan.on_host,
                   contiguous_memory_optimization=plan.contiguous, number_checkpoints=plan.checkpoints_per_forward,
                   synchronize=plan.synchronize, profile=plan.profile, policy=plan.policy)
