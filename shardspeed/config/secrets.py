"""`mask_secrets`, `is_secret_key` and `MASK` (:mod:`shardspeed.utils.secrets`), where code that speaks config
imports them."""
from __future__ import annotations

from ..utils.secrets import MASK, is_secret_key, mask_secrets

__all__ = ["mask_secrets", "is_secret_key", "MASK"]
