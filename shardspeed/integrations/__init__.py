"""Integrations with training frameworks (imported on demand: each needs its framework installed).

- :mod:`shardspeed.integrations.lightning`: ``ShardspeedStrategy`` for ``lightning.Trainer``.
"""
