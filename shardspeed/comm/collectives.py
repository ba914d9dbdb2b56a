"""One job: the collectives the library issues, each logged (bytes, time) and named in its errors.

Every collective the library issues goes through :class:`Collectives`. Each call is recorded in the
:class:`CommsLogger` (op, message bytes, elements, the bytes a ring algorithm moves per rank, time from
launch to completion). ``CommHandle.wait()`` is the host sync point of an asynchronous call.
"""
from __future__ import annotations

import inspect
import logging
import pickle
import time
from collections import OrderedDict, deque
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, Deque, Dict, List, Optional, Sequence

import torch
import torch.distributed as dist

from ..errors import DistributedError
from ..mesh.topology import Topology, describe_group, group_ranks

logger = logging.getLogger(__name__)


def _all_gather_tensor(output, input, group, async_op):
    # torch >= 2.12 renames the tensor-in/tensor-out collectives; looked up per call so that wrappers
    # installed on torch.distributed later (profilers, byte counters) see our traffic too
    fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    return fn(output, input, group=group, async_op=async_op)


def _global_rank(group, rank: int) -> int:
    """The global rank of ``group``'s rank ``rank`` (None: the world)."""
    return dist.get_global_rank(group, rank) if group is not None else rank


class _Works:
    """The works of one logical collective issued as several (a gather's broadcasts, a reduce-scatter's
    sends and receives), waited on as one."""

    __slots__ = ("works",)

    def __init__(self, works: List[Any]):
        self.works = works

    def wait(self, timeout: Any = None) -> bool:
        for w in self.works:
            w.wait()
        return True

    def is_completed(self) -> bool:
        return all(w.is_completed() for w in self.works)


def _broadcast_gather(output: torch.Tensor, input: torch.Tensor, group, async_op: bool) -> Optional[_Works]:
    """All-gather as one broadcast per rank, each straight into its chunk of ``output``: the same bytes per
    rank ((N-1) pieces sent, (N-1) received), and no temporary, where gloo's all-gather (tensor and list
    forms) holds one as large as the whole output until its work is gone."""
    parts = output.view(-1, input.numel()).unbind(0)
    parts[dist.get_rank(group)].copy_(input)
    works = [dist.broadcast(p, src=_global_rank(group, r), group=group, async_op=True) for r, p in enumerate(parts)]
    handle = _Works(works)
    if async_op:
        return handle
    handle.wait()
    return None


class _Exchange(_Works):
    """A reduce-scatter issued as point-to-point exchanges (:func:`_exchange_reduce_scatter`): ``wait()``
    waits for the sends and receives, then adds the received chunks into ``output`` (once)."""

    __slots__ = ("output", "received")

    def __init__(self, works: List[Any], output: torch.Tensor, received: List[torch.Tensor]):
        super().__init__(works)
        self.output, self.received = output, received

    def wait(self, timeout: Any = None) -> bool:
        super().wait()
        for t in self.received:
            self.output.add_(t)
        self.received = []
        return True


def _exchange_reduce_scatter(output: torch.Tensor, input: torch.Tensor, group, async_op: bool
                             ) -> Optional[_Exchange]:
    """Reduce-scatter as one send and one receive per peer (``dist.isend``/``dist.irecv``): this rank sends
    chunk ``j`` of ``input`` to rank ``j`` and adds what every peer sends it into ``output`` (which may be its
    own chunk of ``input``). Each rank sends (N-1)/N of the input, a reduce-scatter's bytes, where gloo's
    reduce-scatter (tensor and list forms) runs an all-reduce, twice those bytes; the received chunks are
    the same temporary gloo's takes. Each chunk is summed as its own rank's part, then the parts of ranks
    me-1, me-2, ...; at N = 2 bitwise gloo's."""
    rows = input.view(-1, output.numel()).unbind(0)
    me, n = dist.get_rank(group), len(rows)
    if output.data_ptr() != rows[me].data_ptr():
        output.copy_(rows[me])
    works: List[Any] = []
    received: List[torch.Tensor] = []
    for k in range(1, n):  # to rank me+k, from rank me-k: the pairs of step k match on every rank
        to, frm = (me + k) % n, (me - k) % n
        buf = torch.empty_like(output)
        works.append(dist.isend(rows[to], dst=_global_rank(group, to), group=group))
        works.append(dist.irecv(buf, src=_global_rank(group, frm), group=group))
        received.append(buf)
    handle = _Exchange(works, output, received)
    if async_op:
        return handle
    handle.wait()
    return None


