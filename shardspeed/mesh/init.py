"""Process-group start-up from torchrun's environment (never a home-made launcher)."""
from __future__ import annotations

import datetime
import logging
import math
import os
import socket
import time
from typing import Any, Dict, Optional, Sequence

import torch
import torch.distributed as dist

from ..errors import ConfigError
from ..utils.env import DEFAULT_TIMEOUT_S as DEFAULT_TIMEOUT_S, collective_timeout_s

logger = logging.getLogger(__name__)


_LOOPBACK = ("127.0.0.1", "localhost", "::1")


def _torch_at_least(major: int, minor: int) -> bool:
    parts = torch.__version__.split("+")[0].split(".")
    return (int(parts[0]), int(parts[1])) >= (major, minor)


def loopback_store(port: int, world_size: int, is_master: bool, timeout: datetime.timedelta) -> dist.TCPStore:
    """A TCPStore on 127.0.0.1 whose server (on the master) listens on loopback only: torch's server binds every
    interface when it opens the port itself, so the master opens a socket bound to 127.0.0.1 and hands it over
    (``master_listen_fd``; libuv's server takes one from torch 2.8, the older server before). ``port`` 0: any."""
    if not is_master:
        return dist.TCPStore("127.0.0.1", port, world_size, False, timeout=timeout)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.bind(("127.0.0.1", port))
        sock.listen(max(world_size, 128))
        port = sock.getsockname()[1]
        fd = sock.detach()  # the store's server owns the socket from here
    except OSError:
        sock.close()
        raise
    try:
        return dist.TCPStore("127.0.0.1", port, world_size, True, timeout=timeout, wait_for_workers=False,
                             master_listen_fd=fd, use_libuv=_torch_at_least(2, 8))
    except BaseException:
        os.close(fd)
        raise


def default_backend() -> str:
    """NCCL when CUDA is usable, gloo otherwise."""
    return "nccl" if torch.cuda.is_available() and dist.is_nccl_available() else "gloo"


def init_distributed(
    backend: Optional[str] = None,
    timeout: Optional[float] = None,
    init_method: Optional[str] = None,
) -> None:
    """Create the default process group if there is none.

    Reads torchrun's variables (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT). Without them
    (plain ``python train.py``) a one-process group is created so the same code path runs, its store listening
    on 127.0.0.1 only. With MASTER_ADDR on loopback and no store shared by torchrun's agent, rank 0's store
    listens on 127.0.0.1 only too (:func:`loopback_store`).
    ``timeout`` (seconds, default ``SHARDSPEED_TIMEOUT`` or 600) bounds every collective: a rank that
    died or took another path makes the others fail instead of hanging.
    """
    if dist.is_initialized():
        return
    backend = backend or default_backend()
    timeout_s = collective_timeout_s() if timeout is None else float(timeout)
    if not math.isfinite(timeout_s) or timeout_s <= 0:
        raise ConfigError(f"init_distributed(timeout={timeout!r}) is invalid: it must be a finite number of "
                          "seconds > 0")
    kwargs: Dict[str, Any] = dict(backend=backend, timeout=datetime.timedelta(seconds=timeout_s))
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        if backend == "nccl":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        if init_method is None and _hosts_loopback_store():
            rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
            kwargs.update(rank=rank, world_size=world, store=loopback_store(
                int(os.environ["MASTER_PORT"]), world, rank == 0, kwargs["timeout"]))
        else:
            kwargs["init_method"] = init_method or "env://"
            if not kwargs["init_method"].startswith("env://"):  # file:// and tcp:// take rank and size as arguments
                kwargs.update(rank=int(os.environ["RANK"]), world_size=int(os.environ["WORLD_SIZE"]))
        dist.init_process_group(**kwargs)
    elif init_method is not None:
        dist.init_process_group(init_method=init_method, rank=0, world_size=1, **kwargs)
    else:  # plain `python train.py`: a store nothing outside this machine can reach
        dist.init_process_group(store=loopback_store(0, 1, True, kwargs["timeout"]), rank=0, world_size=1, **kwargs)
    logger.info("initialised %s process group: rank %d of %d", backend, dist.get_rank(), dist.get_world_size())


