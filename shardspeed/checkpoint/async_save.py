"""Asynchronous saves: ``save_checkpoint(..., async_save=True)`` copies this rank's state to host memory
(pinned when it lives on a GPU) while the caller waits, then a background thread writes and commits it
while training goes on. Same files, same atomic commit as a synchronous save (:func:`.save.write_and_commit`).

**The writer's collectives run on a group of their own.** Committing needs collectives: every rank's record
goes to rank 0, and every file must be durable before rank 0 renames the directory and moves ``latest``.
They cannot run on the training group from the writer thread: the ranks must issue a group's collectives
in the same order, and the training thread issues its own (gradient reductions, parameter gathers) at the
same time, so the two threads' operations would interleave differently on each rank. The first
asynchronous save of an engine therefore creates a gloo group over the same ranks (on the calling thread:
creating a group is itself a collective over the world), and the writer coordinates only on it: its
connections are its own, and gloo works on host memory, where the snapshot is. The other option, committing
at the next engine call, would leave ``latest`` a whole save interval behind.

**Waiting and errors.** At most one save is in flight. The next ``save_checkpoint``, ``load_checkpoint`` and
``engine.destroy()`` wait for it, then all-gather every rank's outcome over the training group (on the
calling thread) and raise the same :class:`~shardspeed.errors.CheckpointError` on every rank if any
failed. Inside the writer, a rank that cannot write still joins the writer group's agreement, so the others
learn it and skip the commit rather than wait for it; a rank that dies leaves the others' writers waiting
until the group's timeout (that of the world group), which then surfaces as the error. A process that exits
with a save in flight finishes it first (the thread is not a daemon); destroying the process groups while
one is in flight breaks it, so call ``engine.destroy()`` (or the next save) before ``shutdown_distributed``.
"""
from __future__ import annotations

import logging
import os
import threading
from typing import Any, List, Optional, Tuple, Union

import torch
import torch.distributed as dist

from ..comm.collectives import Collectives
from ..mesh.init import group_timeout
from .engine_view import EngineView, raise_agreed
from .format import LazyTensor
from .save import RankSave, collect, remove_leftovers, write_and_commit

logger = logging.getLogger("shardspeed")

CAUSE = "not every rank called save_checkpoint/load_checkpoint/destroy after an asynchronous save"


class WriterGroup:
    """The writer thread's coordination (:class:`~.save.Coordination`) over its own gloo group."""

    def __init__(self, comm: Optional[Collectives]):
        self.comm = comm  # None: a single rank

    def all_gather_object(self, obj: Any) -> List[Any]:
        if self.comm is None:
            return [obj]
        return self.comm.all_gather_object(obj, cause="a rank's checkpoint writer failed or its process died")

    def agree(self, error: Optional[str]) -> None:
        raise_agreed(self.all_gather_object(error))


def _writer_group(coord: Collectives) -> WriterGroup:
    """A gloo group over ``coord``'s ranks (collective over the world). Every rank gathers every rank's
    coordination group first, so that all create the same groups in the same order even when the world
    holds several (one per data-parallel group writing its own checkpoint)."""
    if coord.world == 1:
        return WriterGroup(None)
    mine = dist.get_process_group_ranks(coord.group) if coord.group is not None else list(range(dist.get_world_size()))
    everyone: List[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, tuple(sorted(mine)))
    group = None
    for ranks in sorted(set(everyone)):
        g = dist.new_group(list(ranks), backend="gloo", timeout=group_timeout(),
                           group_desc="shardspeed checkpoint writer")
        if ranks == tuple(sorted(mine)):
            group = g
    return WriterGroup(Collectives.over(group))


