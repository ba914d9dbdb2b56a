"""Activation memory of one transformer layer (Korthikanti et al. 2022), with and without recompute.

Pure arithmetic, checked against saved-tensor counts of ``shardspeed.models.GPT`` in
tests/test_activation_checkpointing.py and against peak RSS in benchmarks/bench_activation.py.

Per layer, s = sequence, b = micro-batch, h = hidden, a = heads, values of ``value_bytes`` each and
dropout masks of one byte:
- no recompute: values 16·sbh (two LayerNorm inputs, the QKV input, Q and K, V, the projection input,
  the MLP input, GELU input and output: 4h each) + 2·a·s²·b (softmax output, attention dropout output)
  unless the attention is fused; masks 2·sbh (two residual dropouts) + a·s²·b (attention dropout, not
  fused) when dropout is on. 16-bit with dropout: the paper's s·b·h·(34 + 5·a·s/h).
- full recompute: the layer input, sbh values (the paper's 2·sbh in 16 bits).
- selective (shardspeed's policy): the input and every matmul / attention output: QKV 3·sbh, attention
  sbh, projection sbh, MLP 4·sbh + sbh, so 11·sbh values, + a·s²·b when the attention is not fused (its
  score matrix is a matmul output).
"""
from __future__ import annotations

RECOMPUTE = ("none", "full", "selective")


def activation_bytes_per_layer(seq: int, batch: int, hidden: int, heads: int, *, recompute: str = "none",
                               value_bytes: int = 2, fused_attention: bool = True, dropout: bool = True) -> int:
    """Bytes one layer keeps for backward (see the module doc)."""
    if recompute not in RECOMPUTE:
        raise ValueError(f"recompute {recompute!r}: use one of {RECOMPUTE}")
    sbh, as2b = seq * batch * hidden, heads * seq * seq * batch
    if recompute == "full":
        return value_bytes * sbh
    if recompute == "selective":
        return value_bytes * (11 * sbh + (0 if fused_attention else as2b))
    values = 16 * sbh + (0 if fused_attention else 2 * as2b)
    masks = (2 * sbh + (0 if fused_attention else as2b)) if dropout else 0
    return value_bytes * values + masks


def recompute_factor(seq: int, batch: int, hidden: int, heads: int, **kw) -> float:
    """How many times less a layer keeps with full recompute than without."""
    kw.pop("recompute", None)
    return (activation_bytes_per_layer(seq, batch, hidden, heads, recompute="none", **kw)
            / activation_bytes_per_layer(seq, batch, hidden, heads, recompute="full", **kw))
