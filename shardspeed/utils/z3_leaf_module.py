"""``deepspeed.utils.z3_leaf_module``: mark modules as ZeRO-3 *leaf* modules.

A leaf module's parameters (its whole subtree's) form one stage-3 unit, gathered together when the module's
forward starts (:func:`shardspeed.zero.stage3_units.select_units` reads the flag), whatever the size: for
mixture-of-experts blocks, whose experts run in an order that changes from step to step, and for deeply
nested small modules. The flag is DeepSpeed's own attribute (``module._z3_leaf``), so modules marked through
real DeepSpeed's function, or by transformers / accelerate, are leaves here too. Set it before ``initialize``.
"""
from __future__ import annotations

from typing import Callable, List, Sequence, Tuple, Type, Union

import torch.nn as nn

from ..compat.alias import module_getattr

LEAF_ATTR = "_z3_leaf"


def z3_leaf_module(model: nn.Module) -> bool:
    """Whether ``model`` is flagged as a leaf."""
    return bool(getattr(model, LEAF_ATTR, False))


def z3_leaf_parameter(param) -> bool:
    """Whether ``param`` belongs to a leaf module (DeepSpeed's ``ds_z3_leaf_module`` attribute)."""
    return hasattr(param, "ds_z3_leaf_module")


def get_z3_leaf_modules(model: nn.Module) -> List[nn.Module]:
    """The modules of ``model`` (itself included) flagged as leaves."""
    return [m for m in model.modules() if z3_leaf_module(m)]


def set_z3_leaf_module(model: nn.Module, flag: bool) -> None:
    setattr(model, LEAF_ATTR, flag)


def _matches(module: nn.Module, spec: Union[type, str]) -> bool:
    if isinstance(spec, type):
        return isinstance(module, spec)
    cls = type(module)
    return spec in (cls.__name__, f"{cls.__module__}.{cls.__qualname__}")


def _set_flags(model: nn.Module, classes: Sequence[Union[Type[nn.Module], str]], flag: bool,
               raise_if_not_found: bool) -> List[nn.Module]:
    if not all(isinstance(c, (type, str)) for c in classes):
        raise ValueError(f"leaf_module_classes must be a list of module classes or class names, got {classes!r}")
    found = [m for m in model.modules() if any(_matches(m, c) for c in classes)]
    for m in found:
        set_z3_leaf_module(m, flag)
    if not found and raise_if_not_found:
        raise ValueError(f"No modules of type {list(classes)} found in model {type(model).__name__}")
    return found


def set_z3_leaf_modules(model: nn.Module, leaf_module_classes: Sequence[Union[Type[nn.Module], str]],
                        raise_if_not_found: bool = True) -> List[nn.Module]:
    """Flag every module of ``model`` whose class is one of ``leaf_module_classes`` (classes, or class names,
    plain or fully qualified); returns them. None found: ValueError unless ``raise_if_not_found=False``."""
    return _set_flags(model, leaf_module_classes, True, raise_if_not_found)


def unset_z3_leaf_modules(model: nn.Module, leaf_module_classes: Sequence[Union[Type[nn.Module], str]],
                          raise_if_not_found: bool = True) -> List[nn.Module]:
    """Clear the flag on those modules (see :func:`set_z3_leaf_modules`)."""
    return _set_flags(model, leaf_module_classes, False, raise_if_not_found)


def _set_by(model: nn.Module, keys: Sequence[str], match: Callable[[str, str], bool], flag: bool,
            raise_if_not_found: bool, what: str) -> Tuple[List[nn.Module], List[str]]:
    found: List[nn.Module] = []
    missing: List[str] = []
    for key in keys:
        hits = [m for name, m in model.named_modules() if match(name, key)]
        if not hits:
            missing.append(key)
        for m in hits:
            set_z3_leaf_module(m, flag)
            if all(m is not f for f in found):
                found.append(m)
    if missing and raise_if_not_found:
        raise ValueError(f"No modules {what} {missing} found in model {type(model).__name__}")
    return found, missing


def set_z3_leaf_modules_by_name(model: nn.Module, module_names: Sequence[str], flag: bool = True,
                                raise_if_not_found: bool = True) -> Tuple[List[nn.Module], List[str]]:
    """Set the flag on the modules named (as ``named_modules()`` names them); returns (modules, names not found)."""
    return _set_by(model, module_names, lambda name, key: name == key, flag, raise_if_not_found, "named")


def set_z3_leaf_modules_by_suffix(model: nn.Module, module_name_suffixes: Sequence[str], flag: bool = True,
                                  raise_if_not_found: bool = True) -> Tuple[List[nn.Module], List[str]]:
    """Set the flag on the modules whose name ends with a suffix; returns (modules, suffixes that matched none)."""
    return _set_by(model, module_name_suffixes, lambda name, key: name.endswith(key), flag, raise_if_not_found,
                   "matching suffixes")


__getattr__ = module_getattr(__name__)
