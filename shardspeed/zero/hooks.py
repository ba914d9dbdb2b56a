"""Two autograd-level hooks stage 3 needs beside forward hooks: parameter reads, and a module's post-backward.

- :class:`ReadGatheringParameters` replaces a module's ``_parameters`` dict: ``module.weight`` goes through
  ``nn.Module.__getattr__`` to the dict's ``__getitem__``, which hands a released parameter (an empty
  placeholder) to a callback before returning it. So a parameter read by code other than its module's own
  forward (torch's MultiheadAttention passes ``out_proj.weight`` to a functional without calling
  ``out_proj``; DeBERTa's encoder reads ``rel_embeddings.weight``; a parent reads a child's weight) is
  gathered first. A gathered parameter costs one ``numel()`` check per read.
- :func:`register_post_backward` passes a module's tensor inputs through an identity autograd Function whose
  backward runs once autograd has computed the gradients of those inputs: the module's whole backward,
  the uses of its frozen weights included, is then done (FSDP2's ``RegisterPostBackwardFunction``).

Also the small helpers stage 3's hook installation uses (:class:`Undo`, :func:`holders`, :func:`within`,
:func:`flatten_tensors`).
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Dict, List, Sequence, Tuple

import torch
import torch.nn as nn
from torch.utils._pytree import tree_flatten, tree_unflatten

if TYPE_CHECKING:
    from .unit import ShardedParamUnit


class ReadGatheringParameters(dict):
    """A module's ``_parameters``: reading a parameter whose storage is released calls ``on_read(param)``
    first (which gathers it when that is due); everything else is a plain dict. Copies and pickles are
    plain dicts (a copied module is not hooked)."""

    def __init__(self, items: Dict[str, Any], on_read: Callable[[nn.Parameter], None]):
        super().__init__(items)
        self.on_read = on_read

    def __getitem__(self, name: str):
        p = dict.__getitem__(self, name)
        if p is not None and p.numel() == 0:
            self.on_read(p)
        return p

    def __reduce__(self):
        return dict, (dict(self),)

    def __copy__(self) -> dict:
        return dict(self)

    def __deepcopy__(self, memo) -> dict:
        import copy

        return {k: copy.deepcopy(v, memo) for k, v in self.items()}


def watch_parameter_reads(module: nn.Module, on_read: Callable[[nn.Parameter], None]) -> Callable[[], None]:
    """Route reads of ``module``'s own parameters through ``on_read``; returns the undo."""
    plain = module._parameters
    module._parameters = ReadGatheringParameters(plain, on_read)

    def undo() -> None:
        module._parameters = dict(module._parameters)

    return undo


class _PostBackward(torch.autograd.Function):
    """Identity on the inputs; its backward calls ``callback`` when their gradients are complete."""

    @staticmethod
    def forward(ctx, callback, *inputs):
        ctx.callback = callback
        return inputs if len(inputs) != 1 else inputs[0]

    @staticmethod
    def backward(ctx, *grads):
        ctx.callback()
        return (None, *grads)


def register_post_backward(args: Tuple[Any, ...], kwargs: Dict[str, Any],
                           callback: Callable[[], None]) -> Tuple[bool, Tuple[Any, ...], Dict[str, Any]]:
    """Pass the tensors of ``args``/``kwargs`` that require grad through :class:`_PostBackward`. Returns
    (whether any did, so ``callback`` will run in the backward; the new args; the new kwargs)."""
    flat, spec = tree_flatten((args, kwargs))
    at = [i for i, t in enumerate(flat) if torch.is_tensor(t) and t.requires_grad]
    if not at:
        return False, args, kwargs
    out = _PostBackward.apply(callback, *[flat[i] for i in at])
    out = (out,) if torch.is_tensor(out) else out
    for i, t in zip(at, out):
        flat[i] = t
    new_args, new_kwargs = tree_unflatten(flat, spec)
    return True, new_args, new_kwargs


class Undo:
    """A callable undo with the ``remove()`` of torch's hook handles."""

    def __init__(self, undo: Callable[[], None]):
        self.remove = undo


def holders(root: nn.Module, units: Sequence[ShardedParamUnit]) -> List[nn.Module]:
    """The modules whose own ``_parameters`` hold a parameter of one of ``units``."""
    mine = {id(p) for u in units for p in u.params}
    return [m for m in root.modules() if any(p is not None and id(p) in mine for p in m._parameters.values())]


def within(module: nn.Module, ancestor: nn.Module) -> bool:
    """``module`` is ``ancestor`` or one of its submodules."""
    return any(module is d for d in ancestor.modules())


def flatten_tensors(obj) -> List[torch.Tensor]:
    if torch.is_tensor(obj):
        return [obj]
    if isinstance(obj, (list, tuple)):
        return [t for o in obj for t in flatten_tensors(o)]
    if isinstance(obj, dict):
        return [t for o in obj.values() for t in flatten_tensors(o)]
    return []
