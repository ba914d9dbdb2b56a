"""A dead or hung rank in a layout with sub-groups (issue 27): every other rank raises a `DistributedError`
within the timeout (plus a margin), naming what failed, and no process is left behind.

World 4, ``SHARDSPEED_TIMEOUT`` = ``TIMEOUT`` s, ranks launched as plain processes (tests/distributed.py's
forkserver; no torchrun that could stop the group for us). A forward hook faults one rank at step
``FAULT_STEP``: ``kill`` (the rank SIGKILLs itself) or ``hang`` (it sleeps forever, alive, its connections
open). One set of 4 processes per case; edge (0, 3) and middle (1, 2) ranks alternate:

=========  =============================  ==========  ===========
layout     mesh (pipe, data, model)       kill rank   hang rank
=========  =============================  ==========  ===========
PP2 × DP2  tied pipeline MLP, ZeRO 1      3 (edge)    1 (middle)
TP2 × DP2  GPT split by autotp, ZeRO 2    2 (middle)  0 (edge)
PP2 × TP2  GPT of pipeline layers, ZeRO 1 0 (edge)    2 (middle)
=========  =============================  ==========  ===========

Plus once through ``shardspeed run --max-restarts 1`` (torchrun): TP2 × DP2 with rank 3 hanging in the
first attempt; the survivors raise within the timeout, torchrun stops the hung rank and restarts the group,
the second attempt finishes; nothing is left running. And (one set of 4 processes) inputs wrong on the
ranks that read data make every pipeline stage of a PP4 raise the same error, after which the engine
trains on.

Global ranks: ``pipe × data × model + data × model + model``: PP2 × DP2 has pipe groups [0, 2] and [1, 3],
data groups [0, 1] and [2, 3]; TP2 × DP2 has model groups [0, 1], [2, 3] and data groups [0, 2], [1, 3];
PP2 × TP2 has model groups [0, 1], [2, 3] and pipe groups [0, 2], [1, 3].
"""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Dict, List

import distributed  # tests/distributed.py: its forkserver and worker are reused below
import pytest

ROOT = Path(__file__).resolve().parents[1]
WORLD, TIMEOUT, MARGIN = 4, 5.0, 10.0  # MARGIN: what a survivor may take beyond the timeout
FAULT_STEP, STEPS = 2, 4
#: (layout, fault, rank): see the table in the docstring
CASES = [("pp2_dp2", "kill", 3), ("pp2_dp2", "hang", 1), ("tp2_dp2", "kill", 2), ("tp2_dp2", "hang", 0),
         ("pp2_tp2", "kill", 0), ("pp2_tp2", "hang", 2)]

#: what a survivor's error names: a collective and its group by mesh dimension, or a pipeline transfer
COLLECTIVE = re.compile(r"collective \w+\(.*\) over the (data|pipe|model|mp|world|tie_\w+) group "
                        r"\(global ranks \[([\d, ]+)\]\) failed: ")
TRANSFER = re.compile(r"pipeline stage \d+ \(global rank \d\), step \d+: the (receive|send) of the "
                      r"(activations|gradients) of micro-batch \d+ (from|to) stage \d+ \(pipe rank \d, "
                      r"global rank (\d)\) failed: ")


