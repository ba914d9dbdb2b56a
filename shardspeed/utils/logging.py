"""``deepspeed.utils.logging``: ``logger`` (shardspeed's logger, ``logging.getLogger("shardspeed")``) and
DeepSpeed's rank-filtered helpers :func:`log_dist` / :func:`print_dist` ("[Rank N] message" on the ranks
asked for, every process before a process group exists)."""
from __future__ import annotations

import functools
import logging
from typing import Optional, Sequence

import torch.distributed as dist

from ..compat.alias import module_getattr

logger = logging.getLogger("shardspeed")

log_levels = {"debug": logging.DEBUG, "info": logging.INFO, "warning": logging.WARNING, "error": logging.ERROR,
              "critical": logging.CRITICAL}


def get_dist_msg(message: str, ranks: Optional[Sequence[int]] = None) -> Optional[str]:
    """``"[Rank r] message"`` when this process should log it, else None: before a process group exists every
    process does (as rank -1); after, the ranks listed (``[-1]``: all of them); none when ``ranks`` is empty."""
    up = dist.is_available() and dist.is_initialized()
    rank = dist.get_rank() if up else -1
    ranks = list(ranks or [])
    if up and not (ranks and (ranks[0] == -1 or rank in ranks)):
        return None
    return f"[Rank {rank}] {message}"


def log_dist(message: str, ranks: Optional[Sequence[int]] = None, level: int = logging.INFO) -> None:
    """Log ``message`` through :data:`logger` at ``level`` on the ranks :func:`get_dist_msg` picks."""
    from ..monitor.log import setup_logging

    final = get_dist_msg(message, ranks)
    if final is not None:
        setup_logging()
        logger.log(level, final)


@functools.cache
def log_dist_once(message: str, ranks: Optional[tuple] = None, level: int = logging.INFO) -> None:
    """:func:`log_dist`, each distinct message once per process (``ranks`` as a tuple)."""
    log_dist(message, list(ranks) if ranks is not None else None, level)


def print_dist(message: str, ranks: Optional[Sequence[int]] = None) -> None:
    """:func:`log_dist` with ``print`` (whatever the log level)."""
    final = get_dist_msg(message, ranks)
    if final is not None:
        print(final)


def get_log_level_from_string(log_level_str: str) -> int:
    level = log_levels.get(log_level_str.lower())
    if level is None:
        raise ValueError(f"{log_level_str} is not one of the valid logging levels: {sorted(log_levels)}")
    return level


def set_log_level_from_string(log_level_str: str, custom_logger: Optional[logging.Logger] = None) -> None:
    """Set ``custom_logger`` (default :data:`logger`) and its handlers to the named level."""
    target = custom_logger or logger
    level = get_log_level_from_string(log_level_str)
    target.setLevel(level)
    for handler in target.handlers:
        handler.setLevel(level)


def should_log_le(max_log_level_str: str) -> bool:
    """Whether the logger's level is at most the named one (``should_log_le("info")``: info or debug is on)."""
    return logger.getEffectiveLevel() <= get_log_level_from_string(max_log_level_str)


__getattr__ = module_getattr(__name__)
