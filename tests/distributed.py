"""Run a function on N gloo ranks on loopback, each in its own process.

``run_distributed(fn, world_size, *args)`` returns each rank's return value (rank order). Any rank's
exception fails the call with that rank's traceback; a group that does not finish within ``timeout``
seconds is killed and reported. Processes come from a forkserver that has torch imported already, so a
group starts in well under a second after the first.
"""
from __future__ import annotations

import io
import multiprocessing as mp
import os
import queue
import socket
import subprocess
import sys
import traceback
from typing import Any, Callable, List, Sequence

_CTX = None


def _context():
    global _CTX
    if _CTX is None:
        _CTX = mp.get_context("forkserver")
        # transformers' model code costs seconds per rank to import (torch.distributed.tensor, its loaders):
        # imported once in the server, a rank of a transformers test starts without it (skipped if absent)
        _CTX.set_forkserver_preload(["torch", "torch.distributed", "shardspeed",
                                     "transformers.models.llama.modeling_llama"])
    return _CTX


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(fn, rank, world_size, port, results, args, kwargs, collective_timeout, final_barrier):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world_size))
    try:
        import torch
        torch.set_num_threads(1)
        import torch.distributed as dist

        from shardspeed.mesh import init_distributed

        init_distributed(backend="gloo", timeout=collective_timeout)
        out = fn(*args, **kwargs)
        buf = io.BytesIO()
        torch.save(out, buf)  # plain bytes: tensors must not travel as shared-memory handles
        results.put((rank, "ok", buf.getvalue()))
        if final_barrier:
            dist.barrier()
            dist.destroy_process_group()
    except BaseException:  # report everything, including SystemExit from a test helper
        results.put((rank, "error", traceback.format_exc()))


def run_distributed(fn: Callable, world_size: int, *args, timeout: float = 180.0,
                    collective_timeout: float = 60.0, may_die: Sequence[int] = (), final_barrier: bool = True,
                    **kwargs) -> List[Any]:
    """``may_die``: ranks allowed to exit without reporting (fault tests); their result is None, and no rank ends
    with the final barrier (a survivor's barrier with a dead peer fails, racing the dead rank's exit)."""
    final_barrier = final_barrier and not may_die
    ctx = _context()
    results = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_worker, args=(fn, r, world_size, port, results, args, kwargs, collective_timeout,
                                                      final_barrier),
                         daemon=True) for r in range(world_size)]
    for p in procs:
        p.start()
    out: dict = {}
    errors = []
    import time
    deadline = time.monotonic() + timeout
    try:
        def settled() -> int:
            gone = [i for i in may_die if i not in out and procs[i].exitcode is not None]
            return len(out) + len(gone)

        while settled() < world_size:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError(f"{world_size}-rank group did not finish within {timeout}s "
                                   f"(finished ranks: {sorted(out)})")
            try:
                rank, status, payload = results.get(timeout=min(remaining, 1.0))
            except queue.Empty:
                dead = [i for i, p in enumerate(procs)
                        if p.exitcode not in (None, 0) and i not in out and i not in may_die]
                if dead and not errors:
                    raise RuntimeError(f"rank(s) {dead} exited with code(s) {[procs[i].exitcode for i in dead]} "
                                       f"without reporting") from None
                continue
            if status == "ok":
                import torch
                out[rank] = torch.load(io.BytesIO(payload), weights_only=False)
            else:
                errors.append((rank, payload))
                break  # one failure is enough: the others would fail or hang on it
    finally:
        for p in procs:
            p.join(timeout=5 if not errors else 0.5)
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join()
    if errors:
        rank, tb = errors[0]
        raise AssertionError(f"rank {rank} failed:\n{tb}")
    return [out.get(r) for r in range(world_size)]


def one_and_two_rank_fixtures(fn: Callable, timeout: float = 300.0):
    """Pytest fixtures for tests that check a part alone on a 1-rank and a 2-rank group: ``world1`` and
    ``world2`` (each rank's return value of ``fn``, run once per module) and ``ranks`` (each of the two in
    turn). Use as ``world1, world2, ranks = one_and_two_rank_fixtures(_run)`` at module level."""
    import pytest

    @pytest.fixture(scope="module")
    def world2():
        return run_distributed(fn, 2, timeout=timeout)

    @pytest.fixture(scope="module")
    def world1():
        return run_distributed(fn, 1, timeout=timeout)

    @pytest.fixture(params=["world1", "world2"])
    def ranks(request):
        return request.getfixturevalue(request.param)

    return world1, world2, ranks


def launch_pair_worker(worker: str, out: str, ours: bool, world: int = 2,
                       args: Sequence[str] = ()) -> subprocess.Popen:
    """``worker`` on ``world`` ranks under torchrun, writing to ``out`` (its first argument; ``args`` follow):
    with real DeepSpeed (``ours`` False) or with shardspeed's ``deepspeed`` package first on the path
    (``ours`` True)."""
    from shardspeed.compat import site_path

    repo = os.path.dirname(os.path.dirname(os.path.abspath(worker)))
    path = os.pathsep.join(([site_path()] if ours else []) + [repo])
    env = dict(os.environ, PYTHONPATH=path, DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", str(world),
           "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{free_port()}", worker, out, *args]
    return subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def run_pair_workers(worker: str, tmp_path_factory, world: int = 2, args: Sequence[str] = ()) -> dict:
    """:func:`launch_pair_worker` with real DeepSpeed and with ours at once; both must succeed. Returns each
    run's output folder by name ("real", "ours")."""
    out = {name: str(tmp_path_factory.mktemp(name)) for name in ("real", "ours")}
    procs = {name: launch_pair_worker(worker, folder, name == "ours", world, args) for name, folder in out.items()}
    for name, proc in procs.items():
        log, _ = proc.communicate(timeout=480)
        assert proc.returncode == 0, f"{name}:\n{log[-4000:]}"
    return out