# ---- the ranks' side -----------------------------------------------------------------------------------
def _engine(layout: str):
    """The layout's engine and a function running one training step ``step`` on this rank's data."""
    import torch

    import shardspeed

    if layout == "pp2_dp2":
        from pipe_models import batches, build, config, micro_batches

        engine, *_ = shardspeed.initialize(model=build("tied", 2), config=config(2, stage=1))
        dp, r = engine.mpu.get_data_parallel_world_size(), engine.mpu.get_data_parallel_rank()
        data = batches("tied", STEPS, 2 * 2 * dp)
        return engine, lambda step: engine.train_batch(iter(micro_batches(data[step], r, dp, 2)))
    if layout == "tp2_dp2":
        from tp_models import GLOBAL_BATCH, make_tp_model, tp_batches, tp_config

        engine, *_ = shardspeed.initialize(model=make_tp_model("gpt"), config=tp_config(2, 2))
        dp, r = engine.dp_world_size, engine.mpu.get_data_parallel_rank()
        n, data = GLOBAL_BATCH // dp, tp_batches(STEPS)

        def step_tp(step: int):
            x, y = data[step]
            engine.backward(engine(x[r * n:(r + 1) * n], y[r * n:(r + 1) * n]))
            engine.step()
        return engine, step_tp
    if layout == "pp2_tp2":
        import shardspeed.pipe
        from shardspeed.models.gpt import GPTConfig
        from shardspeed.models.gpt_pipe import gpt_layer_specs, gpt_loss

        cfg = GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=4, n_embd=32)
        model = shardspeed.pipe.PipelineModule(gpt_layer_specs(cfg, shardspeed.pipe, True), num_stages=2,
                                               loss_fn=gpt_loss, seed_layers=True, partition_method="uniform")
        config = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2,
                  "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}, "zero_optimization": {"stage": 1},
                  "pipeline": {"schedule": "1f1b"}, "tensor_parallel": {"autotp_size": 2}}
        engine, *_ = shardspeed.initialize(model=model, config=config)
        g = torch.Generator().manual_seed(3)
        data = [[(torch.randint(0, 64, (2, 16), generator=g), torch.randint(0, 64, (2, 16), generator=g))
                 for _ in range(2)] for _ in range(STEPS)]
        return engine, lambda step: engine.train_batch(iter(data[step]))
    raise ValueError(layout)


def _fault(how: str, fault_file: str) -> None:
    Path(fault_file).write_text(repr(time.time()))
    if how == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    while True:  # alive, its connections open, taking no further part
        time.sleep(60)


def _train_with_fault(layout: str, how: str, target: int, fault_file: str, catch: bool = True):
    """Train ``STEPS`` steps; rank ``target`` faults (``how``) in its first forward of step ``FAULT_STEP``.
    A survivor returns what it raised and when (``catch``; else the error propagates)."""
    import torch.distributed as dist

    from shardspeed.errors import DistributedError

    rank = dist.get_rank()
    engine, train_step = _engine(layout)

    def hook(*_):
        if rank == target and how != "none" and engine.global_steps == FAULT_STEP:
            _fault(how, fault_file)

    engine.module.register_forward_hook(hook)
    for step in range(STEPS):
        try:
            train_step(step)
        except Exception as e:  # noqa: BLE001  (the type is what the test checks)
            if not catch:
                if isinstance(e, DistributedError):
                    Path(f"{fault_file}.rank{rank}").write_text(repr(time.time()) + "\n" + str(e))
                raise
            return {"rank": rank, "type": type(e).__name__, "error": str(e), "t": time.time(), "step": step}
    return {"rank": rank, "type": None, "error": None, "step": STEPS}


# ---- the test's side -----------------------------------------------------------------------------------
def _context():
    """tests/distributed.py's forkserver, which also has imported the engine builder and torch's pipelining
    (seconds per process otherwise: 4 processes per case on 2 cores) when this module starts it first."""
    ctx = distributed._context()
    ctx.set_forkserver_preload(["torch", "torch.distributed", "shardspeed", "shardspeed.runtime.builder",
                                "torch.distributed.pipelining"])
    return ctx


def _launch(tmp_path: Path, fn, args: tuple, survivors: List[int], limit: float):
    """Start ``WORLD`` ranks running ``fn(*args)``; wait until every rank of ``survivors`` has exited (at
    most ``limit`` s). Returns (results by rank, exit time by rank, the processes, whether each was still
    running at that point); every process is stopped and reaped before it returns."""
    import io
    import queue

    import torch

    ctx = _context()
    results = ctx.Queue()
    port = distributed.free_port()
    procs = [ctx.Process(target=distributed._worker, args=(fn, r, WORLD, port, results, args, {}, TIMEOUT, False),
                         daemon=True) for r in range(WORLD)]
    for p in procs:
        p.start()
    out: Dict[int, object] = {}
    exits: Dict[int, float] = {}
    deadline = time.monotonic() + limit

    def drain(wait: float) -> None:
        try:
            rank, status, payload = results.get(timeout=wait)
        except queue.Empty:
            return
        out[rank] = torch.load(io.BytesIO(payload), weights_only=False) if status == "ok" else payload

    try:
        while any(r not in exits for r in survivors) and time.monotonic() < deadline:
            drain(0.05)
            for r in survivors:
                if r not in exits and procs[r].exitcode is not None:
                    exits[r] = time.time()
        for _ in range(WORLD):
            drain(0.2)
        alive = [p.is_alive() for p in procs]
    finally:
        for p in procs:  # the hung rank (and any survivor past its limit): stopped here
            if p.is_alive():
                p.kill()
            p.join(10)
    return out, exits, procs, alive


