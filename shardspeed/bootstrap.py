"""The worker side of ``shardspeed run``, and the launcher's summary of what the workers reported.

``shardspeed run`` has torchrun start each worker as ``python -u .../shardspeed/bootstrap.py script.py
[args]`` (``... bootstrap.py --module pkg.mod [args]`` for torchrun's ``-m``; ``--no-python program [args]``
execs a program). A DeepSpeed-style launch puts ``--local-rank-arg`` first: the script then gets
``--local_rank=N`` right after its name, as DeepSpeed's launcher gives it (:func:`worker_argv`). The bootstrap is run as a file,
not with ``-m shardspeed.bootstrap``, so that nothing but the standard library is imported before the
script (``import shardspeed`` imports torch). It runs the script as ``python script.py`` would
(``__main__``, ``sys.argv``, ``sys.path[0]`` the script's directory) and, when ``SHARDSPEED_ERROR_DIR``
is set, catches a :class:`~shardspeed.errors.ShardspeedError` that reaches the top of the worker: it
writes the error's type, message and traceback to ``$SHARDSPEED_ERROR_DIR/attempt{A}-rank{R}.json`` and
exits with status 1 without printing anything. Any other exception prints its traceback as Python would
(through ``sys.excepthook``, without the bootstrap's frames) and exits with status 1.

The launcher (:func:`summary_lines`) then groups the records of the failed attempt by (type, message) and
prints one line per distinct error with the ranks it occurred on::

    shardspeed: ConfigError on 2 of 2 ranks: zero_optimization.stage = 7 is invalid: it must be 0, 1, 2 or 3
    shardspeed: tracebacks in /tmp/shardspeed-run-1a2b3c/tracebacks.log (--full-tracebacks shows them)

Before exiting, a worker that recorded an error waits up to ``SHARDSPEED_ERROR_WAIT`` seconds (default
3) for the node's other ranks to record theirs: torchrun stops the whole group as soon as one worker
exits, and would stop a rank that was about to report the same error.
"""
from __future__ import annotations

import os
import sys

if __name__ == "__main__" and sys.path and os.path.realpath(sys.path[0] or ".") == os.path.dirname(
        os.path.realpath(__file__)):
    # run as a file: Python put this package's directory first on sys.path, where its modules (config,
    # data, dist, ...) would shadow the user's; the script's own directory replaces it in _run
    sys.path[0] = os.getcwd()

import glob  # noqa: E402  (after the sys.path fix above)
import json  # noqa: E402
import logging  # noqa: E402
import runpy  # noqa: E402
import time  # noqa: E402
import traceback  # noqa: E402
from dataclasses import dataclass  # noqa: E402
from types import TracebackType  # noqa: E402
from typing import Dict, Iterable, List, Optional, Sequence, Tuple  # noqa: E402

#: Where the workers write their error records (set by ``shardspeed run``; unset: the bootstrap catches nothing).
ERROR_DIR_ENV = "SHARDSPEED_ERROR_DIR"
TRACEBACK_LOG = "tracebacks.log"
#: First argument of a DeepSpeed-style launch (``--as-deepspeed``, the ``deepspeed`` command): the worker's argv
#: gets ``--local_rank=$LOCAL_RANK`` after the script, as under DeepSpeed's launcher.
LOCAL_RANK_ARG = "--local-rank-arg"


def _attempt() -> int:
    value = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    return int(value) if value.isdigit() else 0


def _env_int(name: str, default: int) -> int:
    value = os.environ.get(name, "")
    return int(value) if value.isdigit() else default


def _one_line(text: str) -> str:
    return " ".join(text.split())


def _is_shardspeed_error(exc: BaseException) -> bool:
    errors = sys.modules.get("shardspeed.errors")  # not imported: the script raised no shardspeed error
    return errors is not None and isinstance(exc, errors.ShardspeedError)


def _user_tb(exc: BaseException) -> Optional[TracebackType]:
    """``exc``'s traceback from the user's script down, without the frames of this bootstrap and runpy."""
    tb = exc.__traceback__
    here = os.path.realpath(__file__)
    while tb is not None and tb.tb_next is not None and (
            tb.tb_frame.f_globals.get("__name__") == "runpy"
            or os.path.realpath(tb.tb_frame.f_code.co_filename) == here):
        tb = tb.tb_next
    return tb


def _print_uncaught(exc: BaseException) -> None:
    """What Python prints for an uncaught exception (through ``sys.excepthook``), from the script down."""
    exc.with_traceback(_user_tb(exc))  # the default hook prints the exception's own __traceback__
    sys.excepthook(type(exc), exc, exc.__traceback__)


