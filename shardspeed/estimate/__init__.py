"""Per-rank peak memory of training a model with a config, predicted without allocating it.

    from shardspeed.estimate import describe, estimate_peak
    spec = describe("gpt2-1.3b", cfg, micro_batch=4, seq_len=1024)      # meta device + a fake-tensor trace
    est = estimate_peak(spec, cfg, world_size=8)
    est.device, est.host, est.terms                                     # bytes

``describe`` takes a GPT preset, ``pkg.module:function`` or a Hugging Face ``config.json``; ``describe_module``
any ``nn.Module`` (e.g. built on the meta device). See docs/memory.md.
"""
from .activations import (
    ActivationProfile,
    TransformerShape,
    formula_activations,
    layer_saved_bytes,
    trace_activations,
)
from .model import ModelSpec, describe, describe_factory, describe_gpt, describe_hf_config, describe_module
from .peak import OPTIMIZER_STATE_BYTES, PeakEstimate, estimate_peak, paper_table

__all__ = [
    "ActivationProfile", "ModelSpec", "OPTIMIZER_STATE_BYTES", "PeakEstimate", "TransformerShape",
    "describe", "describe_factory", "describe_gpt", "describe_hf_config", "describe_module",
    "estimate_peak", "formula_activations", "layer_saved_bytes", "paper_table", "trace_activations",
]
