"""Run several systems side by side, interleaved, each in its own group of worker processes.

Why one process group of workers per system (all alive at once) rather than one set of processes that
runs every system in turn: peak memory. A process's high-water mark (``VmHWM``) only grows, and freed
memory mostly stays mapped in the allocator, so a second system built in a process that ran a first one
would inherit its peak. Here each system's ranks are fresh processes: the peak we report is that system's
own ``VmHWM`` (reset with ``/proc/self/clear_refs`` after imports and process-group setup), and the
*delta* is the peak minus the resident size just before the model was built (so torch's and DeepSpeed's
import footprints, which differ, do not count). Timing is still interleaved: the coordinator tells one
system at a time to run a short block of steps, rotating the order every round, so that machine drift
(other jobs on this 2-core box) hits every system alike. Idle systems block on a queue and use no CPU.

Bytes communicated: every worker wraps ``torch.distributed``'s collectives (all_reduce, all_gather*,
reduce_scatter*, broadcast, ...) with a counter before anything is built, so DeepSpeed, FSDP2 and
shardspeed are counted by the same code. DDP's reducer calls the process group from C++, out of the
wrapper's sight: its bytes come from DDP's own bucket sizes (every bucket is all-reduced once per step).
"""
from __future__ import annotations

import functools
import multiprocessing as mp
import os
import queue
import socket
import statistics
import sys
import time
import traceback
from typing import Any, Dict, List, Tuple

from shardspeed.autotune.probe import reset_peak_rss  # noqa: F401  (re-exported for the benchmarks)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# ---- measuring -----------------------------------------------------------------------------------------


def proc_status_kb(field: str) -> int:
    """A ``kB`` field of /proc/self/status (0 where there is none)."""
    from shardspeed.autotune.probe import proc_status_bytes

    return (proc_status_bytes(field) or 0) // 1024


PAPER_FACTOR = {"all_reduce": 2.0, "reduce_scatter": 1.0, "all_gather": 1.0, "broadcast": 1.0}
_COLLECTIVES = [
    "all_reduce", "all_reduce_coalesced", "reduce", "broadcast",
    "all_gather", "all_gather_into_tensor", "_all_gather_base", "all_gather_single",
    "reduce_scatter", "reduce_scatter_tensor", "_reduce_scatter_base", "reduce_scatter_single",
    "all_to_all", "all_to_all_single",
]


def _family(name: str) -> str:
    for fam in ("all_reduce", "all_gather", "reduce_scatter", "broadcast", "all_to_all"):
        if name.startswith(fam) or name.startswith("_" + fam):
            return fam
    return name


def _bytes(obj) -> int:
    import torch

    if torch.is_tensor(obj):
        return obj.numel() * obj.element_size()
    if isinstance(obj, (list, tuple)) and obj and all(torch.is_tensor(t) for t in obj):
        return sum(t.numel() * t.element_size() for t in obj)
    return 0


class CommCounter:
    """Counts message bytes of every Python-level collective (outermost call only).

    Message size convention (same as shardspeed's comms log): the largest tensor argument, i.e. the full
    buffer: the tensor of an all-reduce, the output of an all-gather, the input of a reduce-scatter.
    """

    def __init__(self):
        self.active = False
        self.depth = 0
        self.totals: Dict[str, Dict[str, float]] = {}

    def install(self) -> None:
        import torch.distributed as dist
        import torch.distributed.distributed_c10d as c10d

        for name in _COLLECTIVES:
            for mod in (dist, c10d):
                fn = getattr(mod, name, None)
                if fn is None or getattr(fn, "_counted", False):
                    continue
                setattr(mod, name, self._wrap(name, fn))

    def _wrap(self, name, fn):
        counter = self

        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            outer = counter.depth == 0
            if outer and counter.active:
                msg = max([_bytes(a) for a in args] + [_bytes(v) for v in kwargs.values()] + [0])
                s = counter.totals.setdefault(_family(name), {"count": 0, "msg_bytes": 0.0})
                s["count"] += 1
                s["msg_bytes"] += msg
            counter.depth += 1
            try:
                return fn(*args, **kwargs)
            finally:
                counter.depth -= 1

        wrapper._counted = True  # type: ignore[attr-defined]
        return wrapper

    def reset(self) -> None:
        self.totals = {}


