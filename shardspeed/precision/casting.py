"""Casting a module for training as DeepSpeed 0.19.8 does (``data_types``): parameters to the training dtype,
floating buffers only when ``buffer_dtype`` asks, and the buffers ``keep_in_fp32_modules`` names kept in (or
brought back to) fp32 under 16-bit training (transformers' ``_keep_in_fp32_modules_strict``, and
``_keep_in_fp32_modules`` under fp16). Also the classes ``torch_autocast.lower_precision_safe_modules`` names."""
from __future__ import annotations

import importlib
import re
from typing import List, Optional, Sequence, Set, Tuple, Union

import torch
from torch import nn

from ..errors import ConfigError

_CASTABLE = (torch.float32, torch.float16, torch.bfloat16)
#: the attribute DeepSpeed's torch_autocast sets on a parameter of a lower-precision-safe module: the dtype its
#: gradient is reduced in
COMM_DTYPE_ATTR = "comm_dtype"


def keep_in_fp32_pattern(module: nn.Module, setting: Union[str, Sequence[str]],
                         dtype: Optional[torch.dtype]) -> Optional[re.Pattern[str]]:
    """The pattern of buffer names to keep in fp32 while training in ``dtype``, or None (fp32 training, or no
    names). ``"auto"``: each submodule's own transformers lists, anchored under its name."""
    if dtype not in (torch.float16, torch.bfloat16):
        return None
    patterns: Set[str] = set()
    if isinstance(setting, str):
        for prefix, child in module.named_modules():
            names = set(getattr(child, "_keep_in_fp32_modules_strict", None) or [])
            if dtype == torch.float16:
                names |= set(getattr(child, "_keep_in_fp32_modules", None) or [])
            for name in names:
                body = name.replace("*", ".*")
                patterns.add(rf"^{re.escape(prefix)}\..*{body}" if prefix else body)
    else:
        patterns = {name.replace("*", ".*") for name in setting}
    return re.compile("|".join(sorted(patterns))) if patterns else None


def _buffers_matching(module: nn.Module, pattern: re.Pattern[str]) -> List[torch.Tensor]:
    found = []
    for prefix, owner in module.named_modules():
        for name, buf in owner.named_buffers(recurse=False):
            full = f"{prefix}.{name}" if prefix else name
            if buf is not None and buf.is_floating_point() and pattern.search(full):
                found.append(buf)
    return found


@torch.no_grad()
def cast_module(module: nn.Module, params: Optional[torch.dtype], buffers: Optional[torch.dtype],
                keep_in_fp32: Union[str, Sequence[str]]) -> int:
    """Cast ``module`` in place (tensor objects kept); returns how many buffers were kept in fp32."""
    if params is not None:
        for p in module.parameters():
            if p.dtype in _CASTABLE and p.dtype != params:
                p.data = p.data.to(params)
    pattern = keep_in_fp32_pattern(module, keep_in_fp32, params)
    kept = _buffers_matching(module, pattern) if pattern is not None else []
    for b in kept:
        if b.dtype != torch.float32:
            b.data = b.data.float()
    if buffers is not None:
        kept_ids = {id(b) for b in kept}
        for b in module.buffers():
            if id(b) not in kept_ids and b.dtype in _CASTABLE and b.dtype != buffers:
                b.data = b.data.to(buffers)
    return len(kept)


def safe_module_classes(names: Sequence[str]) -> Tuple[type, ...]:
    """The classes of ``torch_autocast.lower_precision_safe_modules`` ("package.Class"), imported; a name that
    does not import is a ConfigError naming it."""
    out = []
    for name in names:
        package, _, cls = name.rpartition(".")
        try:
            out.append(getattr(importlib.import_module(package), cls))
        except (ImportError, AttributeError, ValueError) as e:
            raise ConfigError(f"torch_autocast.lower_precision_safe_modules: cannot import '{name}' ({e}); give "
                              f"classes as \"package.Class\", e.g. \"torch.nn.Linear\"") from None
    return tuple(out)


def tag_lower_precision_params(module: nn.Module, classes: Tuple[type, ...], dtype: torch.dtype) -> int:
    """Tag the parameters directly owned by modules whose class is exactly one of ``classes`` (as DeepSpeed
    matches them: subclasses do not count) with ``comm_dtype = dtype``; returns how many were tagged."""
    n = 0
    for m in module.modules():
        if type(m) in classes:
            for p in m.parameters(recurse=False):
                setattr(p, COMM_DTYPE_ATTR, dtype)
                n += 1
    return n


__all__ = ["cast_module", "keep_in_fp32_pattern", "safe_module_classes", "tag_lower_precision_params",
           "COMM_DTYPE_ATTR"]