def _reduce_scatter_tensor(output, input, group, async_op, chunks=False):
    # ``chunks`` (gloo): the list form over views of the input's per-rank chunks reduces without a copy;
    # gloo's tensor form copies its whole input into a temporary first (a full-size bucket more per
    # reduction in flight)
    if chunks:
        return dist.reduce_scatter(output, list(input.view(-1, output.numel()).unbind(0)), group=group,
                                   async_op=async_op)
    fn = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    return fn(output, input, group=group, async_op=async_op)


#: Bytes each rank sends per byte of message in a ring implementation, as a function of world size N.
_RING_FACTOR = MappingProxyType({
    "all_reduce": lambda n: 2.0 * (n - 1) / n,
    "reduce_scatter": lambda n: (n - 1) / n,
    "all_gather": lambda n: (n - 1) / n,
    "broadcast": lambda n: 1.0 if n > 1 else 0.0,
    "all_to_all": lambda n: (n - 1) / n,
    # object collectives: msg_bytes is this rank's pickled object (an estimate: torch pads and sends sizes too)
    "all_gather_object": lambda n: (n - 1) / n,
    "broadcast_object": lambda n: 1.0 if n > 1 else 0.0,
    "barrier": lambda n: 0.0,
})

#: Messages of each op expressed in "model-size units": an all-reduce of Ψ counts as 2Ψ (it is a
#: reduce-scatter plus an all-gather), as in the ZeRO paper's accounting.
_PAPER_FACTOR = MappingProxyType({"all_reduce": 2.0, "reduce_scatter": 1.0, "all_gather": 1.0, "broadcast": 1.0, "all_to_all": 1.0,
                 "all_gather_object": 1.0, "broadcast_object": 1.0, "barrier": 0.0})


@dataclass
class CommRecord:
    op: str
    msg_bytes: int
    numel: int
    world: int
    start: float
    end: Optional[float] = None
    caller: str = ""  # the function that issued it (comms_logger.debug)

    @property
    def ring_bytes(self) -> float:
        return self.msg_bytes * _RING_FACTOR[self.op](self.world)

    @property
    def paper_bytes(self) -> float:
        return self.msg_bytes * _PAPER_FACTOR[self.op]


class CommsLogger:
    """Counts every collective: per-op totals always (cheap, bounded); per-call records when ``keep_records``.

    Per-call records are kept in a ring of ``max_records`` so a long run cannot grow without bound. The
    ``comms_logger`` block's switches: ``verbose`` logs one line per collective as it completes (time,
    size, algorithm and bus bandwidth, as DeepSpeed prints them); ``ops`` (``prof_ops`` when ``prof_all`` is
    false) limits the records and lines to those collectives (the totals still count every one: the byte
    accounting stays whole); ``debug`` names the function that issued each one.
    """

    def __init__(self, keep_records: bool = False, max_records: int = 100_000, *, verbose: bool = False,
                 ops: Optional[Sequence[str]] = None, debug: bool = False):
        self.keep_records = keep_records
        self.verbose = verbose
        self.ops = frozenset(ops) if ops is not None else None
        self.debug = debug
        self.records: Deque[CommRecord] = deque(maxlen=max_records)
        self._totals: Dict[str, Dict[str, float]] = OrderedDict()

    def profiled(self, op: str) -> bool:
        """Whether ``op``'s calls are recorded and printed (``prof_all``, or listed in ``prof_ops``)."""
        return self.ops is None or op in self.ops

    def start(self, op: str, tensor: torch.Tensor, world: int) -> CommRecord:
        return self.start_bytes(op, tensor.numel() * tensor.element_size(), tensor.numel(), world)

    def start_bytes(self, op: str, msg_bytes: int, numel: int, world: int) -> CommRecord:
        """As :meth:`start`, for a message that is not one tensor (objects: their pickled size; barrier: 0)."""
        rec = CommRecord(op, int(msg_bytes), int(numel), world, time.perf_counter())
        s = self._totals.get(op)
        if s is None:
            s = self._totals[op] = dict(count=0, msg_bytes=0, ring_bytes=0.0, paper_bytes=0.0, seconds=0.0)
        s["count"] += 1
        s["msg_bytes"] += rec.msg_bytes
        s["ring_bytes"] += rec.ring_bytes
        s["paper_bytes"] += rec.paper_bytes
        if self.profiled(op):
            if self.debug:
                rec.caller = _caller()
            if self.keep_records:
                self.records.append(rec)
        return rec

    def finish(self, rec: CommRecord) -> None:
        rec.end = time.perf_counter()
        self._totals[rec.op]["seconds"] += rec.end - rec.start
        if self.verbose and self.profiled(rec.op):
            logger.info(describe_record(rec))

    def reset(self) -> None:
        self.records.clear()
        self._totals.clear()

    def summary(self) -> Dict[str, Dict[str, float]]:
        """Per op: count, message bytes, ring bytes per rank, paper bytes and seconds until completion."""
        return OrderedDict((op, dict(s)) for op, s in self._totals.items())

    def table(self) -> str:
        """A printable table of :meth:`summary`."""
        rows = [f"{'op':<16}{'count':>8}{'msg MB':>12}{'ring MB/rank':>14}{'seconds':>10}"]
        for op, s in self.summary().items():
            rows.append(
                f"{op:<16}{int(s['count']):>8}{s['msg_bytes'] / 2**20:>12.2f}"
                f"{s['ring_bytes'] / 2**20:>14.2f}{s['seconds']:>10.4f}"
            )
        return "\n".join(rows)