def _assert_gone(procs) -> None:
    import psutil

    for r, p in enumerate(procs):
        assert p.exitcode is not None, f"rank {r} (pid {p.pid}) is still running"
        assert not psutil.pid_exists(p.pid) or psutil.Process(p.pid).status() == psutil.STATUS_ZOMBIE, (
            f"rank {r} (pid {p.pid}) left behind")


def _check_error(rank: int, res) -> str:
    """The survivor's error names a collective and its group, or a pipeline transfer and its peer; returns
    the peer or group ranks it names."""
    assert isinstance(res, dict), f"rank {rank} failed outside the training loop:\n{res}"
    assert res["type"] == "DistributedError", f"rank {rank} raised {res['type']}: {res['error']}"
    assert res["step"] == FAULT_STEP, res
    msg = res["error"]
    assert "Another rank probably died" in msg or "probably died or hung" in msg, msg
    m = COLLECTIVE.search(msg) or TRANSFER.search(msg)
    assert m, f"rank {rank}: the error names no group or peer: {msg}"
    return m.group(m.lastindex or 0)


@pytest.mark.parametrize("layout,how,target", CASES, ids=[f"{lay}-{how}-rank{t}" for lay, how, t in CASES])
def test_every_survivor_raises_a_distributed_error_within_the_timeout(tmp_path, layout, how, target):
    fault_file = tmp_path / "fault"
    survivors = [r for r in range(WORLD) if r != target]
    out, exits, procs, alive = _launch(tmp_path, _train_with_fault, (layout, how, target, str(fault_file)),
                                       survivors, limit=60 + TIMEOUT + MARGIN)
    try:
        assert fault_file.exists(), f"rank {target} never reached step {FAULT_STEP}: {out}"
        fault_at = float(fault_file.read_text())
        named = []
        for r in survivors:
            assert r in exits, f"rank {r} still running {TIMEOUT + MARGIN:.0f} s after the fault ({how} of rank {target})"
            named.append(_check_error(r, out.get(r)))
            took = exits[r] - fault_at
            assert took < TIMEOUT + MARGIN, f"rank {r} exited {took:.1f} s after the fault: {out[r]}"
        # someone names the rank that faulted: the peer of a transfer, or a member of the group
        assert any(str(target) in n for n in named), (named, {r: out[r] for r in survivors})
        if how == "kill":
            assert procs[target].exitcode == -signal.SIGKILL
        else:
            assert alive[target], "the hung rank was still there when the others had left"
            errors = " ".join(out[r]["error"] for r in survivors)
            assert "Timed out" in errors or "timed out" in errors, errors  # the timeout fired, not only a close
    finally:
        _assert_gone(procs)


