"""A model described by numbers only (no weights): what the estimator needs to know about it.

A :class:`ModelSpec` holds the trainable parameter sizes in registration order (stages 0-2 group them into
gradient buckets of ``reduce_bucket_size``), the stage-3 units that :func:`shardspeed.zero.stage3_units.select_units`
would choose, the transformer shape when there is one (for the activation formulas) and, optionally, an
:class:`~.activations.ActivationProfile` measured by tracing one step on fake tensors.

Every ``describe_*`` function builds the model on the ``meta`` device (shapes only, no memory).
"""
from __future__ import annotations

import dataclasses
import importlib
import json
import os
from dataclasses import dataclass
from typing import Any, Callable, Optional, Tuple

import torch
import torch.nn as nn

from ..errors import ConfigError
from ..optim.muon import use_muon
from .activations import ActivationProfile, TransformerShape, trace_activations
from .planning import autocast_dtype, prefetch_bucket, train_dtype


@dataclass(frozen=True)
class ModelSpec:
    """A model's sizes. ``param_numels``: trainable parameters (tied ones once) in registration order;
    ``stage3_units``: elements of each stage-3 unit for the ``prefetch_bucket_size`` it was described with;
    ``activations``: a traced profile for one micro-batch shape, or None (the formulas of ``shape`` are used)."""

    name: str
    param_numels: Tuple[int, ...]
    stage3_units: Tuple[int, ...]
    shape: Optional[TransformerShape] = None
    activations: Optional[ActivationProfile] = None
    #: elements ``optimizer.type: "Muon"`` steps with Muon (DeepSpeed's routing; the rest go to its AdamW)
    muon_numel: Optional[int] = None

    @property
    def num_params(self) -> int:
        return sum(self.param_numels)

    def with_activations(self, profile: Optional[ActivationProfile]) -> ModelSpec:
        return dataclasses.replace(self, activations=profile)


def describe_module(model: nn.Module, config: Any = None, name: str = "", shape: Optional[TransformerShape] = None
                    ) -> ModelSpec:
    """Sizes of ``model`` (any device, ``meta`` included); stage-3 units as the engine would choose them for
    ``config`` (a DeepSpeed-style dict, a path or a ShardspeedConfig; default: DeepSpeed's defaults): units are
    bounded by the plan's stage-3 prefetch bucket."""
    from ..zero.stage3_units import param_numel as _numel, select_units, unit_max_numel

    params = [p for p in dict.fromkeys(model.parameters()) if p.requires_grad]
    if not params:
        raise ConfigError(f"model {name or type(model).__name__} has no trainable parameters to estimate")
    total = sum(_numel(p) for p in params)
    units = select_units(model, unit_max_numel(total, prefetch_bucket(config)))
    # units in forward order: select_units walks the tree top-down, the root's own unit last
    sizes = tuple(sum(_numel(p) for p in ps if p.requires_grad) for _, ps in units)
    muon = sum(_numel(p) for n, p in model.named_parameters() if p.requires_grad and use_muon(n, p))
    return ModelSpec(name or type(model).__name__, tuple(_numel(p) for p in params),
                     tuple(s for s in sizes if s), shape, muon_numel=muon)


def describe_gpt(cfg, config: Any = None, *, micro_batch: Optional[int] = None, seq_len: Optional[int] = None,
                 checkpointing: bool = False, dtype: Optional[torch.dtype] = None, trace: bool = True) -> ModelSpec:
    """A ``shardspeed.models.GPT`` of ``cfg`` (a GPTConfig). With ``micro_batch`` and ``trace``, activations are
    calibrated by one traced step on fake tensors at ``seq_len`` (default ``cfg.block_size``)."""
    from ..models import GPT

    with torch.device("meta"):
        model = GPT(cfg)
    shape = TransformerShape(n_layer=cfg.n_layer, hidden=cfg.n_embd, n_head=cfg.n_head, vocab=cfg.vocab_size,
                             ffn_hidden=4 * cfg.n_embd, max_seq=cfg.block_size, dropout=cfg.dropout > 0,
                             fused_attention=True)
    spec = describe_module(model, config, name=f"GPT(n_layer={cfg.n_layer}, n_embd={cfg.n_embd})", shape=shape)
    if micro_batch and trace:
        spec = _with_traced_tokens(spec, lambda: GPT(cfg), micro_batch, seq_len or cfg.block_size, checkpointing,
                                   dtype or train_dtype(config), autocast_dtype(config))
    return spec


