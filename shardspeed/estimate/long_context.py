"""Activations per rank with sequence parallelism, tiling and activation offload (docs/long-context.md).

The formula of :mod:`.activations` for this rank's ``seq_len / sp`` tokens, with what sequence parallelism
changes: attention works on the gathered sequence (Ulysses: S tokens × H/P heads; ring: the gathered K/V
and one chunk-pair score block), ``mlp_tiles`` divides the MLP's recompute working set, ``loss_tiles``
divides the logits, and ``offload`` moves the checkpointed layer inputs to the host (``host_bytes``)."""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Tuple

from ..errors import ConfigError
from .activations import ActivationProfile, TransformerShape
from .model import ModelSpec
from .peak import PeakEstimate, estimate_peak


@dataclass(frozen=True)
class LongContextActivations:
    """Bytes per rank: ``device_peak`` (device memory at the peak of a micro-step, the larger of the two
    below), ``host_bytes`` (checkpointed inputs offloaded to host memory), ``layer_peak`` (device memory
    while a module's backward runs: a layer recomputed and differentiated, or the head with the logits'
    gradient) and ``loss_peak`` (while the loss and the logits' gradient are computed)."""

    device_peak: float
    host_bytes: float
    local_tokens: int
    layer_peak: float = 0.0
    loss_peak: float = 0.0


def long_context_activations(shape: TransformerShape, micro_batch: int, seq_len: int, elem_bytes: int, *,
                             sp: int = 1, attention: str = "ulysses", checkpointing: bool = True,
                             offload: bool = False, mlp_tiles: int = 1, loss_tiles: int = 1,
                             kv_heads: int = 0) -> LongContextActivations:
    """Activations of one micro-step on one of ``sp`` sequence ranks (see the module docstring)."""
    if attention not in ("ulysses", "ring"):
        raise ConfigError(f"attention must be 'ulysses' or 'ring', got {attention!r}")
    if attention == "ulysses" and shape.n_head % sp:
        raise ConfigError(f"sequence_parallel_size {sp} does not divide the {shape.n_head} heads (Ulysses)")
    unit = sp * (2 if attention == "ring" else 1)
    local = math.ceil(seq_len / unit) * unit // sp
    e, b, h = float(elem_bytes), micro_batch, shape.hidden
    sbh = float(local) * b * h
    kv = kv_heads or shape.n_head
    head_dim = h // shape.n_head
    ffn = float(local) * b * shape.ffn_hidden
    # one layer's working set in backward: norms, q/k/v/o, residuals (≈ 10·sbh), the MLP (3 × ffn wide)
    mlp = 3 * e * ffn / max(1, mlp_tiles)
    if attention == "ulysses":  # the all-to-all's gathered q, k, v and output of H/P heads over S tokens
        attn = 4 * e * float(local) * sp * b * (h / sp)
    else:  # gathered K and V (all ranks'), one query chunk against one key chunk of scores (fp32)
        chunk = local // 2
        attn = 2 * e * float(local) * sp * b * kv * head_dim + 4.0 * b * shape.n_head * chunk * chunk
    layer = 10 * e * sbh + mlp + attn
    sbv = float(local) * b * shape.vocab / max(1, loss_tiles)
    head = sbv * (e + 4 + 4) + 2 * e * sbh  # logits, fp32 log-softmax, their gradient; final norm
    head_grad = sbv * 4 + 2 * e * sbh  # the logits' gradient while the head's own backward runs
    saved = shape.n_layer * e * sbh if checkpointing else shape.n_layer * layer
    host = saved if (checkpointing and offload) else 0.0
    layer_peak = (saved - host) + max(layer if checkpointing else 0.0, head_grad)
    loss_peak = (saved - host) + head
    return LongContextActivations(device_peak=max(layer_peak, loss_peak), host_bytes=host, local_tokens=local,
                                  layer_peak=layer_peak, loss_peak=loss_peak)


def long_context_peak(spec: ModelSpec, config: Any, world_size: int, seq_len: int, elem_bytes: int, *,
                      sp: int = 1, attention: str = "ulysses", offload: bool = False, mlp_tiles: int = 1,
                      loss_tiles: int = 1, kv_heads: int = 0) -> Tuple[PeakEstimate, LongContextActivations]:
    """The per-rank peak of training ``spec`` on one ``seq_len``-token sample over ``sp`` sequence ranks
    (checkpointing every layer): :func:`long_context_activations` priced by
    :func:`~.peak.estimate_peak` with everything else the plan of ``config`` holds (model states sharded
    over data × sequence, stage 3's gathered units and gradient buckets). ``PeakEstimate.total`` is device
    plus host: the memory of a CPU-only machine."""
    if spec.shape is None:
        raise ConfigError(f"{spec.name}: no transformer shape (layers, hidden, heads, vocabulary) to price")
    act = long_context_activations(spec.shape, 1, seq_len, elem_bytes, sp=sp, attention=attention,
                                   checkpointing=True, offload=offload, mlp_tiles=mlp_tiles, loss_tiles=loss_tiles,
                                   kv_heads=kv_heads)
    live = act.device_peak + act.host_bytes
    # the model's own loss runs after the last unit's forward released it, and before any gradient: a phase
    # of its own. The tiled loss holds the head's unit gathered and makes its gradient in the forward, so
    # it is priced with the backward's units and buckets.
    split = loss_tiles == 1 and act.loss_peak > act.layer_peak
    profile = ActivationProfile(forward_bytes=live, peak_bytes=act.layer_peak + act.host_bytes if split else live,
                                micro_batch=1, seq_len=seq_len, checkpointing=True, source="fitted",
                                loss_bytes=act.loss_peak + act.host_bytes if split else 0.0)
    return estimate_peak(spec.with_activations(profile), config, world_size=world_size), act
