"""``deepspeed.add_config_arguments``: DeepSpeed's command-line flags on a user's ``argparse`` parser."""
from __future__ import annotations

import argparse


def add_config_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add DeepSpeed's group: ``--deepspeed`` (a flag for the script's own use), ``--deepspeed_config PATH``
    (what ``initialize(args=...)`` reads), and their deprecated spellings ``--deepscale`` /
    ``--deepscale_config``. Returns the parser."""
    group = parser.add_argument_group("DeepSpeed", "DeepSpeed configurations")
    group.add_argument("--deepspeed", default=False, action="store_true",
                       help="Enable DeepSpeed (helper flag for user code, no impact on the engine)")
    group.add_argument("--deepspeed_config", default=None, type=str, help="DeepSpeed json configuration file.")
    group.add_argument("--deepscale", default=False, action="store_true",
                       help="Deprecated enable DeepSpeed (helper flag for user code, no impact on the engine)")
    group.add_argument("--deepscale_config", default=None, type=str, help="Deprecated DeepSpeed json configuration file.")
    return parser
