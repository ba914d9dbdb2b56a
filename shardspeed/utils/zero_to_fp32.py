"""``deepspeed.utils.zero_to_fp32``: a ZeRO checkpoint as one fp32 state dict, for shardspeed's checkpoints and
DeepSpeed's alike (ZeRO 0-3 and the universal layout), read one tensor at a time through
:func:`shardspeed.checkpoint.consolidate.fp32_state_dict`. ``checkpoint_dir`` is the save directory (the one
holding ``latest`` and the tag folders), as in DeepSpeed."""
from __future__ import annotations

import os
from typing import Dict, List, Optional, Union

import torch
import torch.nn as nn

from ..checkpoint.consolidate import fp32_state_dict, parse_size
from ..compat.alias import module_getattr, not_provided


def get_fp32_state_dict_from_zero_checkpoint(checkpoint_dir: str, tag: Optional[str] = None,
                                             exclude_frozen_parameters: bool = False,
                                             lazy_mode: bool = False) -> Dict[str, torch.Tensor]:
    """The model's state dict, floating-point tensors in fp32 (trained parameters from their master copy),
    buffers included, tied names sharing one tensor."""
    if lazy_mode:
        raise not_provided("deepspeed.utils.zero_to_fp32.get_fp32_state_dict_from_zero_checkpoint(lazy_mode=True)")
    return fp32_state_dict(checkpoint_dir, tag, exclude_frozen_parameters)


def _shards(state: Dict[str, torch.Tensor], limit: int) -> List[List[str]]:
    shards: List[List[str]] = [[]]
    size = 0
    for name, t in state.items():
        n = t.numel() * t.element_size()
        if shards[-1] and size + n > limit:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += n
    return shards


def convert_zero_checkpoint_to_fp32_state_dict(checkpoint_dir: str, output_dir: str,
                                               max_shard_size: Union[int, str, None] = "5GB",
                                               safe_serialization: bool = False, tag: Optional[str] = None,
                                               exclude_frozen_parameters: bool = False) -> None:
    """Write the fp32 state dict into ``output_dir`` as DeepSpeed does: ``pytorch_model.bin`` (or
    ``model.safetensors`` with ``safe_serialization``), split above ``max_shard_size`` into
    ``pytorch_model-0000i-of-0000n.bin`` files with a ``pytorch_model.bin.index.json``."""
    import json

    state = fp32_state_dict(checkpoint_dir, tag, exclude_frozen_parameters)
    base = "model.safetensors" if safe_serialization else "pytorch_model.bin"
    shards = _shards(state, parse_size(max_shard_size) if max_shard_size is not None else 1 << 62)
    stem, ext = os.path.splitext(base)
    names = [base] if len(shards) == 1 else [f"{stem}-{i + 1:05d}-of-{len(shards):05d}{ext}" for i in range(len(shards))]
    os.makedirs(output_dir, exist_ok=True)
    for fname, keys in zip(names, shards):
        part = {k: state[k].contiguous() for k in keys}
        if safe_serialization:
            from safetensors.torch import save_file

            save_file({k: v.clone() for k, v in part.items()}, os.path.join(output_dir, fname), metadata={"format": "pt"})
        else:
            torch.save(part, os.path.join(output_dir, fname))
    if len(shards) > 1:
        total = sum(t.numel() * t.element_size() for t in state.values())
        index = {"metadata": {"total_size": total}, "weight_map": {k: f for f, ks in zip(names, shards) for k in ks}}
        with open(os.path.join(output_dir, base + ".index.json"), "w", encoding="utf-8") as f:
            f.write(json.dumps(index, indent=2, sort_keys=True) + "\n")


def load_state_dict_from_zero_checkpoint(model: nn.Module, checkpoint_dir: str, tag: Optional[str] = None) -> nn.Module:
    """Load the checkpoint's fp32 weights into ``model`` (moved to the CPU, as DeepSpeed's does; non-strict)
    and return it. Not for a model inside a live engine: build a fresh one."""
    state = fp32_state_dict(checkpoint_dir, tag)
    model = model.cpu()
    model.load_state_dict(state, strict=False)
    return model


__getattr__ = module_getattr(__name__)
