"""AutoTP plans: which layers to split and how, from module names alone (pure, no process group).

A plan is an ordered list of :class:`Rule` (a regular expression and a kind); a module takes the first rule
whose pattern matches its name (or its weight's name, ``<name>.weight``) with ``re.match``, as DeepSpeed's
``partition_config.layer_specs`` do. Unmatched modules stay replicated.

Kinds: ``column`` / ``row`` (Megatron's column- and row-parallel linear), ``qkv`` (column-parallel over
``blocks`` fused blocks, e.g. GPT-2's ``c_attn``: q, k, v each split by heads), ``embedding`` (vocabulary-
parallel), ``head`` (the LM head, split by vocabulary), ``skip`` (stay replicated).
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

from ...errors import ConfigError

KINDS = ("column", "row", "qkv", "embedding", "head", "skip")


@dataclass(frozen=True)
class Rule:
    pattern: str
    kind: str
    blocks: int = 1  # fused equal blocks along the split dimension (qkv: 3)
    gather_output: bool = False
    source: str = "preset"

    def matches(self, module_name: str) -> bool:
        return bool(re.match(self.pattern, module_name) or re.match(self.pattern, module_name + ".weight"))


#: Built-in plans by name (``tensor_parallel.preset_model``); ``shardspeed_gpt`` is shardspeed.models.GPT.
PRESETS: Mapping[str, Tuple[Rule, ...]] = MappingProxyType({
    "shardspeed_gpt": (
        Rule(r"(.*\.)?attn\.c_attn$", "qkv", 3), Rule(r"(.*\.)?attn\.c_proj$", "row"),
        Rule(r"(.*\.)?mlp\.c_fc$", "column"), Rule(r"(.*\.)?mlp\.c_proj$", "row"),
        Rule(r"(.*\.)?wte$", "embedding"), Rule(r"(.*\.)?lm_head$", "head"),
    ),
    "gpt2": (
        Rule(r"(.*\.)?attn\.c_attn$", "qkv", 3), Rule(r"(.*\.)?attn\.c_proj$", "row"),
        Rule(r"(.*\.)?mlp\.c_fc$", "column"), Rule(r"(.*\.)?mlp\.c_proj$", "row"),
        Rule(r"(.*\.)?wte$", "embedding"), Rule(r"(.*\.)?lm_head$", "head"),
    ),
    "llama": (
        Rule(r"(.*\.)?[qkv]_proj$", "column"), Rule(r"(.*\.)?o_proj$", "row"),
        Rule(r"(.*\.)?(gate|up)_proj$", "column"), Rule(r"(.*\.)?down_proj$", "row"),
        Rule(r"(.*\.)?embed_tokens$", "embedding"), Rule(r"(.*\.)?(lm_head|embed_out)$", "head"),
    ),
})
#: Hugging Face ``config.model_type`` values with Llama's layer names.
LLAMA_LIKE = ("llama", "mistral", "qwen2", "qwen3", "mixtral", "gemma", "gemma2", "phi3")
_SPEC_KEYS = frozenset({"patterns", "partition_type", "shape", "gather_output"})
_CONFIG_KEYS = frozenset({"layer_specs", "use_default_specs", "strict_mode"})


def preset_name(model: Any, preset_model: Optional[str] = None) -> Optional[str]:
    """The plan to use: ``preset_model`` when given, else the one the model's class or HF config implies."""
    if preset_model is not None:
        name = "llama" if preset_model in LLAMA_LIKE else preset_model
        if name not in PRESETS:
            raise ConfigError(f"tensor_parallel.preset_model {preset_model!r} is unknown; choose one of "
                              f"{', '.join(sorted(set(PRESETS) | set(LLAMA_LIKE)))} or give partition_config")
        return name
    from ...pipe.module import PipelineModule

    own = getattr(type(model), "tp_preset", None)  # a model naming its plan (shardspeed.models.GPT does)
    if isinstance(own, str):
        return own
    if isinstance(model, PipelineModule) and "Block" in model.layer_classes() and any(
            c in ("GPTEmbedding", "GPTHead") for c in model.layer_classes()):
        return "shardspeed_gpt"  # the layers of shardspeed.models.gpt_pipe (every stage picks the same plan)
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    if model_type == "gpt2":
        return "gpt2"
    if model_type in LLAMA_LIKE:
        return "llama"
    return None


def rules_from_partition_config(pc: Dict[str, Any]) -> Tuple[List[Rule], bool, bool]:
    """``(rules, use_default_specs, strict_mode)`` from DeepSpeed's ``partition_config``; one-line errors
    for keys or values shardspeed does not implement."""
    unknown = set(pc) - _CONFIG_KEYS
    if unknown:
        raise ConfigError(f"tensor_parallel.partition_config: unsupported key(s) {sorted(unknown)}; supported: "
                          f"{sorted(_CONFIG_KEYS)}")
    rules: List[Rule] = []
    for i, spec in enumerate(pc.get("layer_specs", [])):
        where = f"tensor_parallel.partition_config.layer_specs[{i}]"
        if not isinstance(spec, dict) or set(spec) - _SPEC_KEYS:
            raise ConfigError(f"{where}: expected a dict with keys among {sorted(_SPEC_KEYS)}, got {spec!r}")
        kind = str(spec.get("partition_type", "column")).lower()
        if kind not in ("row", "column", "skip"):
            raise ConfigError(f"{where}.partition_type {kind!r}: use \"row\", \"column\" or \"skip\"")
        blocks = _blocks(spec.get("shape"), where, kind)
        for pattern in spec.get("patterns", []):
            try:
                re.compile(pattern)
            except re.error as exc:
                raise ConfigError(f"{where}: pattern {pattern!r} is not a regular expression ({exc})") from None
            rules.append(Rule(pattern, "qkv" if blocks > 1 else kind, blocks, bool(spec.get("gather_output", False)),
                              source="partition_config"))
    return rules, bool(pc.get("use_default_specs", True)), bool(pc.get("strict_mode", False))


def _blocks(shape: Any, where: str, kind: str) -> int:
    """Equal fused blocks from a DeepSpeed ``shape`` such as ``[3, -1]`` (column layers only)."""
    if shape is None:
        return 1
    if (kind == "column" and isinstance(shape, (list, tuple)) and len(shape) == 2 and isinstance(shape[0], int)
            and shape[0] > 0 and shape[1] == -1):
        return int(shape[0])
    raise ConfigError(f"{where}.shape {shape!r}: only [k, -1] (k equal fused blocks of a column layer) is supported")


def match(names: Sequence[str], rules: Sequence[Rule]) -> Dict[str, Rule]:
    """The first matching rule of each module name that has one (names in the given order)."""
    out: Dict[str, Rule] = {}
    for name in names:
        for rule in rules:
            if rule.matches(name):
                out[name] = rule
                break
    return out
