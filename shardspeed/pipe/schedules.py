"""Which ``torch.distributed.pipelining`` schedule runs a step, built per input shape.

A ``PipelineStage`` fixes the shapes of the activations it sends after its first step, so one
(stages, schedule) pair is built for each distinct shape of a step's inputs and labels and kept (a few
at most): sequence length may change between batches (DeepSpeed fixes it after the first send).
"""
from __future__ import annotations

from collections import OrderedDict
from typing import Any, Callable, Dict, List, Tuple

import torch
import torch.distributed as dist
import torch.nn as nn

from ..errors import ConfigError

#: config name -> (torch class name in torch.distributed.pipelining, whether it takes a list of stages per rank)
SCHEDULES: Dict[str, Tuple[str, bool]] = {
    "1f1b": ("Schedule1F1B", False),
    "gpipe": ("ScheduleGPipe", False),
    "interleaved_1f1b": ("ScheduleInterleaved1F1B", True),
    "zbv": ("ScheduleZBVZeroBubble", True),
    "dualpipev": ("ScheduleDualPipeV", True),
}


class StageChunk(nn.Module):
    """What one torch ``PipelineStage`` runs: chunk ``chunk`` of this rank's ``PipelineModule``, called
    through the module itself (so its hooks, e.g. stage-3 gathers, fire). Holds the chunk's layers as
    children so that ``parameters()`` (what the zero-bubble schedules differentiate) are the chunk's."""

    def __init__(self, root: nn.Module, chunk: int, layers: List[nn.Module]):
        super().__init__()
        object.__setattr__(self, "_root", root)  # not a child: parameter names stay the root's
        self.chunk = chunk
        self.layers = nn.ModuleList(layers)

    def forward(self, *args: Any) -> Any:
        root: nn.Module = self.__dict__["_root"]
        return root(*args, chunk=self.chunk)


def build_schedule(name: str, chunks: List[StageChunk], stage_ids: List[int], total_stages: int,
                   n_microbatches: int, loss_fn: Callable, group: Any, device: torch.device):
    """A torch schedule over fresh ``PipelineStage`` objects for this rank's chunks (``scale_grads=False``:
    the engine scales the loss itself). Bad micro-batch counts become a one-line ConfigError."""
    import torch.distributed.pipelining as pipelining  # seconds to import: only pipeline engines pay it

    cls_name, multi = SCHEDULES[name]
    cls = getattr(pipelining, cls_name)
    PipelineStage = pipelining.PipelineStage
    stages = [PipelineStage(c, s, total_stages, device, group=group) for c, s in zip(chunks, stage_ids)]
    try:
        if multi:
            return cls(stages, n_microbatches, loss_fn=loss_fn, scale_grads=False)
        return cls(stages[0], n_microbatches, loss_fn=loss_fn, scale_grads=False)
    except ValueError as exc:  # torch: micro-batch count vs stages/rounds
        raise ConfigError(f"pipeline.schedule {name!r} with {total_stages} stages cannot run "
                          f"{n_microbatches} micro-batches per step ({exc}); change gradient_accumulation_steps"
                          ) from None


class ScheduleCache:
    """The (schedule) for each input signature, least recently used dropped beyond ``size``."""

    def __init__(self, make: Callable[[int], Any], size: int = 4):
        self._make = make
        self._size = size
        self._cache: OrderedDict[Any, Any] = OrderedDict()

    def get(self, key: Any, n_microbatches: int) -> Any:
        key = (key, n_microbatches)
        if key in self._cache:
            self._cache.move_to_end(key)
            return self._cache[key]
        sched = self._make(n_microbatches)
        self._cache[key] = sched
        while len(self._cache) > self._size:
            self._cache.popitem(last=False)
        return sched


def pipe_group_rank_to_global(group: Any, rank: int) -> int:
    return dist.get_global_rank(group, rank) if group is not None else rank