# ---- the worker ------------------------------------------------------------------------------------------


def next_result(res_q, procs, system: str, deadline: float) -> Tuple[int, str, Any]:
    """The next ``(rank, kind, payload)`` a worker reported; a RuntimeError when a worker reported an error,
    died, or nothing came before ``deadline`` (time.monotonic())."""
    while True:
        try:
            rank, kind, payload = res_q.get(timeout=max(0.1, min(5.0, deadline - time.monotonic())))
        except queue.Empty:
            dead = [p.exitcode for p in procs if p.exitcode not in (None, 0)]
            if dead or time.monotonic() > deadline:
                raise RuntimeError(f"{system}: workers died or timed out (exit codes {dead})") from None
            continue
        if kind == "error":
            raise RuntimeError(f"{system} rank {rank} failed:\n{payload}")
        return rank, kind, payload


def spawn_workers(target, world: int, make_args) -> Tuple[List[Any], Any]:
    """Start ``world`` fresh worker processes (the forkserver context) on a free port, rank ``r`` running
    ``target(*make_args(r, port, q))``; the processes and the result queue ``q`` they report on."""
    ctx = _ctx()
    q = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=target, daemon=True, args=make_args(r, port, q)) for r in range(world)]
    for p in procs:
        p.start()
    return procs, q


def stop_workers(procs, timeout: float) -> None:
    """Wait up to ``timeout`` seconds for each worker to exit, then kill it."""
    for p in procs:
        p.join(timeout=timeout)
        if p.is_alive():
            p.kill()


def run_once(target, world: int, args: tuple, timeout: float, what: str) -> Any:
    """Spawn ``world`` workers ``target(rank, world, port, *args, q)`` on a free port, wait for the one
    ``("ok" | "error", value)`` a worker puts on ``q``, then stop them all: the value, or a RuntimeError
    naming ``what`` with the worker's traceback."""
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=target, args=(r, world, port, *args, q), daemon=True) for r in range(world)]
    for pr in procs:
        pr.start()
    status, value = q.get(timeout=timeout)
    for pr in procs:
        pr.join(timeout=30)
        if pr.is_alive():
            pr.kill()
    if status != "ok":
        raise RuntimeError(f"{what} failed:\n{value}")
    return value


def worker_setup(rank: int, world: int, port: int, threads: int) -> None:
    """A benchmark worker's start: torchrun's variables, quiet logs, ``threads`` intra-op threads."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world), DS_ACCELERATOR="cpu")
    if ROOT not in sys.path:
        sys.path.insert(0, ROOT)
    import logging
    import warnings

    import torch

    logging.disable(logging.WARNING)
    warnings.filterwarnings("ignore")
    torch.set_num_threads(threads)


def init_gloo(rank: int, world: int) -> None:
    """The worker's gloo process group (generous timeout: a loaded box is slow, not dead)."""
    import datetime

    import torch.distributed as dist

    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=600))


BASE_SRC_ENV = "SHARDSPEED_BENCH_BASE_SRC"
BASE_SUFFIX = "@base"  # a system named e.g. "ss3@base" runs the shardspeed of $SHARDSPEED_BENCH_BASE_SRC


