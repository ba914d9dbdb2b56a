"""Pure pipeline arithmetic: which layers each stage holds, which stages each rank runs.

A partition is a list of ``num_parts + 1`` boundaries (DeepSpeed's ``parts``): stage ``s`` holds layers
``parts[s] .. parts[s + 1] - 1``. Every stage must hold at least one layer.
"""
from __future__ import annotations

import re
from typing import List, Sequence

from ..errors import ConfigError
from ..plan import V_SCHEDULES, check_schedule


def _check_parts(num_items: int, num_parts: int) -> None:
    if num_parts < 1:
        raise ConfigError(f"a pipeline needs at least 1 stage, got {num_parts}")
    if num_items < num_parts:
        raise ConfigError(f"{num_items} layers cannot fill {num_parts} pipeline stages: a stage would hold no "
                          f"layers; use at most {num_items} stages (× virtual_stages) or add layers")


def partition_uniform(num_items: int, num_parts: int) -> List[int]:
    """As many layers per stage as possible; the first ``num_items % num_parts`` stages take one more."""
    _check_parts(num_items, num_parts)
    base, extra = divmod(num_items, num_parts)
    parts = [0]
    for s in range(num_parts):
        parts.append(parts[-1] + base + (1 if s < extra else 0))
    return parts


def _fits(weights: Sequence[int], num_parts: int, cap: int) -> bool:
    """Whether ``weights`` split into ``num_parts`` non-empty contiguous parts each weighing at most ``cap``."""
    n, parts, acc, count = len(weights), 1, 0, 0
    for i, w in enumerate(weights):
        if w > cap:
            return False
        # start a new part when this one would overflow, or when the rest are needed one per part
        if count and (acc + w > cap or n - i < num_parts - parts + 1):
            parts, acc, count = parts + 1, 0, 0
        acc, count = acc + w, count + 1
    return parts <= num_parts


def partition_balanced(weights: Sequence[int], num_parts: int) -> List[int]:
    """Contiguous parts minimising the heaviest part (every part holding at least one item): a binary
    search on the heaviest part's weight, then a greedy fill from the left that leaves one item for each
    remaining part."""
    n = len(weights)
    _check_parts(n, num_parts)
    w = [max(0, int(x)) for x in weights]
    lo, hi = max(w), sum(w)
    while lo < hi:
        mid = (lo + hi) // 2
        if _fits(w, num_parts, mid):
            hi = mid
        else:
            lo = mid + 1
    parts, acc = [0], 0
    for i, x in enumerate(w):
        left = num_parts - (len(parts) - 1)  # parts still open, this one included
        must_split = n - i <= left - 1  # the items left are needed one per later part
        if i > parts[-1] and left > 1 and (acc + x > lo or must_split):
            parts.append(i)
            acc = 0
        acc += x
    parts += [n] * (num_parts + 1 - len(parts))
    return parts


def type_weights(class_names: Sequence[str], regex: str) -> List[int]:
    """``partition_method="type:<regex>"``: weight 1 for layers whose class name matches (case-insensitive)."""
    pattern = re.compile(regex, re.IGNORECASE)
    return [1 if pattern.search(name) else 0 for name in class_names]


def partition_layers(method: str, param_counts: Sequence[int], class_names: Sequence[str],
                     num_parts: int) -> List[int]:
    """DeepSpeed's ``partition_method``: ``uniform`` (layer count), ``parameters`` (trainable parameter
    count), ``type:<regex>`` (matching layers)."""
    m = method.lower()
    if m == "uniform":
        return partition_uniform(len(param_counts), num_parts)
    if m == "parameters":
        return partition_balanced(param_counts, num_parts)
    if m.startswith("type:"):
        weights = type_weights(class_names, method[len("type:"):])
        if not any(weights):
            raise ConfigError(f"partition_method {method!r} matches none of the layer classes "
                              f"{sorted(set(class_names))}; fix the regex")
        return partition_balanced(weights, num_parts)
    raise ConfigError(f"partition_method {method!r} is not one of 'parameters', 'uniform', 'type:<regex>'")


def stages_of_rank(pipe_rank: int, pipe_size: int, virtual_stages: int, schedule: str) -> List[int]:
    """The stage indices pipe rank ``pipe_rank`` runs, in chunk order. Looped schedules place stage s on
    rank ``s % p``; V schedules (ZBV, DualPipeV: two chunks) place rank r's chunks at r and 2p - 1 - r."""
    check_schedule(schedule, virtual_stages)  # the plan's rule (decide checked a pipeline's config with it)
    if schedule in V_SCHEDULES:
        return [pipe_rank, 2 * pipe_size - 1 - pipe_rank]
    return [pipe_rank + i * pipe_size for i in range(virtual_stages)]


def rank_of_stage(stage: int, pipe_size: int, virtual_stages: int, schedule: str) -> int:
    """Which pipe rank runs ``stage`` (inverse of :func:`stages_of_rank`)."""
    if schedule in V_SCHEDULES:
        return stage if stage < pipe_size else 2 * pipe_size - 1 - stage
    return stage % pipe_size


def bubble_fraction(schedule: str, p: int, m: int, v: int = 1) -> float:
    """Theory, for equal stage times: the idle share of a step. GPipe and 1F1B: (p - 1) / (m + p - 1);
    interleaved with v chunks per rank: (p - 1) / (v·m + p - 1)."""
    if schedule in ("interleaved_1f1b",):
        return (p - 1) / (v * m + p - 1)
    return (p - 1) / (m + p - 1)
