"""``deepspeed.checkpoint.utils``: ``clone_tensors_for_torch_save``, which accelerate's ``get_state_dict``
(and so transformers' ``save_model`` below ZeRO 3) applies to the module's state dict before saving it."""
from __future__ import annotations

from typing import Any, Union

import torch

from ..compat.alias import module_getattr


def clone_tensors_for_torch_save(item: Any, device: Union[str, torch.device] = "cpu") -> Any:
    """A copy of ``item`` whose tensors (also inside nested lists, tuples and dicts, a dict keeping its type)
    are detached copies on ``device`` that own their storage: a view into an engine's flat buffer would
    otherwise save the whole buffer. Anything else is returned as it is."""
    if isinstance(item, torch.Tensor):
        target = torch.device(device)
        return item.detach().clone() if item.device == target else item.detach().to(target)
    if isinstance(item, list):
        return [clone_tensors_for_torch_save(v, device) for v in item]
    if isinstance(item, tuple):  # a plain tuple, as DeepSpeed's
        return tuple(clone_tensors_for_torch_save(v, device) for v in item)
    if isinstance(item, dict):
        return type(item)({k: clone_tensors_for_torch_save(v, device) for k, v in item.items()})
    return item


__getattr__ = module_getattr(__name__)
