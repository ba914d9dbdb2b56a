"""``deepspeed.runtime.activation_checkpointing.checkpointing``: the module :mod:`shardspeed.checkpointing`
itself (``deepspeed.checkpointing`` is the same module in DeepSpeed), registered under this name too."""
import sys

import shardspeed.checkpointing as _checkpointing

sys.modules[__name__] = _checkpointing