def _caller() -> str:
    """``module.function`` of the first frame outside this file (the code that issued the collective)."""
    frame = inspect.currentframe()
    while frame is not None and frame.f_code.co_filename == __file__:
        frame = frame.f_back
    if frame is None:
        return "?"
    module = frame.f_globals.get("__name__", "?").rsplit(".", 1)[-1]
    return f"{module}.{frame.f_code.co_name}"


def _size(nbytes: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if nbytes < 1024 or unit == "GB":
            return f"{nbytes:.2f} {unit}"
        nbytes /= 1024
    return f"{nbytes:.2f} GB"


def describe_record(rec: CommRecord) -> str:
    """One completed collective as DeepSpeed's verbose comms logger prints it."""
    seconds = max((rec.end or rec.start) - rec.start, 1e-12)
    rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
    line = (f"rank={rank} | comm op: {rec.op} | time (ms): {seconds * 1e3:.2f} | msg size: {_size(rec.msg_bytes)} "
            f"| algbw (Gbps): {rec.msg_bytes * 8 / seconds / 1e9:.2f} | busbw (Gbps): "
            f"{rec.ring_bytes * 8 / seconds / 1e9:.2f}")
    return line + (f" | caller: {rec.caller}" if rec.caller else "")


class CommHandle:
    """An issued collective: ``wait()`` blocks until it is done (a host sync point)."""

    __slots__ = ("tensor", "_work", "_record", "_describe", "_log")

    def __init__(self, tensor: torch.Tensor, work, record: CommRecord, describe: str, log: CommsLogger):
        self.tensor = tensor
        self._work = work
        self._record = record
        self._describe = describe
        self._log = log

    def is_completed(self) -> bool:
        """Non-blocking: has the collective finished (an error surfaces at :meth:`wait`)."""
        return self._work is None or self._work.is_completed()

    def wait(self) -> torch.Tensor:
        if self._work is not None:
            try:
                self._work.wait()
            except RuntimeError as exc:  # gloo/nccl raise RuntimeError subclasses on timeout or peer loss
                raise _explain(self._describe, exc) from exc
            self._work = None
            self._log.finish(self._record)
        return self.tensor


def _explain(describe: str, exc: BaseException, cause: Optional[str] = None) -> DistributedError:
    first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    cause = cause or "ranks ran different numbers of steps or took different code paths"
    return DistributedError(
        f"collective {describe} failed: {first}. Another rank probably died, or {cause}; look at the other "
        f"ranks' logs for the first error."
    )


class Collectives:
    """The collectives of one topology's data-parallel group, each logged. A failed one raises a
    `DistributedError` naming the operation and the group: its mesh dimension and global ranks."""

    #: gloo: gathers whose per-rank piece is at least this large run as broadcasts (:func:`_broadcast_gather`)
    gloo_broadcast_bytes: int = 64 * 2**10
    #: gloo: reduce-scatters whose per-rank chunk is at least this large run as point-to-point exchanges
    #: (:func:`_exchange_reduce_scatter`: half the bytes of gloo's own; 1.2-1.6x faster on loopback)
    gloo_exchange_bytes: int = 64 * 2**10

    def __init__(self, topology: Topology, logger_: Optional[CommsLogger] = None,
                 _names_group: bool = True):
        self.topology = topology
        self.group = topology.shard_group
        self.world = topology.shard_size
        self.log = logger_ if logger_ is not None else CommsLogger()
        self._is_gloo = self.world > 1 and dist.get_backend(self.group) == "gloo"
        #: "over the data group (global ranks [0, 2])": what the error messages name the group by
        self.where = f"over {describe_group(self.group, topology if _names_group else None)}" if self.world > 1 else ""

    @classmethod
    def over(cls, group: Optional[dist.ProcessGroup], logger_: Optional[CommsLogger] = None) -> Collectives:
        """The collectives of another process group of the mesh (model, pipe, a tie group; None: the world),
        logged into ``logger_``."""
        return cls(Topology.data_parallel(group), logger_, _names_group=False)

    def _run(self, op: str, fn, tensor: torch.Tensor, out: torch.Tensor, async_op: bool) -> CommHandle:
        rec = self.log.start(op, tensor, self.world)
        describe = f"{op}({tensor.numel()} x {tensor.dtype}) {self.where}"
        if self.world == 1:
            self.log.finish(rec)
            return CommHandle(out, None, rec, describe, self.log)
        try:
            work = fn(async_op)
        except RuntimeError as exc:
            raise _explain(describe, exc) from exc
        handle = CommHandle(out, work, rec, describe, self.log)
        if not async_op:
            handle._work = None
            self.log.finish(rec)
        return handle

    def all_reduce(self, tensor: torch.Tensor, op=dist.ReduceOp.SUM, async_op: bool = False) -> CommHandle:
        return self._run(
            "all_reduce", lambda a: dist.all_reduce(tensor, op=op, group=self.group, async_op=a), tensor, tensor, async_op
        )

    def reduce_scatter(self, output: torch.Tensor, input: torch.Tensor, async_op: bool = False) -> CommHandle:
        """Sum ``input`` over ranks; this rank receives chunk ``shard_rank`` into ``output`` (which may be that
        chunk of ``input``). On gloo a chunk of :attr:`gloo_exchange_bytes` or more is reduced by
        point-to-point exchanges (:func:`_exchange_reduce_scatter`)."""
        if self.world == 1:
            if output.data_ptr() != input.data_ptr():
                output.copy_(input)
            return self._run("reduce_scatter", None, input, output, async_op)
        if self._is_gloo and output.numel() * output.element_size() >= self.gloo_exchange_bytes:
            def fn(a: bool) -> Any:
                return _exchange_reduce_scatter(output, input, self.group, a)
        else:
            def fn(a: bool) -> Any:
                return _reduce_scatter_tensor(output, input, group=self.group, async_op=a, chunks=self._is_gloo)
        return self._run("reduce_scatter", fn, input, output, async_op)

    def all_gather(self, output: torch.Tensor, input: torch.Tensor, async_op: bool = False) -> CommHandle:
        """Concatenate every rank's ``input`` into ``output`` (in rank order).

        On gloo, whose all-gather holds a temporary as large as its whole output (a second copy of the model
        for the gather after a stage 1-2 step; a second gathered unit for each stage-3 prefetch in flight), a
        piece of :attr:`gloo_broadcast_bytes` or more is gathered by one broadcast per rank into ``output``'s
        chunks instead, asynchronously too (a smaller one's temporary is small).
        """
        if self.world == 1:
            if output.data_ptr() != input.data_ptr():
                output.copy_(input)
            return self._run("all_gather", None, output, output, async_op)
        if self._is_gloo and input.numel() * input.element_size() >= self.gloo_broadcast_bytes:
            def fn(a: bool) -> Any:
                return _broadcast_gather(output, input, self.group, a)
        else:
            def fn(a: bool) -> Any:
                return _all_gather_tensor(output, input, group=self.group, async_op=a)
        return self._run("all_gather", fn, output, output, async_op)

    def all_to_all_single(self, output: torch.Tensor, input: torch.Tensor, async_op: bool = False,
                          output_split_sizes: Optional[List[int]] = None,
                          input_split_sizes: Optional[List[int]] = None) -> CommHandle:
        """Row ``r`` of ``input`` (dim 0 split in ``world`` equal parts, or by ``input_split_sizes``) goes to rank
        ``r``; ``output``'s row ``r`` (``output_split_sizes[r]`` rows) comes from rank ``r``."""
        if self.world == 1:
            if output.data_ptr() != input.data_ptr():
                output.copy_(input)
            return self._run("all_to_all", None, input, output, async_op)
        return self._run(
            "all_to_all", lambda a: dist.all_to_all_single(output, input, output_split_sizes, input_split_sizes,
                                                           group=self.group, async_op=a), input, output, async_op
        )

    def broadcast(self, tensor: torch.Tensor, src_rank: int = 0, async_op: bool = False) -> CommHandle:
        src = _global_rank(self.group, src_rank)
        return self._run(
            "broadcast", lambda a: dist.broadcast(tensor, src=src, group=self.group, async_op=a), tensor, tensor, async_op
        )

    # ---- small collectives on Python objects (checkpoint coordination); synchronous, logged --------------
    def _run_object(self, op: str, fn, nbytes: int, cause: Optional[str]) -> None:
        rec = self.log.start_bytes(op, nbytes, 0, self.world)
        try:
            fn()
        except RuntimeError as exc:  # gloo/nccl: timeout or a peer gone
            raise _explain(f"{op} {self.where}", exc, cause) from exc
        finally:
            self.log.finish(rec)

    def all_reduce_model_parallel(self, tensor: torch.Tensor) -> None:
        """Sum ``tensor`` over the model-parallel group (pipe × model: every rank holding part of this rank's
        model replica), e.g. a squared gradient norm; nothing when that group has one rank. Logged; a sync
        point."""
        topo = self.topology
        if topo.pipe_model_size == 1:
            return
        rec = self.log.start("all_reduce", tensor, topo.pipe_model_size)
        try:
            dist.all_reduce(tensor, group=topo.pipe_model_group)
        except RuntimeError as exc:
            raise _explain(f"all_reduce({tensor.numel()} x {tensor.dtype}) over the model-parallel group (pipe × "
                           f"model, global ranks {group_ranks(topo.pipe_model_group)})", exc) from exc
        self.log.finish(rec)

    def barrier(self, cause: Optional[str] = None) -> None:
        """Wait until every rank of the group arrives (logged with 0 bytes). ``cause``: what a failure most
        likely means, for the error message (e.g. "not every rank called save_checkpoint")."""
        if self.world == 1:
            self.log.finish(self.log.start_bytes("barrier", 0, 0, 1))
            return
        self._run_object("barrier", lambda: dist.barrier(group=self.group), 0, cause)

    def all_gather_object(self, obj: Any, cause: Optional[str] = None) -> List[Any]:
        """Every rank's (picklable) ``obj``, in rank order. Logged with this rank's pickled size as bytes."""
        if self.world == 1:
            self.log.finish(self.log.start_bytes("all_gather_object", 0, 0, 1))
            return [obj]
        out: List[Any] = [None] * self.world
        nbytes = len(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL))
        self._run_object("all_gather_object", lambda: dist.all_gather_object(out, obj, group=self.group), nbytes,
                         cause)
        return out

    def broadcast_object(self, obj: Any, src_rank: int = 0, cause: Optional[str] = None) -> Any:
        """``obj`` of group rank ``src_rank`` on every rank. Logged with the source's pickled size on the
        source and 0 bytes elsewhere (the receivers do not know the size before the call)."""
        if self.world == 1:
            self.log.finish(self.log.start_bytes("broadcast_object", 0, 0, 1))
            return obj
        box = [obj]
        src = _global_rank(self.group, src_rank)
        nbytes = len(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)) if self.topology.shard_rank == src_rank else 0
        self._run_object("broadcast_object",
                         lambda: dist.broadcast_object_list(box, src=src, group=self.group), nbytes, cause)
        return box[0]

