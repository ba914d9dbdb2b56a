"""Asynchronous saves (``save_checkpoint(..., async_save=True)`` and ``checkpoint.async_save``).

One world-2 group checks, at ZeRO 1 and 3: the files are byte-identical to a synchronous save of the same
state; training goes on while the writer runs and a fresh engine loading the checkpoint repeats the
original's next losses exactly (the steps after the snapshot do not reach it); the config key makes saves
asynchronous. A second group makes rank 1's writer fail (a real EFBIG: its file-size limit) and checks that
the error surfaces on both ranks at the next save, load_checkpoint and destroy(), with ``latest`` left on
the previous checkpoint. The kill cases SIGKILL a rank in the middle of its asynchronous write or its commit
and check that ``latest`` still names the previous checkpoint, which loads.
"""
from __future__ import annotations

import contextlib
import os
import resource
import shutil
import signal
import threading
import time

import crash_hook
import torch
from distributed import run_distributed
from models import make_batches, make_model, micro_batch

from shardspeed.checkpoint.commit import read_latest
from shardspeed.errors import CheckpointError


def _engine(stage: int, async_default: bool = False, kind: str = "mlp"):
    import torch.distributed as dist

    import shardspeed

    cfg = {"train_batch_size": 4, "train_micro_batch_size_per_gpu": 2,
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
           "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 10, "warmup_max_lr": 1e-2}},
           "zero_optimization": {"stage": stage, "reduce_bucket_size": 300,
                                 "stage3_param_persistence_threshold": 100},
           "checkpoint": {"async_save": async_default}}
    return shardspeed.initialize(model=make_model(kind, seed=dist.get_rank() + 5), config=cfg)[0]


def _train(e, steps, kind="mlp"):
    import torch.distributed as dist

    losses = []
    for b in make_batches(kind, steps, 4, seed=e.global_steps + 11):
        x, y = micro_batch(b, dist.get_rank(), dist.get_world_size(), 0, 1)
        loss = e(x, y)
        e.backward(loss)
        e.step()
        losses.append(float(loss))
    return losses


def _files(path):
    return {f: open(os.path.join(path, f), "rb").read() for f in sorted(os.listdir(path))}


def _cases(d):
    out = {}
    for stage, kind in ((1, "mlp"), (3, "tied")):
        e = _engine(stage, kind=kind)
        _train(e, 2, kind)
        e.save_checkpoint(f"{d}/sync{stage}", tag="t")
        with _slow_writer():  # the writer reads host tensors in place: the next optimizer step must wait for it
            path = e.save_checkpoint(f"{d}/async{stage}", tag="t", async_save=True)
            after = _train(e, 3, kind)  # while the writer runs; these steps change every saved tensor
            e.destroy()
        out[stage] = {"path": path, "after": after, "steps": e.global_steps}
        fresh = _engine(stage, kind=kind)
        fresh.load_checkpoint(f"{d}/async{stage}")
        out[stage]["resumed_steps"] = fresh.global_steps
        out[stage]["resumed"] = _train(fresh, 3, kind)
        fresh.destroy()
    e = _engine(2, async_default=True)  # the config key: asynchronous by default, and overridable
    saves = e.checkpoint_parts().async_saves
    e.save_checkpoint(f"{d}/cfg", tag="sync", async_save=False)
    out["sync_snapshot"] = saves.snapshot_bytes
    _train(e, 1)
    e.save_checkpoint(f"{d}/cfg")
    out["async_snapshot"], out["async_in_place"] = saves.snapshot_bytes, saves.in_place_bytes
    out["loaded"] = e.load_checkpoint(f"{d}/cfg")[0]  # waits for the save first
    return out


@contextlib.contextmanager
def _slow_writer():
    """Every CRC the checkpoint writer thread computes takes 50 ms more (the training thread's do not)."""
    import shardspeed.checkpoint.format as fmt

    real = fmt.crc32

    def slow(data, value=0):
        if threading.current_thread().name.startswith("shardspeed-checkpoint-writer"):
            time.sleep(0.05)
        return real(data, value)

    fmt.crc32 = slow
    try:
        yield
    finally:
        fmt.crc32 = real


def _limit_rank1_file_size(nbytes: int) -> None:
    import torch.distributed as dist

    if dist.get_rank() == 1:
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG instead
        resource.setrlimit(resource.RLIMIT_FSIZE, (nbytes, resource.RLIM_INFINITY))