def _worker(system: str, model_name: str, dtype: str, rank: int, world: int, port: int, cmd_q, res_q,
            total_steps: int, threads: int) -> None:
    worker_setup(rank, world, port, threads)
    if system.endswith(BASE_SUFFIX):  # a paired run: this group imports the other tree's shardspeed
        for name in [m for m in sys.modules if m == "shardspeed" or m.startswith("shardspeed.")]:
            del sys.modules[name]  # this module imported ours (reset_peak_rss)
        sys.path.insert(0, os.environ[BASE_SRC_ENV])
        system = system[: -len(BASE_SUFFIX)]
    try:
        import torch.distributed as dist

        counter = CommCounter()
        counter.install()  # before DeepSpeed is imported: it keeps references to some collectives
        init_gloo(rank, world)
        from benchmarks.models import MODELS, build_model, make_batch, num_params
        from benchmarks.systems import Skip, build_system

        if system.startswith("ds"):
            try:
                import deepspeed  # noqa: F401  (imported before the baseline so its footprint is not counted)
            except Exception:
                pass
        import shardspeed  # noqa: F401

        batches = [make_batch(model_name, i, world, rank) for i in range(total_steps)]
        import gc

        gc.collect()
        reset_ok = reset_peak_rss()
        rss_before = proc_status_kb("VmRSS")
        t0 = time.perf_counter()
        try:
            model = build_model(model_name)
            n_params = num_params(model)
            sysobj = build_system(system, model, MODELS[model_name]["batch"], dtype)
        except Skip as exc:
            res_q.put((rank, "skip", str(exc)))
            _idle_until_exit(cmd_q)
            return
        dist.barrier()
        res_q.put((rank, "ready", {"params": n_params, "build_s": time.perf_counter() - t0, "kernel": sysobj.kernel,
                                   "shardspeed_src": os.path.dirname(os.path.dirname(shardspeed.__file__)),
                                   "rss_before_kb": rss_before, "hwm_reset": reset_ok}))
        step_i, losses, counted_steps = 0, [], 0
        while True:
            cmd = cmd_q.get()
            if cmd[0] == "run":
                _, n, timed = cmd
                dist.barrier()
                times = []
                for _ in range(n):
                    x, y = batches[step_i]
                    counter.active = timed
                    t = time.perf_counter()
                    loss = sysobj.step(x, y)
                    lv = float(loss)
                    times.append(time.perf_counter() - t)
                    counter.active = False
                    losses.append(lv)
                    step_i += 1
                    counted_steps += timed
                if not timed:
                    sysobj.reset_library_comms()
                dist.barrier()
                res_q.put((rank, "done", times))
            elif cmd[0] == "report":
                comms = {k: dict(v) for k, v in counter.totals.items()}
                for op, b in sysobj.extra_comm_bytes().items():
                    s = comms.setdefault(op, {"count": 0, "msg_bytes": 0.0})
                    s["msg_bytes"] += b * counted_steps
                    s["count"] += counted_steps
                per_step = {op: {"count": v["count"] / max(counted_steps, 1), "msg_bytes": v["msg_bytes"] / max(counted_steps, 1)}
                            for op, v in comms.items()}
                lib = sysobj.library_comms()
                lib_per_step = None
                if lib is not None:
                    lib_per_step = {op: {k: float(v) / max(counted_steps, 1) for k, v in s.items()} for op, s in lib.items()}
                res_q.put((rank, "report", {
                    "losses": losses, "peak_rss_kb": proc_status_kb("VmHWM"), "rss_end_kb": proc_status_kb("VmRSS"),
                    "rss_before_kb": rss_before, "comms_per_step": per_step, "library_comms_per_step": lib_per_step,
                    "library_memory": sysobj.library_memory(), "steps": step_i,
                }))
            elif cmd[0] == "exit":
                break
        dist.barrier()
        dist.destroy_process_group()
    except BaseException:
        res_q.put((rank, "error", traceback.format_exc()))


def _last_line(text: str) -> str:
    lines = [ln for ln in text.strip().splitlines() if ln.strip()]
    return (lines[0] + " ... " + lines[-1]) if len(lines) > 1 else (lines[0] if lines else "")


def _idle_until_exit(cmd_q) -> None:
    while True:
        cmd = cmd_q.get()
        if cmd[0] == "exit":
            return


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


_CTX = None


def _ctx():
    global _CTX
    if _CTX is None:
        _CTX = mp.get_context("forkserver")
        _CTX.set_forkserver_preload(["torch", "torch.distributed"])
    return _CTX