class AsyncSaves:
    """One engine's asynchronous saves: the writer group (made on first use), the save in flight, its
    outcome, and the staging buffers (pinned on CUDA), kept for the next save of the same layout."""

    def __init__(self) -> None:
        self._group: Optional[WriterGroup] = None
        self._thread: Optional[threading.Thread] = None
        self._error: Optional[str] = None
        self._staging: List[torch.Tensor] = []
        #: bytes of the last snapshot (this rank's host copy of its state)
        self.snapshot_bytes = 0

    @property
    def in_flight(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def start(self, view: EngineView, job: RankSave, client_state: Optional[dict]) -> str:
        """Snapshot (on the calling thread), then write and commit in the background; returns the path the
        checkpoint will have. Every rank agrees that its snapshot succeeded before any writer starts."""
        if self._group is None:
            self._group = _writer_group(view.coord)
        err = None
        ready: Optional[torch.cuda.Event] = None
        try:
            collect(view, job, client_state)
            job.items, ready = self._stage(job.items)
            self.snapshot_bytes = job.snapshot_bytes()
        except Exception as exc:
            err = f"rank {view.rank} could not snapshot its state for an asynchronous save: {type(exc).__name__}: {exc}"
        view.agree(err)
        self._thread = threading.Thread(target=self._run, args=(job, self._group, ready),
                                        name=f"shardspeed-checkpoint-writer-{job.tag}", daemon=False)
        self._thread.start()
        return job.final

    def _stage(self, items: List[Tuple[str, Union[torch.Tensor, LazyTensor]]]
               ) -> Tuple[List[Tuple[str, Union[torch.Tensor, LazyTensor]]], Optional[Any]]:
        """Host copies of ``items``, into staging buffers kept for the next save of the same layout (pinned
        for device tensors; copying into memory already mapped is several times faster than into fresh
        pages, and the process's memory stays level from one save to the next). Device tensors are copied
        on the current stream (ordered before any later kernel that changes them; the writer waits on the
        returned event before reading); an offloaded optimizer's lazy ranges are read now."""
        tensors = [t for _, t in items if isinstance(t, torch.Tensor)]
        layout = [(tuple(t.shape), t.dtype, t.device.type == "cuda") for t in tensors]
        if [(tuple(b.shape), b.dtype, b.is_pinned()) for b in self._staging] != layout:
            self._staging = [torch.empty(s, dtype=dt, pin_memory=pin) for s, dt, pin in layout]
        staging = iter(self._staging)
        out: List[Tuple[str, Union[torch.Tensor, LazyTensor]]] = []
        for key, t in items:
            if isinstance(t, torch.Tensor):
                out.append((key, next(staging).copy_(t.detach(), non_blocking=t.device.type == "cuda")))
            else:
                out.append((key, t.materialize()))
        ready = None
        if any(pin for *_, pin in layout):
            ready = torch.cuda.Event()
            ready.record()
        return out, ready

    def _run(self, job: RankSave, group: WriterGroup, ready: Optional[Any]) -> None:
        _lowest_cpu_priority()
        try:
            if ready is not None:
                ready.synchronize()
            write_and_commit(job, group)
        except BaseException as exc:  # kept for the next call: raised there on every rank
            remove_leftovers(job.rank, job.tmp if job.rank == 0 else None, job.tmp)
            self._error = f"the asynchronous save of {job.final} failed: {exc}"
            logger.error("%s", self._error)

    def wait(self, coord: Collectives) -> None:
        """Wait for the save in flight, if any, and raise its error on every rank (an all-gather over
        ``coord``, the training group, on the calling thread). Nothing to do (and no collective) when no
        asynchronous save was started since the last wait: saves are collective, so every rank agrees."""
        thread, self._thread = self._thread, None
        if thread is None:
            return
        thread.join()
        err, self._error = self._error, None
        raise_agreed(coord.all_gather_object(err, cause=CAUSE))


def _lowest_cpu_priority() -> None:
    """Run the calling (writer) thread at nice 19, where the OS allows it (Linux: a thread's own priority),
    so the write uses the CPU time training leaves idle (waiting on collectives or the device) instead of
    taking cores from it."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
    except (AttributeError, OSError):  # not Linux, or not permitted: the write still happens, at normal priority
        pass
