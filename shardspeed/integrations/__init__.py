"""Integrations with training frameworks; each submodule imports its framework only when it is imported itself.

- :mod:`shardspeed.integrations.lightning`: ``ShardspeedStrategy`` for ``lightning.Trainer``.
- :mod:`shardspeed.integrations.transformers`: ``ShardspeedTrainer`` (a ``transformers.Trainer`` that
  trains through a shardspeed engine), ``fill_auto`` and ``save_pretrained``.
"""