def _hosts_loopback_store() -> bool:
    """Whether this job's ranks build their own store on a loopback MASTER_ADDR (``shardspeed run`` on one node
    gives 127.0.0.1), so that rank 0's server listens on loopback only; not when torchrun shares its agent's."""
    return (os.environ.get("MASTER_ADDR", "") in _LOOPBACK and os.environ.get("MASTER_PORT", "").isdigit()
            and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True")


def group_timeout(group: Optional[dist.ProcessGroup] = None) -> datetime.timedelta:
    """How long a collective of ``group`` (default: the world group) may wait, read back from torch.

    Every group shardspeed creates is given the world group's, the one :func:`init_distributed` set
    (``timeout``, else ``SHARDSPEED_TIMEOUT``), or the one the user's own ``init_process_group`` chose;
    torch's default for a new group would be 30 minutes. ``SHARDSPEED_TIMEOUT`` (or 600) if torch does not say."""
    pg = group if group is not None else dist.distributed_c10d._get_default_group()
    for device in getattr(pg, "_device_types", ()):
        try:
            timeout = pg._get_backend(device).options._timeout
        except (AttributeError, RuntimeError):  # a backend without options (a plugin, a fake one)
            continue
        if isinstance(timeout, datetime.timedelta):
            return timeout
    return datetime.timedelta(seconds=collective_timeout_s())


def new_group(ranks: Sequence[int], desc: Optional[str] = None) -> dist.ProcessGroup:
    """``dist.new_group(ranks)`` with the world group's timeout (:func:`group_timeout`); collective over
    the world (every rank creates every group, in the same order). ``desc``: the group's description
    (``ProcessGroup.group_desc``), which error messages name it by."""
    return dist.new_group(ranks=sorted(ranks), timeout=group_timeout(), group_desc=desc)


def backend_options(timeout: datetime.timedelta) -> Any:
    """Options of the default group's backend carrying ``timeout``, for a group torch creates itself
    (``init_device_mesh(backend_override=...)``, whose groups would otherwise get torch's 30-minute
    default); None for a backend other than gloo and NCCL (its groups keep torch's default). A new object
    per call: torch keeps the object in the group it creates."""
    backend = str(dist.get_backend())
    if "nccl" in backend:
        nccl = getattr(dist, "ProcessGroupNCCL", None)
        if nccl is None:
            return None
        opts = nccl.Options()
        opts._timeout = timeout
        return opts
    gloo = getattr(dist, "ProcessGroupGloo", None)
    if backend == "gloo" and gloo is not None:
        return gloo.Options("gloo", timeout)
    return None


def _wait_count(store: Any, key: str, target: int, timeout: float) -> bool:
    """Poll the store's counter ``key`` until it reaches ``target``; False after ``timeout`` seconds."""
    deadline, pause = time.monotonic() + timeout, 0.005
    while store.add(key, 0) < target:
        if time.monotonic() > deadline:
            return False
        time.sleep(pause)
        pause = min(pause * 2, 0.1)
    return True


def _shutdown_prefix(store: Any, world: int) -> str:
    """The store keys of this shutdown, distinct from an earlier one's on the same store (a store torchrun's
    agent shares across process groups): each rank counts itself in; the ranks of one shutdown, which all
    returned from the earlier one before the barrier that precedes this, draw numbers from the same block of
    ``world``."""
    base = f"shardspeed/shutdown/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}/w{world}/"
    round_ = (store.add(base + "calls", 1) - 1) // world
    return f"{base}{round_}/"


def shutdown_distributed(timeout: float = 60.0) -> None:
    """Destroy every process group so that no rank can fail in the teardown; call it on every rank at the
    end of training (it replaces ``dist.barrier(); dist.destroy_process_group()``). Nothing to do when no
    process group exists.

    A barrier alone does not order the ranks' exits, and a rank that leaves first can make another one
    exit with an error (its exit status is not 0, and torchrun under ``--max-restarts`` restarts the whole
    finished job): rank 0 hosts the rendezvous TCPStore whenever torchrun does not share its own (with
    ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``, which ``shardspeed run --max-restarts`` sets, and under
    plain ``env://``/``tcp://``), and gloo closes its connections in ``destroy_process_group`` while a
    slower peer may still be finishing the barrier on them. So:

    1. a barrier over the default group: every rank has finished its collectives;
    2. a second barrier through the store (not the backend): every rank has returned from the first, so
       no backend operation is pending anywhere when the connections close;
    3. ``destroy_process_group()`` on every rank;
    4. the ranks > 0 tell the store they are done and return; rank 0 returns (and its process may exit,
       taking the store's server with it) only once they all have, or after ``timeout`` seconds.
    """
    if not (dist.is_available() and dist.is_initialized()):
        return
    rank, world = dist.get_rank(), dist.get_world_size()
    if world == 1:
        dist.destroy_process_group()
        return
    from torch.distributed.distributed_c10d import _get_default_store  # the store the groups were made with

    store = _get_default_store()  # held until the end: on rank 0 it may own the server
    dist.barrier()
    try:
        prefix = _shutdown_prefix(store, world)
        store.add(prefix + "arrived", 1)
        if not _wait_count(store, prefix + "arrived", world, timeout):
            logger.warning("shutdown: not every rank reached the end within %.0f s; destroying the groups", timeout)
    except (RuntimeError, OSError) as e:  # a torch store error (DistStoreError is a RuntimeError)
        logger.warning("shutdown: the store barrier failed (%s); destroying the groups", e)
        dist.destroy_process_group()
        return
    dist.destroy_process_group()
    try:
        if rank != 0:
            store.add(prefix + "left", 1)
        elif not _wait_count(store, prefix + "left", world - 1, timeout):
            logger.warning("shutdown: not every rank left within %.0f s", timeout)
    except (RuntimeError, OSError) as e:
        logger.warning("shutdown: %s", e)


def local_device() -> torch.device:
    """The device this rank computes on: its CUDA device under NCCL, else the CPU."""
    if torch.cuda.is_available() and dist.is_initialized() and dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")
