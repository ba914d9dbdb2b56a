"""Restart after a failure (issue 16, item 7): the real command line, end to end.

``shardspeed run --nproc 2 --max-restarts 1 examples/train_gpt.py --save-every 4 --fail-at-step 10``: rank 1
exits (os._exit(1)) after step 10 of 12 on the first attempt; torchrun stops rank 0 and starts the group
again (TORCHELASTIC_RESTART_COUNT=1); the example loads the checkpoint of step 8 by itself and trains
steps 9-12. It must end exactly where the same command without the failure ends: the final fp32 weights
tensor by tensor (torch.equal), the losses of steps 9-12 (rank 0's) and the validation loss, bit for bit.
Without dropout (the example's default) and with dropout 0.1 (the RNG states must be restored too: the
example's restart passes ``load_rng_state=True``; without it this case fails).

Fp32 ZeRO-2 (examples/configs/zero2.json), the tiny GPT on 50 kB of text, 32-byte windows: each run takes
a few seconds of training; most of the time is starting processes. A run that hangs is killed after
``TIMEOUT`` seconds and the test fails with its output.

Every run's output (the launcher's and the workers' stdout and stderr, in one stream) is kept in
``<tmp_path>/<name>.log`` and printed in the failure message when a run fails, hangs, or (the run without
the fault) shows any restart: a fault-free run under ``--max-restarts`` must never be restarted, which
needs a teardown no worker can fail in (``shardspeed.shutdown_distributed`` at the example's end).
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "train_gpt.py"
CONFIG = ROOT / "examples" / "configs" / "zero2.json"  # fp32, stage 2
STEPS, SAVE_EVERY, FAIL_AT = 12, 4, 10
RESUME_STEP = FAIL_AT // SAVE_EVERY * SAVE_EVERY  # 8: the last checkpoint written before the failure
TIMEOUT = 240  # seconds per command line (about 10-25 s each when the machine is not loaded)


def _kill_tree(proc: subprocess.Popen) -> None:
    """Stop torchrun and its workers (they run in sessions of their own, so a process group kill misses
    them): SIGTERM to the agent (it stops its workers), then SIGKILL to whatever is left."""
    try:
        import psutil

        procs = [psutil.Process(proc.pid), *psutil.Process(proc.pid).children(recursive=True)]
    except Exception:  # psutil missing or the agent already gone
        procs = []
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=15)
    except subprocess.TimeoutExpired:
        pass
    for p in procs:
        try:
            p.kill()
        except Exception:
            pass
    proc.kill()


def _train(tmp_path: Path, name: str, *extra: str) -> tuple[str, dict, Path]:
    """Run the example on 2 processes with torchrun's restart; return its output, summary and out dir."""
    out = tmp_path / name
    cmd = [sys.executable, "-m", "shardspeed.cli", "run", "--nproc", "2", "--max-restarts", "1", str(EXAMPLE),
           "--config", str(CONFIG), "--model", "tiny", "--block-size", "32", "--max-bytes", "50000",
           "--eval-batches", "1", "--steps", str(STEPS), "--save-every", str(SAVE_EVERY),
           "--save-dir", str(out / "ckpt"), "--out-dir", str(out), *extra]
    # the workers import this checkout's shardspeed (the example also puts it first on sys.path); a worker
    # that dies of a signal (at exit, say) prints its Python stack (faulthandler)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
               PYTHONFAULTHANDLER="1")
    env.pop("TORCHELASTIC_RESTART_COUNT", None)
    log = tmp_path / f"{name}.log"
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        output, _ = proc.communicate(timeout=TIMEOUT)
    except subprocess.TimeoutExpired:
        _kill_tree(proc)
        output, _ = proc.communicate()
        log.write_text(output)
        pytest.fail(_report(name, f"no result after {TIMEOUT}s (hung?); killed", cmd, log, output))
    log.write_text(output)
    assert proc.returncode == 0, _report(name, f"exit status {proc.returncode}", cmd, log, output)
    summary_file = out / "summary.json"
    assert summary_file.exists(), _report(name, "no summary.json", cmd, log, output)
    return output, json.loads(summary_file.read_text()), out


def _report(name: str, what: str, cmd, log: Path, output: str) -> str:
    return f"{name}: {what}. Command: {' '.join(map(str, cmd))}\nOutput (kept in {log}):\n{output}"


# what a restart leaves in the output: torchrun's line about the failed worker, the example's resume line
RESTART_MARKERS = ("failed (exitcode", "(restart ", "Worker group FAILED", "will restart worker group")


