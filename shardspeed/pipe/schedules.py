"""Which ``torch.distributed.pipelining`` schedule runs a step, built per input shape.

A ``PipelineStage`` fixes the shapes of the activations it sends after its first step, so one
(stages, schedule) pair is built for each distinct shape of a step's inputs and labels and kept (a few
at most): sequence length may change between batches (DeepSpeed fixes it after the first send).
"""
from __future__ import annotations

import contextlib
from collections import OrderedDict, deque
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, Callable, Deque, Iterator, List, Mapping, Optional, Tuple

import torch
import torch.distributed as dist
import torch.nn as nn

from ..errors import ConfigError, DistributedError, ShardspeedError

#: config name -> (torch class name in torch.distributed.pipelining, whether it takes a list of stages per rank)
SCHEDULES: Mapping[str, Tuple[str, bool]] = MappingProxyType({
    "1f1b": ("Schedule1F1B", False),
    "gpipe": ("ScheduleGPipe", False),
    "interleaved_1f1b": ("ScheduleInterleaved1F1B", True),
    "zbv": ("ScheduleZBVZeroBubble", True),
    "dualpipev": ("ScheduleDualPipeV", True),
})


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
    trace = P2PTrace(group)
    for stage in stages:
        trace.watch(stage)
    try:
        if multi:
            schedule = cls(stages, n_microbatches, loss_fn=loss_fn, scale_grads=False)
        else:
            schedule = cls(stages[0], n_microbatches, loss_fn=loss_fn, scale_grads=False)
    except ValueError as exc:  # torch: micro-batch count vs stages/rounds
        raise ConfigError(f"pipeline.schedule {name!r} with {total_stages} stages cannot run "
                          f"{n_microbatches} micro-batches per step ({exc}); change gradient_accumulation_steps"
                          ) from None
    schedule.p2p_trace = trace  # read by p2p_errors
    return schedule


@dataclass(frozen=True)
class P2PRecord:
    """One point-to-point transfer a stage of this rank issued."""

    stage: int  # this rank's stage
    micro_batch: int
    what: str  # "receive of the activations", ...
    peer_stage: int
    peer: int  # global rank

    def describe(self, group: Any) -> str:
        direction = "from" if self.what.startswith("receive") else "to"
        try:
            pipe_rank = f"pipe rank {dist.get_group_rank(group, self.peer)}, " if group is not None else ""
        except (RuntimeError, ValueError):
            pipe_rank = ""
        return (f"{self.what} of micro-batch {self.micro_batch} {direction} stage {self.peer_stage} "
                f"({pipe_rank}global rank {self.peer})")


class P2PTrace:
    """The point-to-point transfers this rank's stages issued most recently in a step (torch's schedule
    issues and waits on them in code of its own), for the error a failed one raises (:func:`p2p_errors`)."""

    #: PipelineStage method -> (what it transfers, the peer's stage relative to this one)
    _OPS = {"get_fwd_recv_ops": ("receive of the activations", -1), "get_fwd_send_ops": ("send of the activations", 1),
            "get_bwd_recv_ops": ("receive of the gradients", 1), "get_bwd_send_ops": ("send of the gradients", -1)}

    def __init__(self, group: Any, size: int = 16):
        self.group = group
        self.issued: Deque[P2PRecord] = deque(maxlen=size)

    def watch(self, stage: Any) -> None:
        """Record every transfer ``stage`` (a torch ``PipelineStage``) hands its schedule."""
        for method, (what, delta) in self._OPS.items():
            get_ops = getattr(stage, method)

            def traced(chunk_id: int, *args: Any, _get_ops: Callable = get_ops, _what: str = what,
                       _delta: int = delta, **kwargs: Any) -> Any:
                ops = _get_ops(chunk_id, *args, **kwargs)
                for op in ops:
                    self.issued.append(P2PRecord(stage.stage_index, chunk_id, _what, stage.stage_index + _delta,
                                                 int(op.peer)))
                return ops

            setattr(stage, method, traced)

    def pending(self, error: str = "") -> Optional[P2PRecord]:
        """The transfer most likely waited on: the last send issued where the backend's ``error`` says a
        send failed (gloo: "... for send operation ..."), else the last receive (a send completes on its
        own as a rule), else the last one; None before the first (the schedule's set-up)."""
        kind = "send" if "send" in error and "recv" not in error else "receive"
        of_kind = [r for r in self.issued if r.what.startswith(kind)]
        if of_kind:
            return of_kind[-1]
        return self.issued[-1] if self.issued else None


def _from_torch_distributed(exc: BaseException) -> bool:
    """Whether ``exc`` was raised in torch.distributed's own code (a transfer or its wait, the schedule's
    shape exchange), not in the model the stage runs (whose errors pass through unchanged)."""
    import os

    root = os.path.dirname(dist.__file__)
    pipelining = os.path.join(root, "pipelining")
    tb, last = exc.__traceback__, None
    while tb is not None:
        last = tb.tb_frame.f_code.co_filename
        tb = tb.tb_next
    if last is None or not last.startswith(root):
        return False
    # the pipelining package's own checks (shapes, metadata) are not transfer failures
    return not last.startswith(pipelining) or isinstance(exc, dist.DistError) or "gloo" in str(exc).lower()


@contextlib.contextmanager
def p2p_errors(schedule: Any, stage_ids: List[int], step: int) -> Iterator[None]:
    """Run a step of ``schedule``: a transfer between stages that fails (a peer dead, hung, or on another
    path: torch raises after the group's timeout) becomes a `DistributedError` naming this rank's stage,
    the micro-batch and the peer. Errors of the model and shardspeed's own pass through."""
    trace: Optional[P2PTrace] = getattr(schedule, "p2p_trace", None)
    if trace is not None:
        trace.issued.clear()
    try:
        yield
    except ShardspeedError:
        raise
    except RuntimeError as exc:
        chain: List[BaseException] = []  # torch wraps a stage's forward/backward errors in RuntimeErrors
        cause: Optional[BaseException] = exc
        while cause is not None and cause not in chain:
            chain.append(cause)
            cause = cause.__cause__ or cause.__context__
        ours = next((e for e in chain if isinstance(e, ShardspeedError)), None)
        if ours is not None:  # a collective inside the model (tensor parallel) that named itself
            raise ours from ours.__cause__  # its own cause (the failed collective) stays
        failed = next((e for e in chain if _from_torch_distributed(e)), None)
        if failed is None:
            raise
        first = str(failed).strip().splitlines()[0] if str(failed).strip() else type(failed).__name__
        pending = trace.pending(first) if trace is not None else None
        stages = "/".join(str(s) for s in stage_ids)
        me = dist.get_rank() if dist.is_initialized() else 0
        what = (f"the {pending.describe(trace.group if trace else None)}" if pending is not None
                else "the exchange of activation shapes before the first micro-batch")
        raise DistributedError(
            f"pipeline stage {stages} (global rank {me}), step {step}: {what} failed: {first}. That rank "
            f"probably died or hung, or the stages ran different numbers of steps; look at the other ranks' "
            f"logs for the first error.") from exc


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
