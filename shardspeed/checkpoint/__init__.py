"""Sharded, atomic, exactly resumable, reshardable checkpoints (see docs/checkpoints.md).

- :func:`save_checkpoint` / :func:`load_checkpoint` (the engine's methods delegate here);
- :func:`consolidate`: one fp32 state dict (safetensors, split by size) from a sharded checkpoint;
- :func:`save_16bit_model`: the train-dtype weights of the model, gathered at stage 3.
"""
from ..errors import CheckpointError
from .consolidate import consolidate, load_consolidated
from .export import save_16bit_model
from .load import load_checkpoint
from .save import save_checkpoint

__all__ = ["save_checkpoint", "load_checkpoint", "consolidate", "load_consolidated", "save_16bit_model",
           "CheckpointError"]
