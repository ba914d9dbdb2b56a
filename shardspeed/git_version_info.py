"""``deepspeed.git_version_info``: what DeepSpeed records at install time, answered for shardspeed's package.

``version`` is the DeepSpeed version the package answers (``importlib.metadata.version("deepspeed")``); no op
is compiled (``installed_ops`` is empty: shardspeed builds none); in ``torch_info``, ``"0.0"`` is DeepSpeed's own
"not recorded, detect at run time" value, used here for NCCL (reading it would initialise CUDA).
"""
from __future__ import annotations

import torch

from .compat.alias import DEEPSPEED_VERSION, module_getattr


def _major_minor(text: object) -> str:
    parts = str(text or "").split("+")[0].split(".")
    return ".".join(parts[:2]) if len(parts) >= 2 and all(p.isdigit() for p in parts[:2]) else "0.0"


version = DEEPSPEED_VERSION
git_hash = "[none]"
git_branch = "[none]"
installed_ops: dict = {}
compatible_ops: dict = {}
torch_info = {"version": _major_minor(torch.__version__), "bf16_support": False,
              "cuda_version": _major_minor(torch.version.cuda), "nccl_version": "0.0",
              "hip_version": _major_minor(getattr(torch.version, "hip", None))}

__getattr__ = module_getattr(__name__)