class SystemGroup:
    """The ``world`` worker processes of one system."""

    def __init__(self, system: str, model_name: str, dtype: str, world: int, total_steps: int, threads: int = 1):
        ctx = _ctx()
        self.system, self.world = system, world
        self.res_q = ctx.Queue()
        self.cmd_qs = [ctx.Queue() for _ in range(world)]
        port = _free_port()
        self.procs = [ctx.Process(target=_worker, daemon=True,
                                  args=(system, model_name, dtype, r, world, port, self.cmd_qs[r], self.res_q,
                                        total_steps, threads)) for r in range(world)]
        for p in self.procs:
            p.start()
        self.status = "starting"
        self.message = ""
        self.info: Dict[str, Any] = {}

    def _collect(self, expect: str, timeout: float) -> List[Any]:
        out: Dict[int, Any] = {}
        deadline = time.monotonic() + timeout
        while len(out) < self.world:
            rank, kind, payload = next_result(self.res_q, self.procs, self.system, deadline)
            if kind == "skip":
                self.status, self.message = "skipped", payload
                return []
            if kind != expect:
                raise RuntimeError(f"{self.system}: expected {expect}, got {kind}")
            out[rank] = payload
        return [out[r] for r in range(self.world)]

    def wait_ready(self, timeout: float = 600) -> None:
        try:
            got = self._collect("ready", timeout)
        except RuntimeError as exc:
            self.status, self.message = "failed", str(exc)
            return
        if self.status != "skipped":
            self.status = "ok"
            self.info = dict(got[0], rss_before_kb=[g["rss_before_kb"] for g in got])

    def run(self, n: int, timed: bool, timeout: float = 900) -> List[float]:
        for q in self.cmd_qs:
            q.put(("run", n, timed))
        per_rank = self._collect("done", timeout)
        return [max(ts) for ts in zip(*per_rank)]  # a step ends when its slowest rank ends

    def report(self) -> List[dict]:
        for q in self.cmd_qs:
            q.put(("report",))
        return self._collect("report", 300)

    def close(self, kill: bool = False) -> None:
        if kill:  # interrupted: do not wait for workers that may be mid-step
            for p in self.procs:
                if p.is_alive():
                    p.kill()
            for p in self.procs:
                p.join()
            return
        for q in self.cmd_qs:
            try:
                q.put(("exit",))
            except Exception:
                pass
        for p in self.procs:
            p.join(timeout=20)
        for p in self.procs:
            if p.is_alive():
                p.kill()
                p.join()


def run_interleaved(systems: List[str], model_name: str, *, dtype: str = "fp32", world: int = 2, warmup: int = 2,
                    blocks: int = 3, steps_per_block: int = 3, log=print) -> Dict[str, dict]:
    """Build every system (each in its own worker group), then time them in rotating interleaved blocks."""
    total = warmup + blocks * steps_per_block
    groups = {s: SystemGroup(s, model_name, dtype, world, total) for s in systems}
    results: Dict[str, dict] = {}
    ok = False
    try:
        for s, g in groups.items():
            g.wait_ready()
            msg = f" ({g.message.splitlines()[0] if g.message else ''})" if g.status != "ok" else \
                  f" build {g.info['build_s']:.1f}s, optimizer kernel {g.info['kernel']}"
            if g.status == "failed":
                msg = "\n" + g.message
            log(f"  [{model_name}] {s:8s} {g.status}{msg}")
        live = [s for s in systems if groups[s].status == "ok"]
        first_step: Dict[str, float] = {}  # the first warm-up step (a compiled system compiles in it)
        for s in list(live):  # warm-up, untimed; a system that fails is reported, the others go on
            try:
                warm = groups[s].run(warmup, timed=False)
                if warm:
                    first_step[s] = warm[0]
            except RuntimeError as exc:
                groups[s].status, groups[s].message = "failed", _last_line(str(exc))
                log(f"  [{model_name}] {s} FAILED in warm-up: {groups[s].message}")
                live.remove(s)
        times: Dict[str, List[float]] = {s: [] for s in live}
        block_medians: Dict[str, List[float]] = {s: [] for s in live}
        for b in range(blocks):
            order = live[b % len(live):] + live[: b % len(live)] if live else []
            if b % 2 == 1:
                order = order[::-1]
            for s in order:
                if s not in live:
                    continue
                try:
                    ts = groups[s].run(steps_per_block, timed=True)
                except RuntimeError as exc:
                    groups[s].status, groups[s].message = "failed", _last_line(str(exc))
                    log(f"  [{model_name}] {s} FAILED: {groups[s].message}")
                    live.remove(s)
                    continue
                times[s].extend(ts)
                block_medians[s].append(statistics.median(ts))
            log(f"  [{model_name}] block {b + 1}/{blocks} (median so far): " + ", ".join(
                f"{s} {statistics.median(times[s]):.3f}s" for s in live))
        for s in systems:
            g = groups[s]
            if g.status != "ok":
                results[s] = {"system": s, "status": g.status, "message": g.message.splitlines()[0] if g.message else ""}
                continue
            reps = g.report()
            results[s] = summarise(s, model_name, dtype, world, g.info, times[s], reps)
            results[s]["block_medians"] = block_medians[s]
            results[s]["first_step_s"] = first_step.get(s)
        ok = True
    finally:
        for g in groups.values():
            g.close(kill=not ok)
    return results


