"""``deepspeed.launcher.runner``: ``DEEPSPEED_ENVIRONMENT_NAME``, the file of ``KEY=VALUE`` lines DeepSpeed's
launcher exports to multi-node workers (accelerate's launcher imports it and writes it for multi-node jobs)."""
import os

from ..compat.alias import module_getattr

DEEPSPEED_ENVIRONMENT_NAME = os.getenv("DS_ENV_FILE", ".deepspeed_env")

__getattr__ = module_getattr(__name__)
