"""``deepspeed.runtime.zero.partition_parameters``: where DeepSpeed defines ``zero.Init``.

DeepSpeed's ``Init`` replaces torch's tensor constructors while it is active (casting new floating tensors to
the training dtype and placing them on the accelerator) through ``zero_wrapper_for_fp_tensor_constructor``;
transformers swaps that function for one that leaves ``torch.arange`` alone (``prevent_arange_dtype_change``)
and reads ``_orig_torch_arange`` to recognise it. shardspeed's ``Init`` (:mod:`shardspeed.zero.init`) never
replaces a constructor: tensors are created as the model asks and only parameters are sharded. So the
function here is not called by shardspeed; it exists, with DeepSpeed's behaviour for whoever calls it,
so that code which swaps it in and out works unchanged.
"""
from __future__ import annotations

from typing import Any, Callable, Optional

import torch

from ...compat.alias import module_getattr
from ...zero import GatheredParameters, Init

_orig_torch_arange = torch.arange


def zero_wrapper_for_fp_tensor_constructor(fn: Callable, target_fp_dtype: Optional[torch.dtype],
                                           target_device: Optional[torch.device] = None) -> Callable:
    """``fn`` (a tensor constructor) made to create on ``target_device`` and cast floating results to
    ``target_fp_dtype``, as DeepSpeed's ``Init`` does to every constructor (shardspeed's never does)."""

    def wrapped(*args: Any, **kwargs: Any) -> torch.Tensor:
        if kwargs.get("device") is None and target_device is not None:
            kwargs["device"] = target_device
        tensor = fn(*args, **kwargs)
        if target_fp_dtype is not None and tensor.is_floating_point():
            tensor.data = tensor.data.to(target_fp_dtype)
        return tensor

    return wrapped


__all__ = ["GatheredParameters", "Init", "zero_wrapper_for_fp_tensor_constructor"]

__getattr__ = module_getattr(__name__)
