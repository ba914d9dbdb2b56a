"""``shardspeed run [--nproc N] [torchrun options] script.py [script args]``: a thin wrapper over torchrun.

It builds the argv of ``torch.distributed.run`` (:func:`~.args.build_torchrun_argv`) and calls its ``main``.
With ``--max-restarts`` > 0 it also sets ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` (unless set): see
:func:`_isolate_restarts`. The script runs under :mod:`shardspeed.bootstrap`, which records a ShardspeedError
instead of printing it on every rank; the launcher prints one line per distinct error (:func:`_launch`).
``--full-tracebacks`` (or ``SHARDSPEED_TRACEBACK=1``) runs the script directly, as torchrun alone would.
``--autotuning tune|run`` (DeepSpeed's flag) is taken out here and handed to ``shardspeed autotune``.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import tempfile
import uuid
from typing import Dict, Iterator, Sequence

from .args import (
    UsageError,
    build_torchrun_argv,
    canonical_option,
    command_option_arity,
    take_flag,
    take_options,
    torchrun_option_arity,
)
from .ds_options import Launch, resolve, take_deepspeed_options, this_machine

_RUN_USAGE = """\
usage: shardspeed run [--nproc N] [--nnodes N] [--node-rank R] [--master-addr A] [--master-port P]
                      [--rdzv-endpoint H:P] [--max-restarts K] [--full-tracebacks] [other torchrun options]
                      [--as-deepspeed] [DeepSpeed's launcher options] [--] script.py [script args ...]

Launch script.py on N processes per node with torchrun (torch.distributed.run). Any torchrun option
is accepted before the script; everything after the script goes to the script. On a single node with
no --master-addr/--master-port/--rdzv-endpoint, --standalone is added (a free port is chosen).

A shardspeed error (ConfigError, ...) that stops the workers is printed once per distinct message, with
the number of ranks that raised it, and the tracebacks go to a log file whose path is printed; other
exceptions print their tracebacks as usual. --full-tracebacks (or SHARDSPEED_TRACEBACK=1): every rank
prints its own traceback, as under torchrun.

DeepSpeed's launcher options are accepted too: --num_gpus N, --num_nodes N, --hostfile F (lines 'host
slots=N'), --include/--exclude 'host:0,1@host2', --master_addr, --master_port, --node_rank, --module,
--no_python, --no_local_rank, --enable_each_rank_log DIR. A hostfile with several hosts is a multi-node job:
run the same command on every host; each finds its node rank in the hostfile (or give --node_rank) and
joins a static rendezvous at the first host (--master_addr) on --master_port (29500). shardspeed starts no
remote process: --launcher openmpi/slurm/..., --ssh_port, --launcher_args, --venv_script, --save_pid and
core binding are not provided. --as-deepspeed (what the `deepspeed` command of `shardspeed deepspeed-path
--bin` runs): `import deepspeed` in the workers is shardspeed's package, each script gets --local_rank=N
(unless --no_local_rank), with every local GPU by default, and a multi-node job exports .deepspeed_env.
"""

def _isolate_restarts(torchrun_argv: Sequence[str]) -> None:
    """Give every restarted worker group a store of its own.

    torch >= 2.5 shares the c10d rendezvous TCPStore with the workers (``env://`` connects to the agent's
    store) and never clears it between restarts; the process group's keys carry no attempt number, so a
    restarted gloo group can read the dead group's addresses ("Gloo connectFullMesh failed ... Connection
    refused" on every rank, about one restart in two here; pytorch/pytorch#135712 for NCCL).
    ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` makes rank 0 host a fresh store for each attempt, as torchrun
    did before 2.5. Only when restarts were asked for; an explicit setting in the environment wins.
    """
    arity, restarts, i = torchrun_option_arity(), 0, 0
    while i < len(torchrun_argv) and torchrun_argv[i].startswith("-"):  # torchrun's options, then the script
        name, eq, value = torchrun_argv[i].partition("=")
        takes_value = not eq and arity.get(name, 0) == 1
        if canonical_option(name) == "--max-restarts":
            value = torchrun_argv[i + 1] if takes_value and i + 1 < len(torchrun_argv) else value
            restarts = int(value) if value.isdigit() else 0
        i += 2 if takes_value else 1
    if restarts > 0:
        os.environ.setdefault("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")


def _loopback_rendezvous(torchrun_argv: Sequence[str], rdzv_dir: str) -> list[str]:
    """A single-node job that listens on nothing but loopback: ``--standalone`` (added when the user named no
    rendezvous or master address) becomes torchrun's c10d rendezvous on a file store (in ``rdzv_dir``, a
    folder of the user's alone) instead of a TCPStore listening on every interface, with ``--local-addr 127.0.0.1``
    so that the workers' MASTER_ADDR is loopback; the store is not shared with the workers
    (``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``, unless set): rank 0 hosts it on 127.0.0.1 only
    (:func:`shardspeed.mesh.init.loopback_store`). Left as it is where the user gave --rdzv-conf or --local-addr."""
    args = list(torchrun_argv)
    if not args or args[0] != "--standalone":
        return args
    arity, i = torchrun_option_arity(), 1
    while i < len(args) and args[i].startswith("-"):
        name, eq, _ = args[i].partition("=")
        if canonical_option(name) in ("--rdzv-conf", "--local-addr"):
            return args
        i += 1 if eq or arity.get(name, 0) == 0 else 2
    os.environ.setdefault("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
    return ["--rdzv-backend", "c10d", "--rdzv-endpoint", os.path.join(rdzv_dir, "rendezvous"), "--rdzv-conf",
            "store_type=file", "--rdzv-id", uuid.uuid4().hex, "--local-addr", "127.0.0.1", *args[1:]]


def split_autotuning(argv: Sequence[str]) -> tuple[str | None, list[str]]:
    """``--autotuning tune|run`` (before the script) taken out of ``shardspeed run``'s arguments."""
    found, args = take_options(argv, ("--autotuning",))
    mode = found.get("--autotuning")
    if mode is not None and mode not in ("tune", "run"):
        raise UsageError(f"--autotuning must be tune or run, got {mode!r}")
    return mode, args


def launch_command(argv: Sequence[str]) -> int:
    """``shardspeed run`` once ``--autotuning`` is out of its arguments: launch the script with torchrun."""
    if not argv or argv[0] in ("-h", "--help"):
        print(_RUN_USAGE)
        print("torchrun options:")
        from torch.distributed.run import get_args_parser

        get_args_parser().print_help()
        return 0
    try:
        opts, argv = take_options(argv, ("--model", "--seq-len"))
        full_tracebacks, argv = take_flag(argv, "--full-tracebacks")
        as_deepspeed, argv = take_flag(argv, "--as-deepspeed")
        launch = deepspeed_launch(argv, as_deepspeed)
        torchrun_argv = build_torchrun_argv(launch.argv)
        if launch.local_rank_arg and _wrap_in_bootstrap(torchrun_argv, True) is None:
            raise UsageError("--run-path cannot give the script --local_rank: drop it, or add --no_local_rank")
    except UsageError as e:
        print(f"shardspeed run: error: {e}", file=sys.stderr)
        return 2
    from ..errors import ConfigError
    from ..utils import env

    try:
        env.check_environment()  # once here, rather than in every worker
    except ConfigError as e:
        print(f"shardspeed run: error: {e}", file=sys.stderr)
        return 2
    full_tracebacks = full_tracebacks or env.full_tracebacks()
    _isolate_restarts(torchrun_argv)
    if launch.note:
        print(launch.note, file=sys.stderr)
    with _environment(launch.env), tempfile.TemporaryDirectory(prefix="shardspeed-rdzv-") as rdzv_dir:
        return _launch(_loopback_rendezvous(torchrun_argv, rdzv_dir), full_tracebacks, launch.local_rank_arg)


def deepspeed_launch(argv: Sequence[str], as_deepspeed: bool = False) -> Launch:
    """DeepSpeed's launcher options among ``argv`` mapped onto torchrun's (:mod:`.ds_options`); with
    ``as_deepspeed``, the workers' ``import deepspeed`` finds shardspeed's package (its folder first on their
    ``PYTHONPATH``) and their scripts get ``--local_rank=N``."""
    arity = command_option_arity()
    found, rest = take_deepspeed_options(argv, arity)
    machine = this_machine()
    launch = resolve(found, rest, arity, machine, deepspeed_style=as_deepspeed)
    if as_deepspeed:
        from ..compat import site_path

        paths = launch.env.get("PYTHONPATH", machine.environ.get("PYTHONPATH", ""))
        launch.env["PYTHONPATH"] = os.pathsep.join([site_path(), *(p for p in paths.split(os.pathsep) if p)])
    return launch


@contextlib.contextmanager
def _environment(updates: Dict[str, str]) -> Iterator[None]:
    """``updates`` in this process's environment (the workers inherit it) while the job runs."""
    saved = {k: os.environ.get(k) for k in updates}
    os.environ.update(updates)
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def _wrap_in_bootstrap(torchrun_argv: Sequence[str], local_rank_arg: bool = False) -> list[str] | None:
    """torchrun's argv with the script run by :mod:`shardspeed.bootstrap` (which records a ShardspeedError
    instead of printing it), or None where it cannot be: ``--run-path`` (torchrun runs it in its own
    interpreter), and ``--no-python`` unless ``local_rank_arg`` (then the bootstrap execs the program, with
    ``--local_rank=N``). torchrun's ``-m`` becomes the bootstrap's ``--module``."""
    from .. import bootstrap

    arity, head, i = torchrun_option_arity(), [], 0
    args = list(torchrun_argv)
    mode: list[str] = []
    while i < len(args) and args[i].startswith("-"):
        name, eq, _ = args[i].partition("=")
        canon = canonical_option(name)
        if canon == "--run-path" or (canon == "--no-python" and not local_rank_arg):
            return None
        if canon in ("--module", "--no-python") or name == "-m":
            mode = ["--no-python" if canon == "--no-python" else "--module"]
            i += 1
            continue
        n = 1 if eq or arity.get(name, 0) == 0 else 2
        head += args[i:i + n]
        i += n
    if i >= len(args):
        return None
    script = os.path.realpath(bootstrap.__file__)
    first = [bootstrap.LOCAL_RANK_ARG] if local_rank_arg else []
    return [*head, script, *first, *mode, *args[i:]]


def _script_name(torchrun_argv: Sequence[str]) -> str:
    arity, i = torchrun_option_arity(), 0
    while i < len(torchrun_argv) and torchrun_argv[i].startswith("-"):
        name, eq, _ = torchrun_argv[i].partition("=")
        i += 1 if eq or arity.get(name, 0) == 0 else 2
    return torchrun_argv[i] if i < len(torchrun_argv) else "?"


def _launch(torchrun_argv: Sequence[str], full_tracebacks: bool = False, local_rank_arg: bool = False) -> int:
    """Run torchrun; print a ShardspeedError the workers raised once per distinct (type, message), with the
    ranks it was raised on, and its tracebacks into a log file (see :mod:`shardspeed.bootstrap`). With
    ``local_rank_arg`` the bootstrap gives each script ``--local_rank=N`` (even with ``full_tracebacks``)."""
    import logging
    import shutil

    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import main as torchrun_main

    from .. import bootstrap

    script = _script_name(torchrun_argv)
    wrapped = None if full_tracebacks and not local_rank_arg else _wrap_in_bootstrap(torchrun_argv, local_rank_arg)
    if wrapped is None or full_tracebacks:  # as torchrun alone: every rank prints its own traceback
        try:
            torchrun_main(list(wrapped or torchrun_argv))
        except ChildFailedError as e:
            codes = [f.exitcode for f in e.failures.values() if f.exitcode]
            print(f"shardspeed run: {script} failed (exit codes {codes or '?'})", file=sys.stderr)
            return next((c for c in codes if c > 0), 1)
        return 0

    error_dir = tempfile.mkdtemp(prefix="shardspeed-run-")
    log_path = os.path.join(error_dir, bootstrap.TRACEBACK_LOG)
    saved_env = os.environ.get(bootstrap.ERROR_DIR_ENV)
    os.environ[bootstrap.ERROR_DIR_ENV] = error_dir  # the workers inherit the launcher's environment
    quiet = bootstrap.SuppressReported(error_dir)
    torchrun_log = logging.getLogger("torch.distributed.elastic.multiprocessing.api")
    torchrun_log.addFilter(quiet)
    failure: ChildFailedError | None = None
    try:
        torchrun_main(wrapped)
    except ChildFailedError as e:
        failure = e
    except BaseException:  # torchrun's own failure (rendezvous, Ctrl-C): no summary, no directory left
        if not bootstrap.read_records(error_dir):
            shutil.rmtree(error_dir, ignore_errors=True)
        raise
    finally:
        torchrun_log.removeFilter(quiet)
        if saved_env is None:
            os.environ.pop(bootstrap.ERROR_DIR_ENV, None)
        else:
            os.environ[bootstrap.ERROR_DIR_ENV] = saved_env

    records = bootstrap.read_records(error_dir)
    if not records:
        shutil.rmtree(error_dir, ignore_errors=True)
    else:
        bootstrap.write_traceback_log(records, log_path, quiet.dropped)
    if failure is None:
        if records:  # an earlier attempt failed with a shardspeed error, the restarted one finished
            for line in bootstrap.summary_lines(records):
                print(f"{line} (the run restarted and finished)", file=sys.stderr)
            print(f"shardspeed: tracebacks in {log_path}", file=sys.stderr)
        return 0

    codes = [f.exitcode for f in failure.failures.values() if f.exitcode]
    reported = {r.pid for r in bootstrap.latest_attempt(records)}
    for line in bootstrap.summary_lines(records):
        print(line, file=sys.stderr)
    if records:
        print(f"shardspeed: tracebacks in {log_path} (--full-tracebacks or SHARDSPEED_TRACEBACK=1 shows them)",
              file=sys.stderr)
    # workers that failed for another reason (their tracebacks are above); those stopped by torchrun
    # (negative codes) after a reported error are no news
    others = {rank: f.exitcode for rank, f in failure.failures.items() if f.pid not in reported
              and (f.exitcode > 0 or not records)}
    if others or not records:
        shown = sorted(others.values()) if records else codes
        print(f"shardspeed run: {script} failed (exit codes {shown or '?'})", file=sys.stderr)
    return next((c for c in codes if c > 0), 1)


def add_parser(sub: argparse._SubParsersAction) -> None:
    # `run` is dispatched before argparse (its arguments belong to torchrun and the script); it is
    # registered here for --help only.
    sub.add_parser("run", help="launch a script on N processes (wraps torchrun)", add_help=False)
