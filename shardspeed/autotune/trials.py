"""Run one trial: a launcher subprocess in its own session, a timeout, and a kill of everything it started.

The trial is :func:`trial_command` (our small launcher: N ranks with torchrun's environment) started with
``start_new_session``: it and its ranks form one process group. A script may still start processes in
sessions of their own (torchrun's agent does, for its workers), so killing the group is not enough:
:func:`kill_tree` first lists every descendant (from /proc), then SIGKILLs the group and each
descendant's own group, and waits until they are gone.
A hang (timeout), a crash, an out-of-memory kill or missing metrics are results, never exceptions.
"""
from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence

logger = logging.getLogger("shardspeed.autotune")

_OOM_MARKERS = ("out of memory", "outofmemoryerror", "cannot allocate memory", "memoryerror")


@dataclass
class TrialResult:
    """What one run left behind; ``status`` is ok, timeout, oom or failed."""

    status: str
    returncode: Optional[int]
    wall_s: float
    metrics: Optional[Dict[str, Any]] = None
    error: str = ""

    @property
    def ok(self) -> bool:
        return self.status == "ok"


def launch_command(nproc: int, script: str, script_args: Sequence[str]) -> List[str]:
    """``shardspeed run`` (torchrun) of ``script`` on ``nproc`` local ranks: how to train (cmd_optimal.txt)."""
    return [sys.executable, "-m", "shardspeed.cli", "run", "--nproc", str(nproc), script, *script_args]


def trial_command(nproc: int, script: str, script_args: Sequence[str]) -> List[str]:
    """The lighter launcher of a trial (:mod:`shardspeed.autotune.launch`, run as a file: no torch import);
    ``script`` may be ``-m`` with the module first in ``script_args``."""
    launcher = os.path.join(os.path.dirname(os.path.abspath(__file__)), "launch.py")
    return [sys.executable, launcher, str(nproc), script, *script_args]


def trial_env(extra: Optional[Dict[str, str]] = None) -> Dict[str, str]:
    """The tuner's environment, with this shardspeed importable (PYTHONPATH) in the trial's processes."""
    env = dict(os.environ)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # .../shardspeed
    pkg_parent = os.path.dirname(root)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (pkg_parent, env.get("PYTHONPATH", "")) if p)
    env.update(extra or {})
    return env


def _children_map() -> Dict[int, List[int]]:
    out: Dict[int, List[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        ppid = int(stat[stat.rfind(")") + 2:].split()[1])  # the name may hold spaces: fields after ")"
        out.setdefault(ppid, []).append(int(entry))
    return out


def descendants(pid: int) -> List[int]:
    """Every live descendant of ``pid`` (Linux /proc; empty elsewhere)."""
    if not os.path.isdir("/proc"):
        return []
    tree, out, todo = _children_map(), [], [pid]
    while todo:
        for child in tree.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"  # a zombie is dead, only not yet reaped
    except OSError:
        return False


def kill_tree(proc: subprocess.Popen, grace_s: float = 5.0) -> List[int]:
    """SIGKILL the launcher's group and every descendant (and their groups); returns the pids still alive
    after ``grace_s`` (empty when all are gone)."""
    pids = descendants(proc.pid)
    groups = {proc.pid}
    for pid in pids:
        try:
            groups.add(os.getpgid(pid))
        except OSError:
            pass
    groups.discard(os.getpgid(0))  # never our own group
    for g in groups:
        try:
            os.killpg(g, signal.SIGKILL)
        except OSError:
            pass
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass
    try:
        proc.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        pass
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline and any(_alive(p) for p in pids):
        time.sleep(0.05)
    return [p for p in pids if _alive(p)]


def _last_error(stderr_path: str) -> str:
    try:
        with open(stderr_path, errors="replace") as f:
            lines = [ln.strip() for ln in f.read()[-20000:].splitlines() if ln.strip()]
    except OSError:
        return ""
    for ln in reversed(lines):
        if "Error" in ln or "error" in ln:
            return ln[:300]
    return lines[-1][:300] if lines else ""


def run_command(cmd: Sequence[str], exp_dir: str, timeout_s: float, metric_path: Optional[str] = None,
                env: Optional[Dict[str, str]] = None) -> TrialResult:
    """Run ``cmd`` with stdout/stderr in ``exp_dir``; kill it (and all it started) after ``timeout_s``."""
    os.makedirs(exp_dir, exist_ok=True)
    out_path, err_path = os.path.join(exp_dir, "stdout.log"), os.path.join(exp_dir, "stderr.log")
    t0 = time.perf_counter()
    with open(out_path, "wb") as out, open(err_path, "wb") as err:
        proc = subprocess.Popen(list(cmd), stdout=out, stderr=err, stdin=subprocess.DEVNULL,
                                start_new_session=True, env=trial_env(env))
        try:
            rc: Optional[int] = proc.wait(timeout=timeout_s)
            kill_tree(proc, grace_s=1.0)  # a worker that outlived its launcher
        except subprocess.TimeoutExpired:
            left = kill_tree(proc)
            if left:
                logger.warning("trial %s: processes %s survived SIGKILL", exp_dir, left)
            wall = time.perf_counter() - t0
            return TrialResult("timeout", None, wall, error=f"killed after {timeout_s:.0f} s (timeout)")
    wall = time.perf_counter() - t0
    metrics = None
    if metric_path and os.path.exists(metric_path):
        with open(metric_path) as f:
            metrics = json.load(f)
    if rc == 0 and metrics is not None:
        return TrialResult("ok", rc, wall, metrics)
    error = _last_error(err_path) or f"exit code {rc}"
    oom = rc in (-9, 137) or any(m in error.lower() for m in _OOM_MARKERS)
    if rc == 0:
        error = "exited without writing metrics (did the script run past end_profile_step?)"
    return TrialResult("oom" if oom and rc != 0 else "failed", rc, wall, metrics, error)
