"""Activation memory of one training micro-step: a formula (Korthikanti et al. 2022) and a traced measurement.

Formula (per transformer layer, s = sequence, b = micro-batch, h = hidden, a = heads, t = tensor-parallel
degree, e = bytes per activation element: 2 for bf16/fp16, 4 for fp32; masks are 1 byte):

- saved for backward, per layer: layer-norm inputs 2·e·sbh, QKV input e·sbh, Q, K, V 3·e·sbh, attention
  output (the projection's input) e·sbh, MLP input e·sbh, GeLU input and output (4h wide) 8·e·sbh; with
  dropout two 1-byte masks 2·sbh (residual dropouts). At e = 2 with dropout this is Korthikanti's 34·sbh.
- unfused attention adds the a·s² terms: the softmax output e·as²b, and with dropout its mask as²b and the
  dropped copy e·as²b (Korthikanti's 5·as²b at e = 2); fused attention (SDPA/flash) saves only an a·s·b
  log-sum-exp in fp32.
- tensor parallelism (Megatron): the layer-norm, QKV-input, MLP-input and mask terms stay whole, the rest is
  divided by t; with sequence parallelism everything is divided by t.
- full recomputation (checkpointing each layer): e·sbh per layer (its input) plus, at the peak, one layer's
  full set being recomputed.
- the head: the logits e·sbV and, for the loss, their fp32 log-softmax 4·sbV; in backward the gradient of the
  logits (same size) is the working set.

Traced: :func:`trace_activations` runs one forward and backward of the real model on fake tensors
(``torch._subclasses.fake_tensor.FakeTensorMode``: shapes, dtypes and aliasing, no memory and no compute) under
a dispatch mode that adds each new storage's bytes when an operator returns it and subtracts them when the
storage dies. The parameters' storages are excluded, and parameter gradients are dropped as the engine's
reducer drops them (it copies each into its bucket, counted apart). What is live at the end of the forward
(everything autograd saved, plus the loss) and the peak over forward and backward are exact for that model,
dtype and shape, including what the formulas leave out (which attention kernel runs, copies, masks).
"""
from __future__ import annotations

import math
import weakref
from dataclasses import dataclass
from typing import Any, Callable, Dict, Optional

import torch
import torch.nn as nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from ..errors import ConfigError


@dataclass(frozen=True)
class TransformerShape:
    """What the activation formulas need: layers, width, heads, vocabulary, MLP width, positions."""

    n_layer: int
    hidden: int
    n_head: int
    vocab: int
    ffn_hidden: int
    max_seq: int
    dropout: bool = False
    fused_attention: bool = True


@dataclass(frozen=True)
class ActivationProfile:
    """Activation bytes of one micro-step at ``micro_batch`` × ``seq_len``: ``forward_bytes`` live when the
    forward ends (saved for backward), ``peak_bytes`` the most live at any point of forward and backward.
    ``source``: "traced", "formula", or "fitted" (given by the caller, e.g. the autotuner's zero profile that
    leaves the activations out: used as it is at any tensor/pipeline degree and sequence length).
    ``loss_bytes``: where the loss's own working set is the larger (long sequences, a large vocabulary, the
    model's plain loss), the most live while the loss and the logits' gradient are computed: before any
    parameter's gradient exists and with no stage-3 unit gathered but the persistent ones, so it is priced
    as a phase of its own (``estimate_peak``'s "loss"); 0: the loss's peak is within ``peak_bytes``."""

    forward_bytes: float
    peak_bytes: float
    micro_batch: int
    seq_len: int
    checkpointing: bool
    source: str = "traced"
    loss_bytes: float = 0.0

    def scaled_to(self, micro_batch: int) -> ActivationProfile:
        """The same shape at another micro-batch (activations are linear in it)."""
        f = micro_batch / self.micro_batch
        return ActivationProfile(self.forward_bytes * f, self.peak_bytes * f, micro_batch, self.seq_len,
                                 self.checkpointing, self.source, self.loss_bytes * f)


def layer_saved_bytes(shape: TransformerShape, micro_batch: int, seq_len: int, elem_bytes: int, tp: int = 1,
                      sequence_parallel: bool = False) -> float:
    """Bytes one transformer layer saves for backward (the Korthikanti terms above, generalised)."""
    sbh = float(seq_len) * micro_batch * shape.hidden
    e, t = float(elem_bytes), float(tp)
    ffn_ratio = shape.ffn_hidden / shape.hidden
    masks = 2.0 if shape.dropout else 0.0
    whole = sbh * (2 * e + e + e + masks)  # layer-norm inputs, QKV input, MLP input, dropout masks
    split = sbh * (3 * e + e + 2 * ffn_ratio * e)  # Q, K, V, attention output, GeLU input and output
    a_s2b = float(shape.n_head) * seq_len * seq_len * micro_batch
    if shape.fused_attention:
        attn = 4.0 * shape.n_head * seq_len * micro_batch  # fp32 log-sum-exp
    else:
        attn = a_s2b * (e + ((1 + e) if shape.dropout else 0.0))
    if sequence_parallel:
        return (whole + split + attn) / t
    return whole + split / t + attn / t