def describe_hf_config(path: str, config: Any = None, *, micro_batch: Optional[int] = None,
                       seq_len: Optional[int] = None, checkpointing: bool = False,
                       dtype: Optional[torch.dtype] = None, trace: bool = True) -> ModelSpec:
    """A Hugging Face causal LM from its ``config.json`` (a file or a directory holding one), built on the meta
    device with ``AutoModelForCausalLM.from_config``; needs ``transformers``."""
    if not os.path.exists(path):
        raise ConfigError(f"Hugging Face config {path!r} does not exist; give a config.json or its directory")
    try:
        from transformers import AutoConfig, AutoModelForCausalLM
    except ImportError:
        raise ConfigError("--hf-config needs the transformers package: pip install transformers") from None
    hf = AutoConfig.from_pretrained(path)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(hf)
    n_layer = int(getattr(hf, "num_hidden_layers", 0) or getattr(hf, "n_layer", 0))
    hidden = int(getattr(hf, "hidden_size", 0) or getattr(hf, "n_embd", 0))
    heads = int(getattr(hf, "num_attention_heads", 0) or getattr(hf, "n_head", 0))
    ffn = int(getattr(hf, "intermediate_size", 0) or getattr(hf, "n_inner", 0) or 4 * hidden)
    max_seq = int(getattr(hf, "max_position_embeddings", 0) or getattr(hf, "n_positions", 0) or 2048)
    shape = None
    if n_layer and hidden and heads:
        shape = TransformerShape(n_layer=n_layer, hidden=hidden, n_head=heads, vocab=int(hf.vocab_size),
                                 ffn_hidden=ffn, max_seq=max_seq, dropout=False, fused_attention=True)
    spec = describe_module(model, config, name=f"{type(model).__name__} ({os.path.basename(path)})", shape=shape)
    if micro_batch and trace:
        s = seq_len or min(max_seq, 2048)

        def batch(b: int):
            x = torch.zeros(b, s, dtype=torch.long)
            return {"input_ids": x, "labels": x}

        spec = spec.with_activations(trace_activations(lambda: AutoModelForCausalLM.from_config(hf), batch,
                                                       micro_batch, seq_len=s, checkpointing=checkpointing,
                                                       dtype=dtype or train_dtype(config),
                                                       autocast=autocast_dtype(config)))
    return spec


def load_factory(target: str) -> Callable[[], nn.Module]:
    """``"pkg.mod:fn"`` → the callable ``fn`` (it must build and return an ``nn.Module``)."""
    mod_name, sep, attr = target.partition(":")
    if not sep or not mod_name or not attr:
        raise ConfigError(f"model factory {target!r} must look like pkg.module:function")
    try:
        obj: Any = importlib.import_module(mod_name)
    except ImportError as e:
        raise ConfigError(f"cannot import {mod_name!r} for --model {target}: {e}") from None
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise ConfigError(f"{mod_name} has no attribute {attr!r} (from --model {target})")
        obj = getattr(obj, part)
    if not callable(obj):
        raise ConfigError(f"--model {target}: {attr} is not callable")
    return obj


def describe_factory(target: str, config: Any = None, *, micro_batch: Optional[int] = None,
                     seq_len: Optional[int] = None, checkpointing: bool = False,
                     dtype: Optional[torch.dtype] = None, trace: bool = True) -> ModelSpec:
    """A model built by ``pkg.mod:fn()`` on the meta device. Activations are traced only when the model has a
    ``config`` with ``vocab_size`` (token ids ``(micro_batch, seq_len)`` are fed as ``model(x, x)``)."""
    fn = load_factory(target)
    with torch.device("meta"):
        model = fn()
    if not isinstance(model, nn.Module):
        raise ConfigError(f"--model {target} returned {type(model).__name__}, not a torch.nn.Module")
    cfg = getattr(model, "config", None)
    shape = _shape_of(cfg)
    spec = describe_module(model, config, name=target, shape=shape)
    if micro_batch and trace and shape is not None:
        spec = _with_traced_tokens(spec, fn, micro_batch, seq_len or shape.max_seq, checkpointing,
                                   dtype or train_dtype(config), autocast_dtype(config))
    return spec


def _with_traced_tokens(spec: ModelSpec, build: Callable[[], nn.Module], micro_batch: int, seq_len: int,
                        checkpointing: bool, dtype: torch.dtype, autocast: Optional[torch.dtype] = None) -> ModelSpec:
    """``spec`` with activations traced on a batch of token ids ``(x, x)`` (inputs and labels) of ``seq_len``,
    the forward under ``torch.autocast`` in ``autocast`` (None: none)."""

    def batch(b: int):
        x = torch.zeros(b, seq_len, dtype=torch.long)
        return (x, x)

    return spec.with_activations(trace_activations(build, batch, micro_batch, seq_len=seq_len,
                                                   checkpointing=checkpointing, dtype=dtype, autocast=autocast))


def _shape_of(cfg: Any) -> Optional[TransformerShape]:
    """The transformer shape of a GPTConfig-like object (n_layer, n_embd, n_head, vocab_size, block_size)."""
    names = ("n_layer", "n_embd", "n_head", "vocab_size", "block_size")
    if cfg is None or not all(hasattr(cfg, n) for n in names):
        return None
    return TransformerShape(n_layer=cfg.n_layer, hidden=cfg.n_embd, n_head=cfg.n_head, vocab=cfg.vocab_size,
                            ffn_hidden=4 * cfg.n_embd, max_seq=cfg.block_size,
                            dropout=float(getattr(cfg, "dropout", 0.0)) > 0, fused_attention=True)


def describe(source: str, config: Any = None, **kwargs) -> ModelSpec:
    """One entry point: a GPT preset name, ``pkg.mod:fn``, or a path to a Hugging Face ``config.json``."""
    from ..models import PRESETS, GPTConfig

    if source in PRESETS:
        return describe_gpt(GPTConfig.preset(source), config, **kwargs)
    if ":" in source:
        return describe_factory(source, config, **kwargs)
    if source.endswith(".json") or os.path.isdir(source):
        return describe_hf_config(source, config, **kwargs)
    raise ConfigError(f"model {source!r}: not a GPT preset ({', '.join(PRESETS)}), a factory pkg.module:function, "
                      f"or a Hugging Face config.json")


def read_json_config(path: str) -> dict:
    """A DeepSpeed/shardspeed JSON config file, with a one-line error when it cannot be read."""
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise ConfigError(f"cannot read config {path!r}: {e}") from None
