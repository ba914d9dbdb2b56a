"""``deepspeed.ops.op_builder``: DeepSpeed's builders for the ops shardspeed provides, answering honestly.

shardspeed compiles nothing: its optimizer "ops" are torch's own kernels. So ``is_compatible()`` is True
wherever torch runs, and ``load()`` returns the shardspeed module that implements the op (there is no
extension object: asking that module for a kernel function such as ``multi_tensor_adam`` fails with the
one-line not-provided error). Builders of ops shardspeed does not have fail the same way.
"""
from __future__ import annotations

import importlib
from types import ModuleType
from typing import Dict, Optional, Type

from ...compat.alias import module_getattr


class OpBuilder:
    """A DeepSpeed op builder whose op is a torch kernel (nothing to build)."""

    NAME = ""
    MODULE = ""

    def __init__(self, name: Optional[str] = None) -> None:
        self.name = name or self.NAME

    def absolute_name(self) -> str:
        return f"deepspeed.ops.{self.NAME}_op"

    def is_compatible(self, verbose: bool = False) -> bool:
        return True

    def load(self, verbose: bool = True) -> ModuleType:
        return importlib.import_module(self.MODULE)

    jit_load = load

    def builder(self):
        return None


class FusedAdamBuilder(OpBuilder):
    NAME, MODULE = "fused_adam", "shardspeed.ops.adam.fused_adam"


class CPUAdamBuilder(OpBuilder):
    NAME, MODULE = "cpu_adam", "shardspeed.ops.adam.cpu_adam"


class CPUAdagradBuilder(OpBuilder):
    NAME, MODULE = "cpu_adagrad", "shardspeed.ops.adagrad.cpu_adagrad"


class CPULionBuilder(OpBuilder):
    NAME, MODULE = "cpu_lion", "shardspeed.ops.lion.cpu_lion"


class FusedLionBuilder(OpBuilder):
    NAME, MODULE = "fused_lion", "shardspeed.ops.lion.fused_lion"


def _builders() -> Dict[str, Type[OpBuilder]]:
    return {cls.__name__: cls for cls in (FusedAdamBuilder, CPUAdamBuilder, CPUAdagradBuilder, CPULionBuilder,
                                          FusedLionBuilder)}


def builder_class(class_name: str) -> Optional[Type[OpBuilder]]:
    """The builder called ``class_name``, or None (what DeepSpeed's accelerators answer for an op they lack)."""
    return _builders().get(class_name)


ALL_OPS = {cls.NAME: cls() for cls in _builders().values()}

__getattr__ = module_getattr(__name__)
