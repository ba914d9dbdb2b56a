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
import time
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
    outcome, and (on CUDA) the pinned staging buffers, kept for the next save of the same layout."""

    def __init__(self) -> None:
        self._group: Optional[WriterGroup] = None
        self._thread: Optional[threading.Thread] = None
        self._error: Optional[str] = None
        self._pinned: List[torch.Tensor] = []
        self._reading: Optional[threading.Event] = None  # set once the writer has written the live tensors
        #: bytes of the last save's snapshot (device tensors copied to pinned memory, offloaded ranges read)
        self.snapshot_bytes = 0
        #: bytes of the last save written from the engine's own host tensors, in place
        self.in_place_bytes = 0
        #: the last save's writer thread: CPU seconds (its own, ``time.thread_time``) and wall seconds
        self.writer_cpu_s = self.writer_wall_s = 0.0
        #: seconds the last optimizer step waited for the writer to finish with the tensors it reads in place
        self.update_wait_s = 0.0

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
        except Exception as exc:
            err = f"rank {view.rank} could not snapshot its state for an asynchronous save: {type(exc).__name__}: {exc}"
        view.agree(err)
        job.on_written = self._reading.set if self._reading is not None else None
        self._thread = threading.Thread(target=self._run, args=(job, self._group, ready),
                                        name=f"shardspeed-checkpoint-writer-{job.tag}", daemon=False)
        self._thread.start()
        return job.final

    def _stage(self, items: List[Tuple[str, Union[torch.Tensor, LazyTensor]]]
               ) -> Tuple[List[Tuple[str, Union[torch.Tensor, LazyTensor]]], Optional[Any]]:
        """What the writer writes. Device tensors: copies in pinned buffers (kept for the next save of the same
        layout), made on the current stream (ordered before any later kernel that changes them; the writer
        waits on the returned event before reading). An offloaded optimizer's lazy ranges: read now (the swap
        files change at the next step). Host tensors: as they are, read by the writer in place; the engine's
        next optimizer step waits until they are written (:meth:`before_update`), so they cost no copy and no
        memory."""
        on_device = [(tuple(t.shape), t.dtype) for _, t in items if isinstance(t, torch.Tensor) and t.is_cuda]
        if [(tuple(b.shape), b.dtype) for b in self._pinned] != on_device:
            self._pinned = [torch.empty(s, dtype=dt, pin_memory=True) for s, dt in on_device]
        pinned = iter(self._pinned)
        out: List[Tuple[str, Union[torch.Tensor, LazyTensor]]] = []
        copied = in_place = 0
        for key, t in items:
            if isinstance(t, LazyTensor):
                t = t.materialize()
                copied += t.numel() * t.element_size()
            elif t.is_cuda:
                t = next(pinned).copy_(t.detach(), non_blocking=True)
                copied += t.numel() * t.element_size()
            else:
                t = t.detach()
                in_place += t.numel() * t.element_size()
            out.append((key, t))
        self.snapshot_bytes, self.in_place_bytes, self.update_wait_s = copied, in_place, 0.0
        self._reading = threading.Event() if in_place else None
        ready = None
        if on_device:
            ready = torch.cuda.Event()
            ready.record()
        return out, ready

    def before_update(self) -> None:
        """The engine is about to change its state (an optimizer step): wait until the save in flight has
        written the host tensors it reads in place (its files are written; it may still be committing)."""
        reading, self._reading = self._reading, None
        if reading is not None:
            t0 = time.perf_counter()
            reading.wait()
            self.update_wait_s = time.perf_counter() - t0

    def _run(self, job: RankSave, group: WriterGroup, ready: Optional[Any]) -> None:
        _lowest_cpu_priority()
        cpu0, t0 = time.thread_time(), time.perf_counter()
        try:
            if ready is not None:
                ready.synchronize()
            write_and_commit(job, group)
        except BaseException as exc:  # kept for the next call: raised there on every rank
            remove_leftovers(job.rank, job.tmp if job.rank == 0 else None, job.tmp)
            self._error = f"the asynchronous save of {job.final} failed: {exc}"
            logger.error("%s", self._error)
        finally:
            if job.lock is not None:  # rank 0: the save folder's lock, held since save_checkpoint
                job.lock.release()
            if job.on_written is not None:  # (harmless if set already; not set when it failed before writing)
                job.on_written()
            self.writer_cpu_s, self.writer_wall_s = time.thread_time() - cpu0, time.perf_counter() - t0

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