def _errors(d):
    e = _engine(1)
    _train(e, 1)
    e.save_checkpoint(d, tag="good")
    seen = {}
    for where in ("save", "load", "destroy"):
        _limit_rank1_file_size(2000)  # rank 1's file is larger: its writer fails part-way
        e.save_checkpoint(d, tag=f"bad_{where}", async_save=True)
        _train(e, 1)  # nothing raised yet: training goes on
        try:
            if where == "save":
                e.save_checkpoint(d, tag="never")
            elif where == "load":
                e.load_checkpoint(d)
            else:
                e.destroy()
        except CheckpointError as exc:
            seen[where] = str(exc)
        _limit_rank1_file_size(resource.RLIM_INFINITY)
    e.save_checkpoint(d, tag="after", async_save=True)  # the errors are cleared: the next save works
    e.destroy()
    return seen


def test_async_save_equals_sync_and_survives_training(tmp_path):
    d = str(tmp_path)
    r0, r1 = run_distributed(_cases, 2, d)
    for stage in (1, 3):
        sync, asyn = _files(f"{d}/sync{stage}/t"), _files(f"{d}/async{stage}/t")
        assert sync.keys() == asyn.keys() and len(sync) == 4
        for name in sync:
            assert sync[name] == asyn[name], (stage, name)
        assert r0[stage]["path"] == f"{d}/async{stage}/t" and r0[stage]["steps"] == 5
        assert r0[stage]["resumed_steps"] == 2
        for r in (r0, r1):
            assert r[stage]["resumed"] == r[stage]["after"], stage  # exact: the snapshot is the state at step 2
    assert read_latest(f"{d}/async1") == "t"
    # on the CPU nothing is copied: the writer reads the engine's tensors in place
    assert r0["sync_snapshot"] == 0 and r0["async_snapshot"] == 0 and r0["async_in_place"] > 0
    assert r0["loaded"] == f"{d}/cfg/global_step1" and read_latest(f"{d}/cfg") == "global_step1"


def test_writer_error_surfaces_on_every_rank(tmp_path):
    d = str(tmp_path)
    seen0, seen1 = run_distributed(_errors, 2, d)
    for where in ("save", "load", "destroy"):
        assert where in seen0 and seen0[where] == seen1.get(where), where
        assert "rank 1 could not write its checkpoint file" in seen0[where], seen0[where]
        assert f"bad_{where}" in seen0[where]
        assert not os.path.exists(f"{d}/bad_{where}")
    assert read_latest(d) == "after"
    assert not [f for f in os.listdir(d) if ".tmp-" in f]


KILLS = ["bytes=2000@1", "after_files@0", "after_metadata@0", "after_rename@0"]


def _good(d):
    e = _engine(1)
    _train(e, 2)
    e.save_checkpoint(d, tag="good")
    return {n: p.detach().clone() for n, p in e.module.named_parameters()}


def _crash(d, spec):
    e = _engine(1)
    e.load_checkpoint(d)
    _train(e, 1)
    crash_hook.install(spec)
    e.save_checkpoint(d, tag="new", async_save=True)
    try:
        _train(e, 2)  # the peer may die during these steps (the training collectives fail) or after them
        e.destroy()
    except Exception as exc:  # the survivor: its next collective, or its writer's, lost the peer
        return type(exc).__name__
    return "no error"


def _load_all(dirs):
    out = []
    for d in dirs:
        e = _engine(1)
        path, _ = e.load_checkpoint(d)
        out.append((path, e.global_steps, {n: p.detach().clone() for n, p in e.module.named_parameters()}))
    return out


def test_sigkill_during_async_save_leaves_latest_on_previous(tmp_path):
    base = str(tmp_path / "base")
    want = run_distributed(_good, 2, base)[0]
    dirs = []
    for i, spec in enumerate(KILLS):
        d = str(tmp_path / f"run{i}")
        shutil.copytree(base, d)
        dead = int(spec[-1])
        got = run_distributed(_crash, 2, d, spec, timeout=90, collective_timeout=20, may_die=[dead])
        assert got[dead] is None and got[1 - dead] in ("DistributedError", "CheckpointError"), (spec, got)
        assert read_latest(d) == "good", spec
        dirs.append(d)
    for (path, steps, params), spec in zip(run_distributed(_load_all, 2, dirs)[0], KILLS):
        assert os.path.basename(path) == "good" and steps == 2, spec
        for n, p in want.items():
            assert torch.equal(params[n], p), (spec, n)
