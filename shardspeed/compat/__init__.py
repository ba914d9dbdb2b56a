"""DeepSpeed's import surface: the opt-in ``deepspeed`` package that resolves to shardspeed.

shardspeed mirrors DeepSpeed's module paths (``shardspeed.runtime.engine``, ``shardspeed.ops.adam``,
``shardspeed.accelerator``...), so ``import shardspeed as deepspeed`` runs DeepSpeed's scripts. For code that
says ``import deepspeed`` itself (accelerate, transformers' Trainer, TRL, Lightning), :func:`site_path` is a
folder holding a ``deepspeed`` package and its distribution metadata; put it first on ``PYTHONPATH``
(``shardspeed run --as-deepspeed`` does) and ``deepspeed.X.Y`` is the module ``shardspeed.X.Y`` itself (the same
objects: ``isinstance`` checks against ``deepspeed.DeepSpeedEngine`` pass). Nothing shadows an installed
DeepSpeed unless asked. See :mod:`.alias` and docs/integrations.md.
"""
from .alias import DEEPSPEED_VERSION, active, install, module_getattr, not_provided, site_path

__all__ = ["DEEPSPEED_VERSION", "active", "install", "module_getattr", "not_provided", "site_path"]
