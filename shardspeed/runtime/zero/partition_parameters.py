"""``deepspeed.runtime.zero.partition_parameters``: ``Init`` and ``GatheredParameters`` (shardspeed's,
:mod:`shardspeed.zero`) and ``ZeroParamStatus``, the value of a stage-3 parameter's ``ds_status``.

transformers' ``prevent_arange_dtype_change`` swaps ``zero_wrapper_for_fp_tensor_constructor`` while it
builds a model under ``zero.Init`` and compares against ``_orig_torch_arange``: shardspeed's ``Init`` wraps
no tensor constructor (a parameter is sharded when it is registered), so the wrapper returns the constructor
unchanged and swapping it changes nothing.
"""
from __future__ import annotations

from typing import Any, Callable

import torch

from ...compat.alias import module_getattr
from ...zero import GatheredParameters, Init
from ...zero.tags import ZeroParamStatus

_orig_torch_arange = torch.arange


def zero_wrapper_for_fp_tensor_constructor(fn: Callable, *args: Any, **kwargs: Any) -> Callable:
    """``fn`` itself: shardspeed's ``zero.Init`` changes no tensor constructor's dtype or device."""
    return fn


__all__ = ["GatheredParameters", "Init", "ZeroParamStatus", "zero_wrapper_for_fp_tensor_constructor"]

__getattr__ = module_getattr(__name__)