def _assert_never_restarted(name: str, output: str, summary: dict, out: Path) -> None:
    markers = [m for m in RESTART_MARKERS if m in output]
    restarted = (summary["restart_count"], summary["start_step"]) != (0, 0) or markers
    assert not restarted, (
        f"{name}: a run without a fault was restarted by torchrun (summary: restart_count "
        f"{summary['restart_count']}, start_step {summary['start_step']}; markers {markers}): a worker exited "
        f"non-zero, at teardown if the last checkpoint was written.\nOutput (kept in {out.parent / name}.log):\n"
        f"{output}")


def _weights(out: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(out / "final_weights.safetensors"))


# with dropout (0.1), which covers the case without: dropout draws from torch's global RNG, which the load
# restores (load_rng_state); the engine's loader has a generator of its own, so creating its iterator after
# load_checkpoint draws nothing from that RNG
@pytest.mark.parametrize("dropout", ["0.1"])
def test_a_killed_rank_restarts_from_the_last_checkpoint_and_ends_bit_identical(tmp_path, dropout):
    crashed_log, crashed, crashed_dir = _train(tmp_path, "crashed", "--dropout", dropout,
                                               "--fail-at-step", str(FAIL_AT))
    straight_log, straight, straight_dir = _train(tmp_path, "straight", "--dropout", dropout)

    # the first attempt failed where the drill says, torchrun restarted the group, the example resumed
    assert f"fault drill: rank 1 exits after step {FAIL_AT}" in crashed_log, crashed_log
    assert f"global_step{RESUME_STEP} at step {RESUME_STEP} (restart 1)" in crashed_log, crashed_log
    assert (crashed["restart_count"], crashed["start_step"]) == (1, RESUME_STEP), crashed_log
    assert crashed_log.count("failed (exitcode") == 1, crashed_log  # the drill's failure only: one restart
    _assert_never_restarted("straight", straight_log, straight, straight_dir)
    assert "fault drill" not in straight_log and "resumed from" not in straight_log, straight_log

    # the same end, bit for bit: every weight, the losses of the steps trained after the restart (the
    # restarted attempt's own: steps 9-12), the final step and the validation loss
    a, b = _weights(crashed_dir), _weights(straight_dir)
    assert a.keys() == b.keys() and len(a) > 0
    for name in a:
        assert a[name].dtype == torch.float32, name
        assert torch.equal(a[name], b[name]), f"{name} differs after the restart"
    assert crashed["weights_sha256"] == straight["weights_sha256"]
    resumed_steps = [str(s) for s in range(RESUME_STEP + 1, STEPS + 1)]
    assert list(crashed["losses"]) == resumed_steps
    assert {s: straight["losses"][s] for s in resumed_steps} == crashed["losses"]
    assert crashed["losses"][str(STEPS)] == straight["losses"][str(STEPS)]
    assert crashed["val_loss"] == straight["val_loss"]
    assert (crashed_dir / "ckpt" / "latest").read_text().strip() == f"global_step{STEPS}"


def _shutdown_with_a_slow_rank(slow: int, delay: float):
    """``shutdown_distributed`` when rank ``slow`` takes ``delay`` s to destroy its groups: returns each
    rank's (time its destroy_process_group finished, time shutdown_distributed returned, still initialised)."""
    import time

    import torch.distributed as dist

    from shardspeed.mesh import init as dist_init

    rank, real_destroy = dist.get_rank(), dist.destroy_process_group
    done = {}

    def destroy(*args, **kwargs):
        if rank == slow:
            time.sleep(delay)
        real_destroy(*args, **kwargs)
        done["t"] = time.time()

    dist.destroy_process_group = destroy
    try:
        dist_init.shutdown_distributed(timeout=30)
    finally:
        dist.destroy_process_group = real_destroy
    return done["t"], time.time(), dist.is_initialized()


def test_shutdown_lets_rank_0_the_store_host_leave_last():
    """Rank 0 hosts the TCPStore here (env://, as under TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1): it must not
    return, and so exit, before the other ranks are done with their teardown."""
    from tests.distributed import run_distributed

    (d0, r0, init0), (d1, r1, init1) = run_distributed(_shutdown_with_a_slow_rank, 2, 1, 1.0, final_barrier=False)
    assert not init0 and not init1
    assert r0 >= d1, f"rank 0 returned {d1 - r0:.3f} s before rank 1 had destroyed its groups"
    assert d1 - d0 > 0.5  # the delay was on rank 1's side: rank 0 waited for it
    # the slow rank being rank 0 costs nothing more: the others leave as soon as it has reached the end
    (d0, r0, init0), (d1, r1, init1) = run_distributed(_shutdown_with_a_slow_rank, 2, 0, 0.5, final_barrier=False)
    assert not init0 and not init1 and r0 >= d1
