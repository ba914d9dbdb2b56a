"""``deepspeed.checkpoint.utils.clone_tensors_for_torch_save``: a copy of a (nested) state for ``torch.save``
whose tensors own their storage (a view of a flat buffer would otherwise save the whole buffer)."""
from __future__ import annotations

from typing import Any, Union

import torch

from ..compat.alias import module_getattr


def clone_tensors_for_torch_save(item: Any, device: Union[str, torch.device] = "cpu") -> Any:
    """``item`` with every tensor inside it (in lists, tuples and dicts, nested; the dict's type kept) replaced
    by a detached copy on ``device``; anything else is returned as it is."""
    if torch.is_tensor(item):
        target = torch.device(device)
        return item.detach().clone() if target == item.device else item.detach().to(target)
    if isinstance(item, list):
        return [clone_tensors_for_torch_save(v, device) for v in item]
    if isinstance(item, tuple):
        return tuple(clone_tensors_for_torch_save(v, device) for v in item)
    if isinstance(item, dict):
        return type(item)({k: clone_tensors_for_torch_save(v, device) for k, v in item.items()})
    return item


__getattr__ = module_getattr(__name__)