def formula_activations(shape: TransformerShape, micro_batch: int, seq_len: int, elem_bytes: int, *,
                        checkpointing: bool = False, tp: int = 1, pp: int = 1, in_flight: int = 1,
                        sequence_parallel: bool = False) -> ActivationProfile:
    """Activations of the layers one pipeline stage holds (``ceil(n_layer / pp)``) for ``in_flight``
    micro-batches (1F1B: up to ``pp`` on the first stage), plus the head (logits and loss) on one micro-batch."""
    if seq_len > shape.max_seq:
        raise ConfigError(f"sequence length {seq_len} exceeds the model's {shape.max_seq} positions")
    layers = math.ceil(shape.n_layer / pp)
    per_layer = layer_saved_bytes(shape, micro_batch, seq_len, elem_bytes, tp, sequence_parallel)
    sbh = float(seq_len) * micro_batch * shape.hidden
    sbv = float(seq_len) * micro_batch * shape.vocab / (tp if tp > 1 else 1)
    head_fwd = sbv * (elem_bytes + 4) + 2 * elem_bytes * sbh  # logits, fp32 log-softmax, final norm in/out
    head_bwd = sbv * 4  # gradient of the logits
    if checkpointing:
        saved = layers * in_flight * elem_bytes * sbh
        fwd = saved + head_fwd
        peak = saved + max(head_fwd + head_bwd, per_layer + 3 * elem_bytes * sbh)
    else:
        fwd = layers * in_flight * per_layer + head_fwd
        peak = fwd + head_bwd
    return ActivationProfile(fwd, peak, micro_batch, seq_len, checkpointing, source="formula")


class _LiveBytes(TorchDispatchMode):
    """Adds a storage's bytes when an operator first returns it, subtracts them when it is collected."""

    def __init__(self, exclude: set):
        super().__init__()
        self.live = 0
        self.peak = 0
        self._seen: Dict[int, int] = {}
        self._exclude = exclude

    def _track(self, t: torch.Tensor) -> None:
        st = t.untyped_storage()
        key = st._cdata
        if key in self._seen or key in self._exclude:
            return
        n = st.nbytes()
        self._seen[key] = n
        self.live += n
        self.peak = max(self.peak, self.live)
        weakref.finalize(st, self._free, key, n)

    def _free(self, key: int, n: int) -> None:
        if self._seen.pop(key, None) is not None:
            self.live -= n

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                self._track(t)
        return out


def _loss_of(out: Any) -> torch.Tensor:
    if torch.is_tensor(out):
        return out if out.dim() == 0 else out.float().mean()
    loss = getattr(out, "loss", None)
    if loss is None and isinstance(out, dict):
        loss = out.get("loss")
    if loss is None and isinstance(out, (tuple, list)) and out:
        loss = out[0]
    if not torch.is_tensor(loss):
        raise ConfigError("cannot trace activations: the model's output has no loss tensor; give a model whose "
                          "forward returns the loss (or a .loss) for the traced inputs")
    return loss


def trace_activations(build: Callable[[], nn.Module], batch: Callable[[int], Any], micro_batch: int, *,
                      seq_len: int, dtype: torch.dtype = torch.float32, checkpointing: bool = False,
                      autocast: Optional[torch.dtype] = None) -> ActivationProfile:
    """Activation bytes of one training micro-step of ``build()`` on ``batch(micro_batch)`` (a tuple of
    positional inputs or a dict of keyword inputs), traced on fake tensors: no real memory, no compute.

    ``dtype``: the training dtype (the model is cast to it, as the engine does). ``checkpointing`` wraps each
    transformer block first (:func:`shardspeed.checkpointing.checkpoint_blocks`, full recompute). ``autocast``:
    the forward runs under ``torch.autocast`` in that dtype (``torch_autocast``), as the engine runs it: the
    low-precision copies of the weights autograd saves for backward (2 bytes per Linear element) and the casts
    of the activations are counted with the rest."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from ..checkpointing import checkpoint_blocks

    with FakeTensorMode(allow_non_fake_inputs=True):
        with torch.device("cpu"):
            model = build()
        for t in list(model.parameters()) + list(model.buffers()):
            if t.is_floating_point() and t.dtype != dtype:
                t.data = t.data.to(dtype)  # as the engine casts (module.to swaps tensors, which fake mode refuses)
        model.train()
        if checkpointing:
            checkpoint_blocks(model, policy="full")
        exclude = {p.untyped_storage()._cdata for p in model.parameters()}
        exclude |= {b.untyped_storage()._cdata for b in model.buffers()}
        hooks = [p.register_post_accumulate_grad_hook(_drop_grad) for p in model.parameters() if p.requires_grad]
        inputs = batch(micro_batch)
        with _LiveBytes(exclude) as live:
            with torch.autocast("cpu", dtype=autocast or torch.bfloat16, enabled=autocast is not None):
                out = model(**inputs) if isinstance(inputs, dict) else model(*inputs)
            loss = _loss_of(out)
            del out
            forward = live.live
            loss.backward()
        peak = live.peak
        for h in hooks:
            h.remove()
    return ActivationProfile(float(forward), float(peak), micro_batch, seq_len, checkpointing)


def _drop_grad(p: torch.Tensor) -> None:
    p.grad = None  # the engine's reducer copies each gradient into its bucket and drops it
