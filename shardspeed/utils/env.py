"""The environment variables shardspeed reads, each read when it is used (never at import) through one reader,
:func:`env_value`, which turns a bad value into a one-line ``ConfigError`` naming the variable, the value and
what it may be.

Ours: ``SHARDSPEED_TIMEOUT`` (seconds a collective may wait, > 0), ``SHARDSPEED_ERROR_WAIT`` (seconds a failed
worker waits for its peers' error records, >= 0), ``SHARDSPEED_VERIFY_SWAP`` and ``SHARDSPEED_TRACEBACK``
(flags). Standard library only, apart from the error class.
"""
from __future__ import annotations

import math
import os
from typing import Callable, NamedTuple, TypeVar

from ..errors import ConfigError

T = TypeVar("T")


class Kind(NamedTuple):
    """How to read one kind of value: ``parse`` (raises ValueError for a bad one) and what it may be, in words."""

    parse: Callable[[str], object]
    expected: str


def _seconds(text: str, minimum_exclusive: bool) -> float:
    value = float(text)
    if not math.isfinite(value) or value < 0 or (minimum_exclusive and value == 0):
        raise ValueError(text)
    return value


def _flag(text: str) -> bool:
    word = text.lower()
    if word in ("1", "true", "yes", "on"):
        return True
    if word in ("0", "false", "no", "off"):
        return False
    raise ValueError(text)


POSITIVE_SECONDS = Kind(lambda text: _seconds(text, True), "a finite number of seconds > 0 (e.g. 600)")
SECONDS = Kind(lambda text: _seconds(text, False), "a finite number of seconds >= 0 (e.g. 3)")
FLAG = Kind(_flag, "1 or 0 (also true/false, yes/no, on/off)")

TIMEOUT_ENV = "SHARDSPEED_TIMEOUT"
ERROR_WAIT_ENV = "SHARDSPEED_ERROR_WAIT"
VERIFY_SWAP_ENV = "SHARDSPEED_VERIFY_SWAP"
TRACEBACK_ENV = "SHARDSPEED_TRACEBACK"

#: Seconds a collective may wait when ``SHARDSPEED_TIMEOUT`` is not set.
DEFAULT_TIMEOUT_S = 600.0


def env_value(name: str, kind: Kind, default: T) -> T:
    """The environment variable ``name`` read now and parsed as ``kind``; ``default`` when it is unset or empty.
    A value ``kind`` refuses raises ``ConfigError``: ``SHARDSPEED_TIMEOUT='abc' is invalid: it must be ...``."""
    raw = os.environ.get(name, "")
    if not raw.strip():
        return default
    try:
        return kind.parse(raw.strip())  # type: ignore[return-value]
    except (ValueError, OverflowError):
        raise ConfigError(f"environment variable {name}={raw!r} is invalid: it must be {kind.expected}") from None


def collective_timeout_s() -> float:
    """``SHARDSPEED_TIMEOUT``: seconds a collective may wait before every rank fails (default 600)."""
    return env_value(TIMEOUT_ENV, POSITIVE_SECONDS, DEFAULT_TIMEOUT_S)


def error_wait_s() -> float:
    """``SHARDSPEED_ERROR_WAIT``: seconds a worker that recorded an error waits for its peers' (default 3)."""
    return env_value(ERROR_WAIT_ENV, SECONDS, 3.0)


def verify_swap() -> bool:
    """``SHARDSPEED_VERIFY_SWAP``: whether NVMe swap reads are checked against their checksums (default on)."""
    return env_value(VERIFY_SWAP_ENV, FLAG, True)


def full_tracebacks() -> bool:
    """``SHARDSPEED_TRACEBACK``: whether ``shardspeed run`` lets every rank print its traceback (default off)."""
    return env_value(TRACEBACK_ENV, FLAG, False)


def check_environment() -> None:
    """Read every variable above, so that a bad one fails once, in the launcher, not in every worker."""
    for read in (collective_timeout_s, error_wait_s, verify_swap, full_tracebacks):
        read()
