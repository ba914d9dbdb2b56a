"""Run one multi-rank job twice at once: under shardspeed's ``deepspeed`` package (its site folder first on
PYTHONPATH) and under the installed DeepSpeed (the oracle, on its CPU accelerator). For the tests that drive
transformers and accelerate unchanged (tests/test_hf_via_deepspeed_package.py,
tests/test_accelerate_via_deepspeed_package.py)."""
from __future__ import annotations

import functools
import json
import os
import signal
import subprocess
import sys
from typing import Callable, Dict, List

from shardspeed.compat import site_path

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SYSTEMS = ("shardspeed", "deepspeed")
_LAUNCH_VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                "ACCELERATE_USE_DEEPSPEED", "ACCELERATE_CONFIG_DS_FIELDS")

_BUILD_OPS = ("from deepspeed.accelerator import get_accelerator as a; "
              "[a().create_op_builder(b).load() for b in ('FusedAdamBuilder', 'CPUAdamBuilder')]")


@functools.cache
def build_deepspeed_ops() -> None:
    """DeepSpeed's FusedAdam (its AdamW on the CPU accelerator) and CPUAdam (under offload_optimizer) compile
    at first use, minutes on a fresh machine: once per session, here, under their own time bound, so that no
    multi-rank job spends its timeout compiling (as conftest.deepspeed_fused_adam does for FusedAdam)."""
    subprocess.run([sys.executable, "-c", _BUILD_OPS], check=True, timeout=1800, capture_output=True,
                   env=dict(os.environ, DS_ACCELERATOR="cpu"))


def env_for(system: str) -> Dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in _LAUNCH_VARS}
    env.update(OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore", TOKENIZERS_PARALLELISM="false")
    path = [ROOT] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p and p != site_path()]
    if system == "shardspeed":
        path.insert(0, site_path())
    else:
        env["DS_ACCELERATOR"] = "cpu"
    env["PYTHONPATH"] = os.pathsep.join(path)
    return env


def run_both(command: Callable[[str], List[str]], out_root: str, timeout: float) -> Dict[str, dict]:
    """``command(out_dir)`` for each system at the same time (they share no files or ports); each job's rank 0
    writes ``out_dir/result.json``. Returns {system: result}; a failed job fails with its output's tail."""
    procs = {}
    for system in SYSTEMS:
        out = os.path.join(out_root, system)
        os.makedirs(out, exist_ok=True)
        log = open(os.path.join(out_root, f"{system}.log"), "w")
        procs[system] = (subprocess.Popen(command(out), env=env_for(system), cwd=out_root, stdout=log,
                                          stderr=subprocess.STDOUT, start_new_session=True), log, out)
    results = {}
    for system, (proc, log, out) in procs.items():
        try:
            code = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)  # the launcher and its workers (their own session)
            proc.wait()
            code = "timeout"
        log.close()
        with open(log.name) as f:
            tail = f.read()[-6000:]
        assert code == 0, f"{system} job failed ({code}):\n{tail}"
        with open(os.path.join(out, "result.json")) as f:
            results[system] = json.load(f)
    return results


def max_diff(a: List[float], b: List[float]) -> float:
    assert len(a) == len(b) and a, (a, b)
    return max(abs(x - y) for x, y in zip(a, b))
