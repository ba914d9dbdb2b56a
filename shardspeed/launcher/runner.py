"""``deepspeed.launcher.runner``: the constants integrations read (accelerate writes its environment file
under ``DEEPSPEED_ENVIRONMENT_NAME``). Only the constants; the launcher is ``shardspeed run``."""
import os

from ..compat.alias import module_getattr

DEEPSPEED_ENVIRONMENT_NAME = os.getenv("DS_ENV_FILE", ".deepspeed_env")
DEEPSPEED_ENVIRONMENT_PATHS = [os.path.expanduser("~"), "."]
DLTS_HOSTFILE = "/job/hostfile"

__getattr__ = module_getattr(__name__)
