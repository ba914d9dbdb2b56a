"""``deepspeed.launcher.runner``: DeepSpeed's ``deepspeed`` command, as ``shardspeed run --as-deepspeed``.

``main(args)`` takes DeepSpeed's launcher options (``--num_gpus``, ``--hostfile``, ``--include`` ...; see
:mod:`shardspeed.cli.ds_options`) and torchrun's, and starts the script with ``import deepspeed`` resolving to
shardspeed's package and ``--local_rank=N`` in its argv. ``python -m deepspeed.launcher.runner`` (with
``shardspeed deepspeed-path`` on ``PYTHONPATH``) and the ``deepspeed`` command in ``shardspeed deepspeed-path
--bin`` run it. A multi-node job runs the same command on every host (shardspeed starts no remote process).
"""
from __future__ import annotations

import os
import sys
from typing import Optional, Sequence

from ..compat.alias import module_getattr

#: The file of ``KEY=VALUE`` lines DeepSpeed's launcher exports to multi-node workers (in each of
#: ``DEEPSPEED_ENVIRONMENT_PATHS``, the later winning; ``DS_ENV_FILE`` renames it). accelerate writes it.
DEEPSPEED_ENVIRONMENT_NAME = os.getenv("DS_ENV_FILE", ".deepspeed_env")
DEEPSPEED_ENVIRONMENT_PATHS = [os.path.expanduser("~"), "."]
DLTS_HOSTFILE = "/job/hostfile"  # DeepSpeed's default --hostfile; shardspeed reads a hostfile only when given


def main(args: Optional[Sequence[str]] = None) -> int:
    """The ``deepspeed`` command: returns its exit status."""
    from ..cli import main as shardspeed_main

    argv = list(sys.argv[1:] if args is None else args)
    if not argv or argv[0] in ("-h", "--help"):
        return shardspeed_main(["run", "--help"])
    return shardspeed_main(["run", "--as-deepspeed", *argv])


__getattr__ = module_getattr(__name__)

if __name__ == "__main__":
    sys.exit(main())
