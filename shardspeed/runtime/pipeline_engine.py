"""The pipeline engine: ``train_batch`` / ``eval_batch`` over torch's pipeline schedules, ZeRO inside a stage.

One ``train_batch``: the first and last stages pull ``gradient_accumulation_steps`` micro-batches from
the iterator (the middle ones pull nothing, as in DeepSpeed); every pipe rank exchanges one small record
(how many micro-batches each reader got, their shapes and a checksum) so that disagreeing counts or
inputs and labels taken from different micro-batches raise the same error on every rank instead of a
hang; the schedule for those shapes runs (torch.distributed.pipelining, ``scale_grads=False``: the loss
is multiplied by loss_scale / micro-batches here); gradients accumulate locally through the step and are
reduced once at the boundary (``reduce_pending`` also takes in ``.grad`` that zero-bubble schedules
assign directly); tied gradients are summed; then the ordinary optimizer step (global norm over pipe ×
data × model, clipping, fp16 overflow).
"""
from __future__ import annotations

import dataclasses
import logging
from typing import Any, Iterator, List, Optional, Tuple

import torch

from ..errors import DistributedError, ShardspeedError
from ..pipe.module import PipelineModule
from ..pipe.plan import PipeParts
from ..pipe.schedules import ScheduleCache, StageChunk, build_schedule, p2p_errors
from .dataloader import RepeatingLoader
from .engine import Engine, EngineParts, move_inputs

logger = logging.getLogger("shardspeed")


def _fingerprint(micro: Any) -> Tuple:
    """Shapes, dtypes and a float64 checksum of a micro-batch's tensors (the same data gives the same)."""
    out = []
    for t in _tensors(micro):
        out.append((tuple(t.shape), str(t.dtype), float(t.detach().double().sum()) if t.numel() else 0.0))
    return tuple(out)


def _tensors(obj: Any) -> List[torch.Tensor]:
    if torch.is_tensor(obj):
        return [obj]
    if isinstance(obj, (list, tuple)):
        return [t for o in obj for t in _tensors(o)]
    return []


def _cat(items: List[Any]) -> Any:
    """Concatenate micro-batches along dim 0 (the schedule splits them again)."""
    first = items[0]
    if torch.is_tensor(first):
        return torch.cat(items, dim=0)
    return tuple(torch.cat([it[i] for it in items], dim=0) for i in range(len(first)))


