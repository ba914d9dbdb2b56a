"""``deepspeed.utils.torch``: :func:`required_torch_version`."""
from __future__ import annotations

from typing import Optional, Union

import torch
from packaging import version as _version

from ..compat.alias import module_getattr
from ..errors import ConfigError


def required_torch_version(min_version: Optional[Union[str, float]] = None,
                           max_version: Optional[Union[str, float]] = None) -> bool:
    """Whether the running torch is at least ``min_version`` and at most ``max_version`` (DeepSpeed's check; a
    local label such as ``+cpu`` is part of the comparison, as in DeepSpeed)."""
    if min_version is None and max_version is None:
        raise ConfigError("required_torch_version() needs min_version= or max_version=")
    have = _version.parse(torch.__version__)
    if min_version is not None and _version.parse(str(min_version)) > have:
        return False
    return max_version is None or _version.parse(str(max_version)) >= have


__getattr__ = module_getattr(__name__)