def record_error(error_dir: str, exc: BaseException) -> str:
    """Write ``exc`` as this rank's record of the current attempt; returns the file written."""
    rank = _env_int("RANK", 0)
    record = {
        "type": type(exc).__name__,
        "module": type(exc).__module__,
        "message": _one_line(str(exc)),
        "traceback": "".join(traceback.format_exception(type(exc), exc, _user_tb(exc))),
        "rank": rank,
        "local_rank": _env_int("LOCAL_RANK", 0),
        "world_size": _env_int("WORLD_SIZE", 1),
        "local_world_size": _env_int("LOCAL_WORLD_SIZE", 1),
        "attempt": _attempt(),
        "pid": os.getpid(),
    }
    os.makedirs(error_dir, exist_ok=True)
    path = os.path.join(error_dir, f"attempt{record['attempt']}-rank{rank}.json")
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w") as f:
        json.dump(record, f)
    os.replace(tmp, path)  # the launcher never reads half a record
    return path


def _wait_for_peers(error_dir: str, timeout: float) -> None:
    """Until every local rank of this attempt has a record, or ``timeout`` seconds."""
    want = _env_int("LOCAL_WORLD_SIZE", 1)
    pattern = os.path.join(error_dir, f"attempt{_attempt()}-rank*.json")
    deadline = time.monotonic() + timeout
    while len(glob.glob(pattern)) < want and time.monotonic() < deadline:
        time.sleep(0.05)


def _error_wait() -> float:
    """``SHARDSPEED_ERROR_WAIT`` (the launcher has checked it; a bad value set by hand: its one line, then 3 s).
    Only called once a ShardspeedError was caught, so importing shardspeed costs nothing here."""
    from shardspeed.errors import ConfigError
    from shardspeed.utils.env import error_wait_s

    try:
        return error_wait_s()
    except ConfigError as e:
        print(f"shardspeed: {e}; waiting 3 s", file=sys.stderr)
        return 3.0


def worker_argv(argv: Sequence[str], local_rank: Optional[int]) -> List[str]:
    """The worker's command line: the bootstrap's arguments (``[--module | --no-python] target [args]``) with,
    when ``local_rank`` is given, ``--local_rank=N`` right after the target, as DeepSpeed's launcher passes it."""
    args = list(argv)
    if local_rank is None:
        return args
    at = 2 if args and args[0] in ("--module", "--no-python") else 1
    return [*args[:at], f"--local_rank={local_rank}", *args[at:]]


def _run(argv: Sequence[str]) -> None:
    argv = list(argv)
    if argv and argv[0] == LOCAL_RANK_ARG:  # DeepSpeed-style launch: the script gets --local_rank=N
        argv = worker_argv(argv[1:], _env_int("LOCAL_RANK", 0))
    if argv and argv[0] in ("--module", "--no-python") and len(argv) < 2:
        raise SystemExit(f"shardspeed bootstrap: {argv[0]} needs a name")
    if argv and argv[0] == "--no-python":  # a program, not a Python script: this process becomes it
        try:
            os.execvp(argv[1], argv[1:])
        except OSError as e:
            print(f"shardspeed bootstrap: cannot run {argv[1]!r}: {e.strerror}", file=sys.stderr)
            raise SystemExit(127) from None
    if argv and argv[0] == "--module":
        sys.argv = [argv[1], *argv[2:]]  # runpy sets argv[0] to the module's file
        runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
        return
    if not argv:
        raise SystemExit("usage: python shardspeed/bootstrap.py [--local-rank-arg] script.py [args] | --module name "
                         "[args] | --no-python program [args]")
    script = os.path.abspath(argv[0])  # Python >= 3.9 gives __main__ an absolute __file__
    if not os.path.exists(script):  # as Python says it (and its exit status 2)
        print(f"{os.path.basename(sys.executable)}: can't open file {script!r}: [Errno 2] No such file or directory",
              file=sys.stderr)
        raise SystemExit(2)
    sys.argv = list(argv)
    # as `python script.py`: the script's directory first on sys.path
    sys.path[0] = os.path.dirname(os.path.realpath(script))
    runpy.run_path(script, run_name="__main__")