class PipelineEngine(Engine):
    """DeepSpeed's PipelineEngine interface: ``train_batch(data_iter)`` and ``eval_batch(data_iter)``;
    ``forward``, ``backward`` and ``step`` raise."""

    def __init__(self, parts: EngineParts, pipe: PipeParts):
        super().__init__(parts)
        # gradients accumulate through the schedule; reduce_pending reduces at the boundary
        self.reducer.set_sync_policy(lambda: False)
        self._pipe = pipe
        module = parts.module
        assert isinstance(module, PipelineModule)
        self._chunks = [StageChunk(module, c, module.chunk_modules(c)) for c in range(module.num_chunks())]
        # torch's stages set up their buffers for backward or not on first use: one cache for each
        self._train_cache = ScheduleCache(self._make_schedule)
        self._eval_cache = ScheduleCache(self._make_schedule)
        self._losses: List[torch.Tensor] = []
        self._loss_factor = 1.0
        self.set_reshard_after_forward(False)  # stage 3: a stage's units stay gathered for the whole step

    # ---- DeepSpeed's pipeline properties -----------------------------------------------------------
    @property
    def num_stages(self) -> int:
        return self._pipe.total_stages // self._pipe.virtual_stages

    @property
    def stage_id(self) -> int:
        return self.topology.pipe_rank

    def is_first_stage(self) -> bool:
        return 0 in self._pipe.stage_ids

    def is_last_stage(self) -> bool:
        return self._pipe.total_stages - 1 in self._pipe.stage_ids

    # ---- what a pipeline engine refuses ------------------------------------------------------------
    def forward(self, *args, **kwargs):
        raise ShardspeedError("a pipeline engine runs whole batches: call engine.train_batch(data_iter) or "
                              "engine.eval_batch(data_iter) instead of engine(...)")

    def backward(self, *args, **kwargs):
        raise ShardspeedError("a pipeline engine runs backward inside train_batch(data_iter); do not call "
                              "engine.backward()")

    def step(self, *args, **kwargs):
        raise ShardspeedError("a pipeline engine steps inside train_batch(data_iter); do not call engine.step()")

    # ---- the schedule ------------------------------------------------------------------------------------
    def _make_schedule(self, n_microbatches: int):
        return build_schedule(self._pipe.schedule, self._chunks, self._pipe.stage_ids, self._pipe.total_stages,
                              n_microbatches, self._loss, self._pipe.pipe_comm.group, self.device)

    def _loss(self, output: Any, target: Any) -> torch.Tensor:
        loss_fn = self.module.loss_fn
        loss = output if loss_fn is None else loss_fn(output, target)
        if not torch.is_tensor(loss) or loss.dim() != 0:
            raise ShardspeedError("the pipeline's loss must be a scalar tensor: give PipelineModule a loss_fn "
                                  "returning one (or make the last layer return it)")
        return loss * self._loss_factor if self._loss_factor != 1.0 else loss

    # ---- loading micro-batches ---------------------------------------------------------------------------
    def _reads_data(self) -> bool:
        return self.is_first_stage() or self.is_last_stage()

    def _load(self, data_iter: Optional[Iterator], m: int) -> Tuple[List[Any], Any]:
        """This rank's micro-batches (empty on middle stages) and the step's agreed signature."""
        micro: List[Any] = []
        if self._reads_data():
            if data_iter is None:
                raise ShardspeedError("train_batch/eval_batch needs data_iter on the first and last pipeline "
                                      "stages (or training_data= at initialize)")
            for _ in range(m):
                try:
                    micro.append(next(data_iter))
                except StopIteration:
                    break
        record = (self._reads_data(), len(micro), [_fingerprint(b) for b in micro], self._input_problem(micro))
        seen = self._pipe.pipe_comm.all_gather_object(record, cause="every pipeline rank must call train_batch")
        readers = [(r, n, fps) for r, (reads, n, fps, _) in enumerate(seen) if reads]
        counts = {n for _, n, _ in readers}
        if counts == {0}:
            raise StopIteration
        if counts != {m}:
            got = ", ".join(f"pipe rank {r}: {n}" for r, n, _ in readers)
            raise DistributedError(f"micro-batch counts disagree: a step needs {m} micro-batches (gradient "
                                   f"accumulation steps) and the stages read {got}; give every first- and "
                                   f"last-stage rank an iterator with as many batches")
        for r, _, fps in readers[1:]:
            for k, (a, b) in enumerate(zip(readers[0][2], fps)):
                if a != b:
                    raise DistributedError(
                        f"micro-batch {k} differs between pipe rank {readers[0][0]} (which feeds the inputs) and "
                        f"pipe rank {r} (labels): inputs and labels would come from different micro-batches. "
                        f"Give the first and last stages iterators that yield the same batches in the same order")
        problems = [(r, problem) for r, (*_, problem) in enumerate(seen) if problem]
        if problems:  # raised on every stage, not only where the data was read
            raise ShardspeedError(f"{problems[0][1]} (read on pipe rank {problems[0][0]})")
        return micro, readers[0][2]

    def _input_problem(self, micro: List[Any]) -> Optional[str]:
        """What is wrong with this rank's micro-batches, if anything (checked on every stage after the
        exchange)."""
        for b in micro:
            if not (isinstance(b, (tuple, list)) and len(b) == 2):
                return "each item of data_iter must be an (inputs, labels) pair"
            if self.is_last_stage() and self.module.loss_fn is not None and not torch.is_tensor(b[1]):
                return "labels must be one tensor per micro-batch"
        return None

    def _run(self, data_iter: Optional[Iterator], m: int, train: bool) -> Any:
        micro, signature = self._load(data_iter, m)
        # every stage has the agreed shapes: every stage raises for micro-batches of different shapes
        differ = [k for k, fp in enumerate(signature) if [x[0] for x in fp] != [x[0] for x in signature[0]]]
        if differ:
            raise ShardspeedError(f"the micro-batches of one step must have the same shapes (sequence length may "
                                  f"change between steps, not within one): micro-batch {differ[0]} has "
                                  f"{[x[0] for x in signature[differ[0]]]}, micro-batch 0 "
                                  f"{[x[0] for x in signature[0]]}")
        shapes = tuple(tuple(x[:2] for x in fp) for fp in signature)
        cache = self._train_cache if train else self._eval_cache
        schedule = cache.get(shapes, m)
        args: Tuple = ()
        target = None
        if micro:
            micro = [move_inputs(tuple(b), self.device, self.train_dtype) for b in micro]
            inputs = _cat([b[0] for b in micro])
            labels = [b[1] for b in micro]
            if self.is_first_stage():
                args = inputs if isinstance(inputs, tuple) else (inputs,)
            if self.is_last_stage() and self.module.loss_fn is not None:
                target = torch.cat(labels, dim=0)
        losses: List[torch.Tensor] = []  # the schedule's, one per micro-batch (its shape inference adds none)
        outputs = None
        with p2p_errors(schedule, self._pipe.stage_ids, self.global_steps + 1):  # a failed transfer: named
            if train:
                self._loss_factor = self.cur_scale / m
                schedule.step(*args, target=target, losses=losses)
            else:
                self._loss_factor = 1.0
                with torch.no_grad():
                    outputs = schedule.eval(*args, target=target, losses=losses)
        self._losses = [t.detach().float() / self._loss_factor for t in losses]
        return outputs

    def checkpoint_parts(self):
        """As the plain engine's, coordinated over the whole world: each stage writes its own layers, keyed by
        global layer index and name, so a checkpoint loads at any pipeline layout (or none)."""
        return dataclasses.replace(super().checkpoint_parts(), coordination=self._pipe.world_comm)

    # ---- DeepSpeed's pipeline API ----------------------------------------------------------------------
    def train_batch(self, data_iter: Optional[Iterator] = None) -> torch.Tensor:
        """One optimizer step over ``gradient_accumulation_steps`` micro-batches of ``(inputs, labels)``;
        returns the mean loss (over micro-batches and data-parallel ranks) on every rank."""
        data_iter = self._default_iter(data_iter)
        self.module.train()
        m = self.gradient_accumulation_steps()
        with self.timers("forward"):  # forward and backward interleave inside the schedule
            self._run(data_iter, m, train=True)
        loss = self._mean_loss()
        self.record_step_loss(loss)  # before the step: its steps_per_print line shows this step's loss
        tied = self._pipe.tied
        self.boundary_step(None if tied is None else lambda reducer: tied.all_reduce(reducer.grad_shard))
        self.micro_steps += m
        return loss

    def eval_batch(self, data_iter: Optional[Iterator], return_logits: bool = False, compute_loss: bool = True,
                   reduce_output: Optional[str] = "avg", bcast_loss: bool = True,
                   num_micro_batches: Optional[int] = None):
        """Forward only over ``num_micro_batches`` (default: gradient accumulation steps) micro-batches;
        returns the mean loss on every rank (and the last stage's logits with ``return_logits``)."""
        if reduce_output not in ("avg", None):
            raise ShardspeedError(f"eval_batch(reduce_output={reduce_output!r}): use 'avg' or None")
        self.module.eval()
        m = int(num_micro_batches or self.gradient_accumulation_steps())
        try:
            outputs = self._run(data_iter, m, train=False)
        finally:
            self.module.train()
        loss = self._mean_loss() if compute_loss else None
        if return_logits:
            return loss, outputs if self.is_last_stage() else None
        return loss

    def _default_iter(self, data_iter: Optional[Iterator]) -> Optional[Iterator]:
        """``data_iter``, else the ``training_data`` loader repeated (DeepSpeed's ``RepeatingLoader``: a new
        epoch when one ends, never StopIteration)."""
        if data_iter is not None or self.training_dataloader is None:
            return data_iter
        if getattr(self, "_data_iterator", None) is None:
            self._data_iterator = RepeatingLoader(self.training_dataloader)
        return self._data_iterator

    def _mean_loss(self) -> torch.Tensor:
        """The step's mean loss on every rank: averaged on the last stage over micro-batches and the data
        group, then broadcast over the pipe group."""
        loss = torch.zeros((), dtype=torch.float32, device=self.device)
        if self.is_last_stage() and self._losses:
            loss += torch.stack(self._losses).mean()
            self.data_collectives.all_reduce(loss)
            loss /= self.topology.shard_size
        self._pipe.pipe_comm.broadcast(loss, self._pipe.last_stage_pipe_rank)
        return loss
