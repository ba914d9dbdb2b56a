"""``deepspeed.accelerator.real_accelerator``: :func:`get_accelerator` picks the accelerator once per process.

``DS_ACCELERATOR`` (``cpu`` or ``cuda``) decides, as in DeepSpeed; otherwise CUDA when torch sees a GPU, else
CPU. Choosing asks ``torch.cuda.is_available()`` only, which does not initialise CUDA.
"""
from __future__ import annotations

import functools
import os

import torch

from ..compat.alias import module_getattr
from ..errors import ConfigError
from .abstract_accelerator import DeepSpeedAccelerator
from .cpu_accelerator import CPU_Accelerator
from .cuda_accelerator import CUDA_Accelerator

SUPPORTED_ACCELERATOR_LIST = ["cuda", "cpu"]


@functools.cache
def _accelerator(name: str) -> DeepSpeedAccelerator:
    return CUDA_Accelerator() if name == "cuda" else CPU_Accelerator()


def _chosen_name() -> str:
    name = os.environ.get("DS_ACCELERATOR")
    if name is None:
        return "cuda" if torch.cuda.is_available() else "cpu"
    if name not in SUPPORTED_ACCELERATOR_LIST:
        raise ConfigError(f"DS_ACCELERATOR={name!r}: shardspeed supports {SUPPORTED_ACCELERATOR_LIST}; "
                          "set one of them or unset it")
    return name


def get_accelerator() -> DeepSpeedAccelerator:
    """The process's accelerator (the same object on every call for the same ``DS_ACCELERATOR``)."""
    return _accelerator(_chosen_name())


def is_current_accelerator_supported() -> bool:
    return get_accelerator()._name in SUPPORTED_ACCELERATOR_LIST


__getattr__ = module_getattr(__name__)