def main(argv: Optional[Sequence[str]] = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    error_dir = os.environ.get(ERROR_DIR_ENV)
    try:
        _run(argv)
    except Exception as e:
        if not error_dir or not _is_shardspeed_error(e):
            _print_uncaught(e)
            sys.exit(1)
        try:
            record_error(error_dir, e)
        except OSError:  # nowhere to write it: show it as Python would
            _print_uncaught(e)
            sys.exit(1)
        _wait_for_peers(error_dir, _error_wait())
        sys.exit(1)


# ---------------------------------------------------------------- the launcher's side


@dataclass
class ErrorRecord:
    type: str
    module: str
    message: str
    traceback: str
    rank: int
    local_rank: int
    world_size: int
    local_world_size: int
    attempt: int
    pid: int


def read_records(error_dir: str) -> List[ErrorRecord]:
    """Every record the workers wrote in ``error_dir`` (all attempts), by attempt then rank."""
    out = []
    for path in glob.glob(os.path.join(error_dir, "attempt*-rank*.json")):
        try:
            with open(path) as f:
                data = json.load(f)
            out.append(ErrorRecord(**{k: data[k] for k in ErrorRecord.__dataclass_fields__}))
        except (OSError, ValueError, KeyError, TypeError):
            continue
    return sorted(out, key=lambda r: (r.attempt, r.rank))


def _ranks_text(ranks: Sequence[int]) -> str:
    """[0, 1, 2, 5] -> "ranks 0-2, 5"."""
    parts: List[str] = []
    ranks = sorted(ranks)
    i = 0
    while i < len(ranks):
        j = i
        while j + 1 < len(ranks) and ranks[j + 1] == ranks[j] + 1:
            j += 1
        parts.append(str(ranks[i]) if i == j else f"{ranks[i]}-{ranks[j]}")
        i = j + 1
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(parts)


def group_records(records: Iterable[ErrorRecord]) -> List[Tuple[Tuple[str, str, str], List[ErrorRecord]]]:
    """Records grouped by (module, type, message), the group of the lowest rank first."""
    groups: Dict[Tuple[str, str, str], List[ErrorRecord]] = {}
    for r in records:
        groups.setdefault((r.module, r.type, r.message), []).append(r)
    return sorted(groups.items(), key=lambda kv: min(r.rank for r in kv[1]))


def latest_attempt(records: Sequence[ErrorRecord]) -> List[ErrorRecord]:
    """The records of the last attempt that wrote any."""
    attempt = max((r.attempt for r in records), default=0)
    return [r for r in records if r.attempt == attempt]


def summary_lines(records: Sequence[ErrorRecord]) -> List[str]:
    """One line per distinct error of the records' latest attempt, with how many of the ranks started on
    this node raised it (and which, unless all did)."""
    latest = latest_attempt(records)
    if not latest:
        return []
    attempt, nprocs = latest[0].attempt, max(r.local_world_size for r in latest)
    multi_node = any(r.world_size != r.local_world_size for r in latest)
    total = f"{nprocs} ranks on this node" if multi_node else f"{nprocs} ranks"
    lines = []
    for key, rs in group_records(latest):
        _, type_name, message = key
        ranks = sorted(r.rank for r in rs)
        which = "" if len(ranks) == nprocs and not multi_node else f" ({_ranks_text(ranks)})"
        when = ""
        if attempt:  # torchrun restarted the group: say whether the error is the same every time
            seen = {r.attempt for r in records if (r.module, r.type, r.message) == key}
            when = f" (in all {attempt + 1} attempts)" if len(seen) == attempt + 1 else f" (restart {attempt})"
        lines.append(f"shardspeed: {type_name} on {len(ranks)} of {total}{which}{when}: {message}")
    return lines


def write_traceback_log(records: Sequence[ErrorRecord], path: str, torchrun_lines: Sequence[str] = ()) -> None:
    """Every record's traceback, one block per distinct error and attempt, with the ranks it was raised on;
    then torchrun's log lines that the launcher kept off the terminal."""
    with open(path, "w") as f:
        for attempt in sorted({r.attempt for r in records}):
            for (_, type_name, message), rs in group_records(r for r in records if r.attempt == attempt):
                f.write(f"==== attempt {attempt}: {type_name} on {_ranks_text([r.rank for r in rs])}: {message}\n")
                for r in rs:
                    f.write(f"---- rank {r.rank} (local rank {r.local_rank}, pid {r.pid})\n{r.traceback}")
                    if not r.traceback.endswith("\n"):
                        f.write("\n")
                f.write("\n")
        if torchrun_lines:
            f.write("==== torchrun's lines about these workers\n")
            f.writelines(f"{line}\n" for line in torchrun_lines)


class SuppressReported(logging.Filter):
    """Drops torchrun's log lines about a worker that exited because of an error a record describes ("failed
    (exitcode: 1) local_rank: 0 (pid: P) ..."), and its "Sending process P closing signal SIGTERM" lines once
    such a record exists (the group is being stopped because of it). The dropped lines are kept in
    ``dropped`` (the launcher appends them to the traceback log)."""

    def __init__(self, error_dir: str):
        super().__init__()
        self.error_dir = error_dir
        self.dropped: List[str] = []

    def filter(self, record: logging.LogRecord) -> bool:
        msg, args = record.msg, record.args
        if not isinstance(msg, str) or not isinstance(args, tuple):
            return True
        if msg.startswith("failed (exitcode: ") and len(args) >= 3:
            drop = args[2] in {r.pid for r in read_records(self.error_dir)}
        elif msg.startswith("Sending process ") and "closing signal" in msg:
            drop = bool(read_records(self.error_dir))
        else:
            return True
        if drop:
            self.dropped.append(record.getMessage())
        return not drop


if __name__ == "__main__":
    main()
