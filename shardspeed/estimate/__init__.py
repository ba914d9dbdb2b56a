"""Memory estimation, in one place: per-rank peak memory of training a model with a config, and the ZeRO paper's
model-state arithmetic, predicted without allocating anything. Both price a :class:`shardspeed.plan.Plan`.

    from shardspeed.estimate import describe, estimate_peak
    spec = describe("gpt2-1.3b", cfg, micro_batch=4, seq_len=1024)      # meta device + a fake-tensor trace
    est = estimate_peak(spec, cfg, world_size=8)                        # prices decide(cfg, 8)
    est.device, est.host, est.terms                                     # bytes

``describe`` takes a GPT preset, ``pkg.module:function`` or a Hugging Face ``config.json``; ``describe_module``
any ``nn.Module`` (e.g. built on the meta device). ``estimate_model_state_memory`` / ``model_states``: parameters,
gradients and optimizer states only (``shardspeed.memory_estimate`` re-exports them). See docs/memory.md.

Modules, each importing only those above it: ``planning`` (config → plan), ``activations``, ``model``
(``ModelSpec``), ``states`` (model states of a plan), ``peak`` (``estimate_peak``), ``table`` and ``cli``.
"""
from .activations import (
    ActivationProfile,
    TransformerShape,
    formula_activations,
    layer_saved_bytes,
    trace_activations,
)
from .model import ModelSpec, describe, describe_factory, describe_gpt, describe_hf_config, describe_module
from .peak import PeakEstimate, estimate_peak, paper_table
from .planning import OPTIMIZER_STATE_BYTES, plan_for
from .states import ModelStateMemory, estimate_model_state_memory, model_states

__all__ = [
    "ActivationProfile", "ModelSpec", "ModelStateMemory", "OPTIMIZER_STATE_BYTES", "PeakEstimate",
    "TransformerShape", "describe", "describe_factory", "describe_gpt", "describe_hf_config", "describe_module",
    "estimate_model_state_memory", "estimate_peak", "formula_activations", "layer_saved_bytes", "model_states",
    "paper_table", "plan_for", "trace_activations",
]
