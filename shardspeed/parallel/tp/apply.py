"""Apply an AutoTP plan to a model: replace matched layers by tensor-parallel ones holding this rank's slice.

The model must hold the same full weights on every rank of the model group (the builder broadcasts them
first). Parameter names and the module tree are unchanged (each replaced module keeps its name and its
``weight``/``bias``), so state dicts, ZeRO units and checkpoints see the same names at any TP degree.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Tuple

import torch
import torch.nn as nn

from ...errors import ConfigError
from .comm import TPGroup
from .layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    SharedInput,
    VocabParallelEmbedding,
    gather_output_along_sequence,
    mark_sequence_parallel_grad,
    scatter_output_along_sequence,
    sliced_parameter,
)
from .loss import mean_cross_entropy
from .plan import PRESETS, Rule, match, preset_name, rules_from_partition_config
from .rng import ForkedDropout, TPRNGTracker
from .slicing import check_divisible, make_slice, take

logger = logging.getLogger("shardspeed")


class VocabParallelHead(ColumnParallelLinear):
    """The LM head split by vocabulary. ``head(x)`` returns the gathered logits (any model's loss works on
    them); ``head(x, targets)`` returns the mean cross entropy without gathering them
    (``shardspeed.models.GPT`` calls it so when its head has ``vocab_parallel``). Both go through the
    module's call, so ZeRO-3's hooks gather the weight."""

    vocab_parallel = True

    def forward(self, x: torch.Tensor, targets: Optional[torch.Tensor] = None,
                ignore_index: int = -100) -> torch.Tensor:
        if targets is None:
            return super().forward(x)
        logits = self._matmul(self.parallel_input(x), self.bias)
        return mean_cross_entropy(logits, targets, self.group, ignore_index)


@dataclass
class TPReport:
    """What :func:`apply_tensor_parallel` did: per rule ``(source, pattern, kind, count)``, and the names."""

    preset: Optional[str]
    rules: List[Tuple[str, str, str, int]] = field(default_factory=list)
    sharded: List[str] = field(default_factory=list)
    tracker: Optional[TPRNGTracker] = None
    sequence_parallel: bool = False
    #: id of each replaced full parameter -> the slice parameter that took its place
    replaced: Dict[int, nn.Parameter] = field(default_factory=dict)


def _is_conv1d(m: nn.Module) -> bool:
    return type(m).__name__ == "Conv1D" and hasattr(m, "nf") and getattr(m, "weight", None) is not None


def _kind_ok(name: str, module: nn.Module, rule: Rule) -> bool:
    linear = isinstance(module, nn.Linear) or _is_conv1d(module)
    if rule.kind == "skip":
        return False
    if rule.kind == "embedding":
        return isinstance(module, nn.Embedding)
    if not linear:
        if rule.source == "partition_config" and isinstance(module, nn.Embedding):
            raise ConfigError(f"partition_config pattern {rule.pattern!r} matched the embedding '{name}'; "
                              f"layer_specs split Linear/Conv1D layers (embeddings are split by vocabulary by "
                              f"the presets); use a pattern that matches only linear layers")
        return False
    return True


class _Converter:
    def __init__(self, model: nn.Module, group: TPGroup, sequence_parallel: bool, tracker: TPRNGTracker):
        self.model, self.group, self.sp, self.tracker = model, group, sequence_parallel, tracker
        self.tied: Dict[int, nn.Parameter] = {}
        names: Dict[int, List[str]] = {}
        for n, p in model.named_parameters(remove_duplicate=False):
            names.setdefault(id(p), []).append(n)
        self.shared = {k: v for k, v in names.items() if len(v) > 1}  # tied parameters: every name

    def _param(self, name: str, full: nn.Parameter, dim: int, blocks: int) -> nn.Parameter:
        if id(full) in self.tied:
            return self.tied[id(full)]
        if id(full) in self.shared and not (dim == 0 and blocks == 1):
            raise ConfigError(f"layer '{name}': its weight is tied to {self.shared[id(full)]} and cannot be split "
                              f"along dimension {dim}; skip the tied layers or split them alike")
        sl = make_slice(name, tuple(full.shape), dim, blocks, self.group.rank, self.group.size)
        p = sliced_parameter(take(full.detach(), sl), sl, full.requires_grad)
        self.tied[id(full)] = p
        return p

    def convert(self, name: str, module: Any, rule: Rule, parent: nn.Module) -> nn.Module:
        g = self.group
        if rule.kind == "embedding":
            check_divisible(name, "the vocabulary size", module.weight.shape[0], g.size)
            if module.max_norm is not None or module.sparse:
                raise ConfigError(f"embedding '{name}': max_norm/sparse are not supported with tensor parallelism; "
                                  f"leave it replicated with a partition_config 'skip' spec")
            return VocabParallelEmbedding(self._param(name, module.weight, 0, 1), g, sequence_parallel=self.sp,
                                          padding_idx=module.padding_idx)
        conv = _is_conv1d(module)
        out_dim, in_dim = (1, 0) if conv else (0, 1)
        if rule.kind in ("column", "qkv", "head"):
            self._check_heads(name, module, parent, rule, out_dim)
            if rule.kind == "head":
                check_divisible(name, "the vocabulary size (output features)", module.weight.shape[out_dim], g.size)
            weight = self._param(name, module.weight, out_dim, rule.blocks)
            bias = None if module.bias is None else self._param(name + ".bias", module.bias, 0, rule.blocks)
            if rule.kind == "head":
                # shardspeed.models.GPT keeps the sequence split up to its head; other models end it at the norm
                return VocabParallelHead(weight, bias, g, transposed=conv, gather_output=True,
                                         sequence_parallel=self.sp)
            return ColumnParallelLinear(weight, bias, g, transposed=conv, gather_output=rule.gather_output,
                                        sequence_parallel=self.sp)
        weight = self._param(name, module.weight, in_dim, 1)
        row = RowParallelLinear(weight, module.bias, g, transposed=conv, sequence_parallel=self.sp)
        if self.sp and module.bias is not None:
            mark_sequence_parallel_grad(module.bias, g)
        return row

    def _check_heads(self, name: str, module: Any, parent: nn.Module, rule: Rule, out_dim: int) -> None:
        size = self.group.size
        if rule.kind == "qkv":
            heads = getattr(parent, "n_head", None) or getattr(parent, "num_heads", None)
            if heads is not None:
                check_divisible(name, "the number of attention heads", int(heads), size)
        head_dim = getattr(parent, "head_dim", None)
        if rule.kind == "column" and isinstance(head_dim, int) and name.rsplit(".", 1)[-1] in ("q_proj", "k_proj",
                                                                                            "v_proj"):
            check_divisible(name, f"the number of heads (output {module.weight.shape[out_dim]} / head_dim "
                            f"{head_dim})", module.weight.shape[out_dim] // head_dim, size)

    def after_qkv(self, parent: Any) -> None:
        """The attention module now sees 1/size of the heads: fix its shape attributes."""
        size = self.group.size
        for attr in ("n_head", "n_embd", "num_heads", "split_size", "embed_dim"):
            if isinstance(getattr(parent, attr, None), int):
                setattr(parent, attr, getattr(parent, attr) // size)
        if hasattr(parent, "rng_fork"):
            parent.rng_fork = self.tracker.fork  # attention dropout on split heads: per-rank stream
        drop = getattr(parent, "attn_dropout", None)
        if isinstance(drop, nn.Dropout) and not isinstance(drop, ForkedDropout):
            parent.attn_dropout = ForkedDropout(drop.p, self.tracker)


def _rules(model: nn.Module, preset_model: Optional[str], partition_config: Optional[Dict[str, Any]],
           ) -> Tuple[Optional[str], List[Rule], bool]:
    user: List[Rule] = []
    use_default, strict = True, False
    if partition_config:
        user, use_default, strict = rules_from_partition_config(partition_config)
    preset = preset_name(model, preset_model) if (use_default or not user) else None
    return preset, user + (list(PRESETS[preset]) if preset else []), strict


def apply_tensor_parallel(model: nn.Module, group: TPGroup, *, preset_model: Optional[str] = None,
                          partition_config: Optional[Dict[str, Any]] = None, sequence_parallel: bool = False,
                          seed: Optional[int] = None) -> TPReport:
    """Split ``model`` in place over ``group``; returns what was split (one log line per rule on rank 0)."""
    preset, rules, strict = _rules(model, preset_model, partition_config)
    if not rules and group.size > 1:
        logger.warning("tensor parallel: no plan for %s (no preset matches and no partition_config): every layer "
                       "stays replicated across the %d ranks of the model group; give tensor_parallel."
                       "partition_config.layer_specs or preset_model to split it", type(model).__name__, group.size)
    if sequence_parallel and preset != "shardspeed_gpt" and group.size > 1:
        raise ConfigError("tensor_parallel.sequence_parallel is implemented for shardspeed.models.GPT only; "
                          "set it to false for this model")
    tracker = TPRNGTracker(torch.initial_seed() if seed is None else seed, group.rank)
    conv = _Converter(model, group, sequence_parallel and group.size > 1, tracker)
    modules = dict(model.named_modules())
    matched = match([n for n in modules if n], rules)
    counts: Dict[Rule, int] = {r: 0 for r in rules}
    report = TPReport(preset, tracker=tracker, sequence_parallel=conv.sp)
    order = sorted(matched, key=lambda n: 0 if matched[n].kind == "embedding" else 1)  # tied heads after
    for name in order:
        rule, module = matched[name], modules[name]
        if not _kind_ok(name, module, rule):
            continue
        parent_name, _, leaf = name.rpartition(".")
        parent = modules[parent_name] if parent_name else model
        setattr(parent, leaf, conv.convert(name, module, rule, parent))
        if rule.kind == "qkv":
            conv.after_qkv(parent)
        counts[rule] += 1
        report.sharded.append(name)
    report.replaced = conv.tied
    _check_ties(model, conv)
    _share_inputs(model)
    if strict:
        _check_strict(model, report)
    if conv.sp:
        _sequence_parallel_rest(model, group, tracker)
    for rule, n in counts.items():
        report.rules.append((rule.source, rule.pattern, rule.kind, n))
        if not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0:
            logger.info("tensor parallel (%d ranks): %s pattern %r (%s): %d layer(s) sharded", group.size,
                        rule.source, rule.pattern, rule.kind, n)
    return report


def _check_ties(model: nn.Module, conv: _Converter) -> None:
    """A tied weight split under one name must be split under every name (else the tie silently breaks)."""
    for old_id, names in conv.shared.items():
        if old_id in conv.tied:
            left = [n for n, p in model.named_parameters(remove_duplicate=False) if id(p) == old_id]
            if left:
                raise ConfigError(f"tied weight {names}: {left} stayed whole while the others were split; split "
                                  f"or skip all of them (e.g. the embedding and the LM head together)")


#: Column-parallel siblings that read the same input, by leaf name (Llama-style attention and MLP).
_SIBLINGS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))


def _share_inputs(model: nn.Module) -> None:
    """Give column-parallel siblings one entry into the tensor-parallel region (see `SharedInput`)."""
    for parent in model.modules():
        for names in _SIBLINGS:
            layers = [getattr(parent, n, None) for n in names]
            cols = [m for m in layers if type(m) is ColumnParallelLinear]
            if len(cols) > 1 and len({(m.sequence_parallel, m.group) for m in cols}) == 1:
                shared = SharedInput(len(cols))
                for m in cols:
                    m.shared_input = shared


def _check_strict(model: nn.Module, report: TPReport) -> None:
    left = [n for n, m in model.named_modules() if (isinstance(m, nn.Linear) or _is_conv1d(m))
            and not isinstance(m, (ColumnParallelLinear, RowParallelLinear)) and n not in report.sharded]
    if left:
        raise ConfigError(f"tensor_parallel.partition_config.strict_mode: linear layers matched by no pattern: "
                          f"{left[:5]}{' ...' if len(left) > 5 else ''}")


def _sequence_parallel_rest(model: nn.Module, group: TPGroup, tracker: TPRNGTracker) -> None:
    """shardspeed.models.GPT under sequence parallelism: the position embedding keeps this rank's positions,
    norms run on sequence shards (their gradients summed over the group), dropouts draw per rank."""
    for m in list(model.modules()):
        if isinstance(m, (nn.LayerNorm, nn.RMSNorm)):
            for p in m.parameters(recurse=False):
                mark_sequence_parallel_grad(p, group)
        elif isinstance(m, nn.Embedding) and not isinstance(m, VocabParallelEmbedding):
            scatter_output_along_sequence(m, group)
        for child_name, child in list(m.named_children()):
            if type(child) is nn.Dropout:
                setattr(m, child_name, ForkedDropout(child.p, tracker))


__all__ = ["apply_tensor_parallel", "TPReport", "VocabParallelHead", "gather_output_along_sequence"]
