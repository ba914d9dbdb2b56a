"""``save_16bit_model``: the model's weights in the training dtype, one file, written by rank 0.

Stages 0-2 hold full parameters on every rank. Stage 3 holds shards: the weights are gathered one unit at
a time when ``stage3_gather_16bit_weights_on_model_save`` is on; when it is off this raises instead of
writing DeepSpeed's silently empty file (use :func:`~shardspeed.checkpoint.consolidate` then).
"""
from __future__ import annotations

import io
import os
from typing import Dict

import torch

from ..errors import CheckpointError
from .engine_view import EngineView
from .format import write_bytes_atomic


def _gathered_state_dict(view: EngineView) -> Dict[str, torch.Tensor]:
    """name → CPU tensor (train dtype) on rank 0; {} on the others. Tied parameters under every name."""
    out: Dict[str, torch.Tensor] = {}
    sharded_units = view.zero_stage == 3
    for unit in view.units:
        if sharded_units and unit.layout.world > 1:
            full = torch.empty(unit.layout.padded_numel, dtype=unit.dtype, device=unit.device)
            view.comm.all_gather(full, unit.shard_on_device())
        else:
            full = unit.full
        if _collects(view):
            for i, prm in enumerate(unit.params):
                out[view.names[id(prm)]] = unit.param_view(full, i).view(unit.shapes[i]).detach().to("cpu", copy=True)
        del full
    if _collects(view):
        for name, t in view.other_params() + view.buffers():
            out[name] = t.detach().to("cpu", copy=True)
        for alias, target in view.aliases.items():
            out[alias] = out[target]
        out = _full_tensor_parallel(view, out)
    return out


def _full_tensor_parallel(view: EngineView, out: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
    """Tensor parallelism: the data rank 0 of every model rank holds slices; all-gather them over the
    model group (collective over those ranks) so that its rank 0 holds the full tensors."""
    from ..parallel.tp.comm import TPGroup
    from ..parallel.tp.gather import gather_full, tensor_parallel_slices

    slices = tensor_parallel_slices(view.module)
    if not slices:
        return out
    return gather_full(out, slices, TPGroup.of(view.comm.topology))


def _collects(view: EngineView) -> bool:
    """Data rank 0 of the first pipeline stage, on every model rank: it collects the (local) weights. (Under
    tensor parallelism ``view.rank`` is the global rank, since checkpoints are coordinated over the world.)"""
    return view.data_rank == 0 and view.comm.topology.pipe_rank == 0


def _writer(view: EngineView) -> bool:
    """The rank that returns and writes the full state: data rank 0 of model rank 0."""
    return _collects(view) and view.comm.topology.model_rank == 0


def gathered_state_dict(engine, exclude_frozen_parameters: bool = False, op: str = "_zero3_consolidated_16bit_state_dict"):
    """The module's full state dict (training dtype, CPU) on rank 0, None on the others; every rank calls it."""
    view = EngineView(engine, op)
    sd = _gathered_state_dict(view)
    if not _writer(view):
        return None
    if exclude_frozen_parameters:
        frozen = {n for n, prm in view.module.named_parameters(remove_duplicate=False) if not prm.requires_grad}
        sd = {k: v for k, v in sd.items() if k not in frozen}
    return sd


def save_16bit_model(engine, save_dir: str, save_filename: str = "pytorch_model.bin",
                     exclude_frozen_parameters: bool = False) -> bool:
    view = EngineView(engine, "save_16bit_model")
    if view.zero_stage == 3 and not view.parts.gather_16bit_weights_on_save:
        raise CheckpointError(
            "save_16bit_model at ZeRO stage 3 needs \"stage3_gather_16bit_weights_on_model_save\": true in "
            "zero_optimization (parameters are sharded; DeepSpeed would write an empty file here). Or export "
            "the fp32 weights from a checkpoint with shardspeed.checkpoint.consolidate / `shardspeed consolidate`."
        )
    sd = _gathered_state_dict(view)
    if exclude_frozen_parameters and _writer(view):
        frozen = {n for n, prm in view.module.named_parameters(remove_duplicate=False) if not prm.requires_grad}
        sd = {k: v for k, v in sd.items() if k not in frozen}
    err = None
    if _writer(view):
        try:
            os.makedirs(save_dir, exist_ok=True)
            path = os.path.join(save_dir, save_filename)
            if save_filename.endswith(".safetensors"):
                from safetensors.torch import save as st_save

                # safetensors refuses aliased tensors: tied names get their own copy
                seen, clean = set(), {}
                for k, v in sd.items():
                    clean[k] = v.clone() if id(v) in seen else v.contiguous()
                    seen.add(id(v))
                data = st_save(clean, metadata={"format": "pt"})
            else:
                buf = io.BytesIO()
                torch.save(sd, buf)
                data = buf.getvalue()
            write_bytes_atomic(path, data)
        except Exception as exc:
            err = f"could not write the 16-bit model to {save_dir}/{save_filename}: {type(exc).__name__}: {exc}"
    view.agree(err)
    return True
