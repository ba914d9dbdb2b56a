"""``python -m shardspeed.cli``: the ``shardspeed`` command (the autotuner's trial commands run it this way)."""
import sys

from . import main

sys.exit(main())
