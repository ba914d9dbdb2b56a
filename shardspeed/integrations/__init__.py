"""Integrations with other libraries; each submodule imports its library only when it is imported itself.

- :mod:`shardspeed.integrations.transformers`: ``ShardspeedTrainer`` (a ``transformers.Trainer`` that
  trains through a shardspeed engine), ``fill_auto`` and ``save_pretrained``.
"""
