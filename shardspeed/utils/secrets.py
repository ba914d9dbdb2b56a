"""`mask_secrets`: a config as it may be shown (logged, printed, written beside results or into a checkpoint
that others read), with the value of every secret-looking key replaced by "***"."""
from __future__ import annotations

from typing import Any

MASK = "***"
#: Keys whose value is a secret, compared case-insensitively; also any key ending in one of _SUFFIXES.
_NAMES = frozenset({"api_key", "apikey", "token", "password", "passwd", "secret", "credentials", "auth"})
_SUFFIXES = ("_key", "_token", "_password", "_secret")


def is_secret_key(key: str) -> bool:
    """``api_key``, ``token``, ``password``, ``secret``, ``*_key``, ``*_token``, ... (case-insensitive)."""
    name = key.lower()
    return name in _NAMES or name.endswith(_SUFFIXES)


def mask_secrets(value: Any) -> Any:
    """A copy of ``value`` (dicts and lists, nested) with the value of every secret key (:func:`is_secret_key`)
    that is set (not None, not empty) replaced by ``"***"``; ``value`` itself is not changed."""
    if isinstance(value, dict):
        return {k: MASK if isinstance(k, str) and is_secret_key(k) and v not in (None, "") else mask_secrets(v)
                for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [mask_secrets(v) for v in value]
    return value


__all__ = ["mask_secrets", "is_secret_key", "MASK"]