ANCHORS = ("ddp", "fsdp2")


def plan_waves(systems: List[str], max_alive: int) -> List[List[str]]:
    """Split systems into waves of at most ``max_alive`` (memory: every live system holds its model).

    The anchors (DDP, FSDP2) run in every wave, and a shardspeed system always shares its wave with the
    DeepSpeed system of the same stage, so every ratio the report prints comes from one interleaved run.
    """
    anchors = [s for s in systems if s in ANCHORS]
    by_stage: Dict[str, List[str]] = {}
    for s in systems:
        if s not in ANCHORS:
            by_stage.setdefault(s[2:] if s[:2] in ("ss", "ds") else s, []).append(s)
    room = max(max_alive - len(anchors), 1)
    waves: List[List[str]] = []
    cur: List[str] = []
    for grp in by_stage.values():
        if cur and len(cur) + len(grp) > room:
            waves.append(cur)
            cur = []
        cur = cur + grp
    if cur or not waves:
        waves.append(cur)
    return [anchors + w for w in waves]


def run_waves(systems: List[str], model_name: str, *, max_alive: int = 8, add_ratios=None, log=print, **kw) -> Dict[str, dict]:
    """``run_interleaved`` over each wave; ratios are computed inside a wave, anchors reported from the first."""
    merged: Dict[str, dict] = {}
    waves = plan_waves(systems, max_alive)
    for i, wave in enumerate(waves):
        if len(waves) > 1:
            log(f"  [{model_name}] wave {i + 1}/{len(waves)}: {', '.join(wave)}")
        rows = run_interleaved(wave, model_name, log=log, **kw)
        if add_ratios is not None:
            add_ratios(rows)
        for s, r in rows.items():
            r["wave"] = i
            if s in merged:
                merged[s].setdefault("other_waves_median_step_s", []).append(r.get("median_step_s"))
            else:
                merged[s] = r
    return {s: merged[s] for s in systems if s in merged}


def summarise(system: str, model_name: str, dtype: str, world: int, info: dict, times: List[float],
              reps: List[dict]) -> dict:
    from benchmarks.models import tokens_per_step

    losses = [statistics.fmean(v) for v in zip(*[r["losses"] for r in reps])]
    comms = reps[0]["comms_per_step"]
    paper = sum(v["msg_bytes"] * PAPER_FACTOR.get(op, 1.0) for op, v in comms.items())
    med = statistics.median(times)
    q = statistics.quantiles(times, n=10) if len(times) >= 2 else [med] * 9
    lib = reps[0]["library_comms_per_step"]
    comm_source = "torch.distributed counter" + (" + DDP bucket sizes" if system == "ddp" else "")
    if lib:  # shardspeed: its own comms log (the same message-size convention), as issue 3 asks
        comms = {op: {"msg_bytes": v["msg_bytes"], "count": v["count"]} for op, v in lib.items()}
        paper = sum(v["paper_bytes"] for v in lib.values())
        comm_source = "shardspeed comms log"
    return {
        "system": system, "status": "ok", "model": model_name, "comm_source": comm_source, "dtype": dtype, "world": world,
        "params": info["params"], "optimizer_kernel": info["kernel"], "shardspeed_src": info.get("shardspeed_src"),
        "median_step_s": med, "p10_step_s": q[0], "p90_step_s": q[-1], "timed_steps": len(times),
        "tokens_per_s": tokens_per_step(model_name, world) / med,
        "peak_rss_mb": max(r["peak_rss_kb"] for r in reps) / 1024,
        "peak_rss_delta_mb": max(r["peak_rss_kb"] - r["rss_before_kb"] for r in reps) / 1024,
        "rss_end_delta_mb": max(r["rss_end_kb"] - r["rss_before_kb"] for r in reps) / 1024,
        "comm_bytes_per_step": {op: v["msg_bytes"] for op, v in comms.items()},
        "comm_calls_per_step": {op: v["count"] for op, v in comms.items()},
        "comm_paper_bytes_per_step": paper,
        "library_comms_per_step": reps[0]["library_comms_per_step"],
        "library_memory": reps[0]["library_memory"],
        "final_loss": losses[-1], "losses": losses, "step_times": times,
    }