# ---- once through the real launcher ---------------------------------------------------------------------
def test_a_hung_rank_under_shardspeed_run_with_restarts(tmp_path):
    """``shardspeed run --nproc 4 --max-restarts 1`` of this file (TP2 × DP2, rank 3 hangs at step 2 of the
    first attempt): the survivors raise within the timeout, torchrun stops the hung rank and restarts; the
    second attempt trains to the end and the command exits 0. No process of the run is left."""
    import psutil

    fault_file = tmp_path / "fault"
    cmd = [sys.executable, "-m", "shardspeed.cli", "run", "--nproc", str(WORLD), "--max-restarts", "1",
           __file__, "tp2_dp2", "hang", "3", str(fault_file)]
    env = dict(os.environ, SHARDSPEED_TIMEOUT=str(TIMEOUT), PYTHONFAULTHANDLER="1",
               PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    env.pop("TORCHELASTIC_RESTART_COUNT", None)
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        output, _ = proc.communicate(timeout=150)
    except subprocess.TimeoutExpired:
        for p in [*psutil.Process(proc.pid).children(recursive=True), proc]:
            p.kill()
        output, _ = proc.communicate()
        pytest.fail(f"shardspeed run still running after 150 s:\n{output}")
    left = [p for p in psutil.process_iter(["cmdline"]) if str(fault_file) in " ".join(p.info["cmdline"] or [])]
    assert not left, f"processes left behind: {[p.pid for p in left]}\n{output}"
    assert proc.returncode == 0, output
    assert fault_file.exists(), output
    fault_at = float(fault_file.read_text())
    for r in (0, 1, 2):
        report = Path(f"{fault_file}.rank{r}")
        assert report.exists(), f"rank {r} raised no DistributedError in the first attempt:\n{output}"
        when, msg = report.read_text().split("\n", 1)
        assert float(when) - fault_at < TIMEOUT + MARGIN, (r, float(when) - fault_at, msg)
        assert COLLECTIVE.search(msg) or TRANSFER.search(msg), msg
    # the launcher's summary of the first attempt's errors, then the second attempt's clean end
    assert "shardspeed: DistributedError on " in output and "(the run restarted and finished)" in output, output


# ---- a wrong input is an error on every stage -----------------------------------------------------------
def _wrong_inputs():
    """PP4 (one stage per rank): micro-batches of different shapes, an item that is no pair, labels that
    are no tensor; each read by stages 0 and 3 only. Every stage's error, then a good step's loss."""
    import torch
    from pipe_models import batches, build, config

    import shardspeed
    from shardspeed.errors import ShardspeedError

    engine, *_ = shardspeed.initialize(model=build("mlp8", 4), config=config(4))  # 1F1B at PP4: 4 micro-batches
    x, y = batches("mlp8", 1, 9)[0]
    good = [(x[k:k + 2], y[k:k + 2]) for k in (0, 2, 4, 6)]
    cases = {"shapes": [*good[:2], (x[4:7], y[4:7]), good[3]], "pair": [*good[:3], (x[6:8],)],
             "labels": [(b[0], 1.0) for b in good]}
    out: Dict[str, object] = {}
    for name, micros in cases.items():
        try:
            engine.train_batch(iter(micros))
            out[name] = None
        except ShardspeedError as e:
            out[name] = f"{type(e).__name__}: {e}"
    out["after"] = float(engine.train_batch(iter(good)))
    out["steps"] = engine.global_steps
    assert torch.isfinite(torch.tensor(out["after"]))
    return out


def test_a_wrong_input_raises_the_same_error_on_every_pipeline_stage():
    from distributed import run_distributed

    res = run_distributed(_wrong_inputs, WORLD, timeout=120, collective_timeout=TIMEOUT)
    for name in ("shapes", "pair", "labels"):
        assert all(r[name] == res[0][name] for r in res), [r[name] for r in res]  # the same on every stage
        assert res[0][name] is not None and res[0][name].startswith("ShardspeedError: "), res[0][name]
    assert "the micro-batches of one step must have the same shapes" in res[0]["shapes"], res[0]["shapes"]
    assert "micro-batch 2 has [(3, 16), (3, 8)], micro-batch 0 [(2, 16), (2, 8)]" in res[0]["shapes"]
    assert "(inputs, labels) pair" in res[0]["pair"] and "read on pipe rank 0" in res[0]["pair"]
    assert "labels must be one tensor" in res[0]["labels"] and "read on pipe rank 3" in res[0]["labels"]
    assert all(r["after"] == res[0]["after"] and r["steps"] == 1 for r in res), res


if __name__ == "__main__":  # a worker of test_a_hung_rank_under_shardspeed_run_with_restarts (under torchrun)
    import shardspeed

    layout_, how_, target_, fault_file_ = sys.argv[1:5]
    if os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") != "0":
        how_ = "none"  # the restarted attempt runs to the end
    shardspeed.mesh.init_distributed()  # the timeout: SHARDSPEED_TIMEOUT
    _train_with_fault(layout_, how_, int(target_), fault_file_, catch=False)
    shardspeed.shutdown_distributed()
