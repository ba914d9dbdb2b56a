"""DeepSpeed's checkpoints, read and written without DeepSpeed's code (see docs/checkpoints.md,
"Coming from DeepSpeed").

- :func:`open_deepspeed`: a DeepSpeed checkpoint (ZeRO 0-3, or its universal layout) as the tensor table,
  per-parameter entries and common state our loader consumes, so ``engine.load_checkpoint`` reshards it
  to any world size and stage;
- :mod:`.layout`: where ZeRO puts each parameter in its flat partitions (pure arithmetic).
"""
from .source import DeepSpeedSource, is_deepspeed_dir
from .universal import describe, open_deepspeed

__all__ = ["DeepSpeedSource", "open_deepspeed", "is_deepspeed_dir", "describe"]
