"""Rank-aware logging: the library logs through ``logging.getLogger("shardspeed")``."""
from __future__ import annotations

import logging
import os
import sys


class _RankFilter(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        record.rank = os.environ.get("RANK", "0")
        return True


def setup_logging(level: int = logging.INFO) -> logging.Logger:
    """Give the ``shardspeed`` logger one stderr handler (``[shardspeed rank N] message``) unless the
    application configured one. Idempotent; an application's own logging configuration wins."""
    logger = logging.getLogger("shardspeed")
    if not logger.handlers and not logging.getLogger().handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.addFilter(_RankFilter())
        handler.setFormatter(logging.Formatter("[shardspeed rank %(rank)s] %(message)s"))
        logger.addHandler(handler)
        logger.propagate = False
        if logger.level == logging.NOTSET:
            logger.setLevel(level)
    return logger
