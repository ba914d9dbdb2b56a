"""Files in shared folders, tried as another user of the machine would (issue 35): links planted at the
names a writer uses, a second job saving into the same folder, stale locks, swap folders made first by
someone else, and swap folders of killed runs.

Each case checks concrete outcomes: the planted link's target keeps its bytes, the output is correct, the
error is one line naming the culprit, and nothing of the other writer is removed."""
from __future__ import annotations

import json
import logging
import os
import re
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch
from distributed import run_distributed
from models import make_batches, make_model, micro_batch

from shardspeed.checkpoint.commit import read_latest
from shardspeed.checkpoint.consolidate import consolidate, load_consolidated
from shardspeed.checkpoint.save_lock import LOCK_FILE
from shardspeed.errors import ConfigError
from shardspeed.offload.param_file import NvmeParamFile
from shardspeed.offload.swap_dirs import OWNER_FILE, make_swap_dir, swap_job_id
from shardspeed.offload.swap_io import SwapFile
from shardspeed.utils.safe_files import host_name

ROOT = Path(__file__).resolve().parents[1]
VICTIM = b"precious bytes that belong to someone else\n"


def _engine(seed: int):
    import shardspeed

    cfg = {"train_batch_size": 2, "train_micro_batch_size_per_gpu": 2,
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}}, "zero_optimization": {"stage": 1},
           "checkpoint": {"async_save": False}}
    e = shardspeed.initialize(model=make_model("mlp", seed=seed), config=cfg)[0]
    for b in make_batches("mlp", 1, 2, seed=seed):
        x, y = micro_batch(b, 0, 1, 0, 1)
        e.backward(e(x, y))
        e.step()
    return e


def _params(e):
    return {n: p.detach().clone() for n, p in e.module.named_parameters()}


def _dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def _writers(root: str, victim: str):
    """World 1: a save held half-way (its file write waits) while a second engine saves into the same
    folder; then stale and foreign locks; then a link planted at the old temporary name of ``latest``."""
    import shardspeed.checkpoint.save as save_mod
    from shardspeed.errors import CheckpointError

    out: dict = {}
    first, second = _engine(1), _engine(2)
    first.save_checkpoint(root, tag="good")
    go, writing, real = threading.Event(), threading.Event(), save_mod.write_safetensors

    def held(*a, **k):  # the first job's writer is busy with its file
        writing.set()
        assert go.wait(60)
        return real(*a, **k)

    save_mod.write_safetensors = held
    try:
        first.save_checkpoint(root, tag="first", async_save=True)
        assert writing.wait(60)
        out["first_params"] = _params(first)
        tmp_before = sorted(n for n in os.listdir(root) if ".tmp-" in n)
        try:
            second.save_checkpoint(root, tag="second")
            out["second_error"] = None
        except CheckpointError as exc:
            out["second_error"] = str(exc)
        out["tmp_kept"] = tmp_before == sorted(n for n in os.listdir(root) if ".tmp-" in n) and len(tmp_before) == 1
    finally:
        go.set()
        save_mod.write_safetensors = real
    first.wait_checkpoint()
    out["latest_after_first"] = read_latest(root)
    out["lock_left"] = os.path.exists(os.path.join(root, LOCK_FILE))

    # a lock left by a killed process of this host: taken over with a warning
    lock = os.path.join(root, LOCK_FILE)
    with open(lock, "w") as f:
        json.dump({"host": host_name(), "pid": _dead_pid(), "tag": "x", "time": "then"}, f)
    records: list = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = records.append  # type: ignore[method-assign]
    logging.getLogger("shardspeed").addHandler(handler)
    try:
        second.save_checkpoint(root, tag="after_stale")
    finally:
        logging.getLogger("shardspeed").removeHandler(handler)
    out["stale_warning"] = [r.getMessage() for r in records if "took over" in r.getMessage()]
    out["latest_after_stale"] = read_latest(root)

    # a lock of a process on another host: refused, and the other writer's temporary folder is left alone
    with open(lock, "w") as f:
        json.dump({"host": "elsewhere", "pid": 4242, "tag": "x", "time": "now"}, f)
    os.makedirs(os.path.join(root, "theirs.tmp-abc"))
    try:
        second.save_checkpoint(root, tag="refused")
        out["foreign_error"] = None
    except CheckpointError as exc:
        out["foreign_error"] = str(exc)
    out["foreign_tmp_kept"] = os.path.isdir(os.path.join(root, "theirs.tmp-abc"))
    os.remove(lock)

    # a link planted at the temporary name the old code used for `latest` (pid-based): not followed
    os.symlink(victim, os.path.join(root, f"latest.tmp-{os.getpid()}"))
    second.save_checkpoint(root, tag="linked")
    out["latest_after_link"] = read_latest(root)
    out["latest_is_file"] = not os.path.islink(os.path.join(root, "latest"))
    return out


@pytest.fixture(scope="module")
def writers(tmp_path_factory):
    base = tmp_path_factory.mktemp("writers")
    victim = base / "victim.txt"
    victim.write_bytes(VICTIM)
    root = base / "ckpt"
    res = run_distributed(_writers, 1, str(root), str(victim), timeout=240)[0]
    return res, root, victim


def test_second_writer_is_refused_and_the_first_commits_intact(writers):
    res, root, _ = writers
    err = res["second_error"]
    assert err and "another job is saving into" in err and f"host {host_name()!r}" in err and "\n" not in err, err
    assert "pid" in err and "tag 'first'" in err, err
    assert res["tmp_kept"], "the second writer removed the first one's temporary folder"
    assert res["latest_after_first"] == "first" and not res["lock_left"]
    from shardspeed.checkpoint.metadata import CheckpointMetadata

    CheckpointMetadata.read(str(root / "first"))  # committed, complete


def test_stale_lock_is_taken_over_and_a_foreign_one_refused(writers):
    res, _, _ = writers
    assert len(res["stale_warning"]) == 1 and "its process is gone" in res["stale_warning"][0], res["stale_warning"]
    assert res["latest_after_stale"] == "after_stale"
    assert res["foreign_error"] and "host 'elsewhere' pid 4242" in res["foreign_error"], res["foreign_error"]
    assert res["foreign_tmp_kept"], "a refused save must not clean the folder"


def test_link_at_the_latest_temp_name_is_not_followed(writers):
    res, root, victim = writers
    assert victim.read_bytes() == VICTIM
    assert res["latest_after_link"] == "linked" and res["latest_is_file"]
    assert (root / "latest").read_bytes() == b"linked"


def test_consolidate_replaces_planted_links_and_leaves_their_targets(writers, tmp_path):
    res, root, _ = writers
    out = tmp_path / "out"
    out.mkdir()
    v1, v2 = tmp_path / "v1", tmp_path / "v2"
    v1.write_bytes(VICTIM)
    v2.write_bytes(VICTIM)
    os.symlink(v1, out / "model.safetensors.tmp")  # the old fixed temporary name
    os.symlink(v2, out / "model.safetensors")  # the final name
    consolidate(str(root), str(out), tag="first")
    assert v1.read_bytes() == VICTIM and v2.read_bytes() == VICTIM
    assert not os.path.islink(out / "model.safetensors")
    assert sorted(os.listdir(out)) == ["model.safetensors", "model.safetensors.tmp"]
    sd = load_consolidated(str(out))
    assert set(sd) == set(res["first_params"])
    assert all(torch.equal(sd[n], p) for n, p in res["first_params"].items()), "the first save's weights"


def test_swap_file_is_never_opened_through_a_link(tmp_path):
    victim = tmp_path / "victim"
    victim.write_bytes(VICTIM)
    os.symlink(victim, tmp_path / "swap")
    with pytest.raises(FileExistsError):
        SwapFile(str(tmp_path / "swap"))
    assert victim.read_bytes() == VICTIM


def _job_dir(root: Path) -> Path:
    return root / f"shardspeed-swap-{swap_job_id()}"


@pytest.mark.parametrize("case", ["world_writable", "other_uid", "link", "root_world_writable"])
def test_swap_folder_not_private_is_refused(tmp_path, case):
    root = tmp_path / "nvme"
    root.mkdir()
    job = _job_dir(root)
    if case == "link":
        (tmp_path / "elsewhere").mkdir()
        os.symlink(tmp_path / "elsewhere", job)
    elif case == "root_world_writable":
        os.chmod(root, 0o777)
    else:
        job.mkdir()
        os.chmod(job, 0o777 if case == "world_writable" else 0o700)
        if case == "other_uid":
            if os.geteuid() != 0:
                pytest.skip("chown to another uid needs root")
            os.chown(job, 65534, 65534)
    with pytest.raises(ConfigError) as info:
        NvmeParamFile(str(root), 0)
    msg = str(info.value)
    assert "\n" not in msg, msg
    want = {"world_writable": (str(job), "writable by other users (mode 0o777)"),
            "other_uid": (str(job), "owned by uid 65534"),
            "link": (str(job), "not a folder"),
            "root_world_writable": (str(root), "without the sticky bit")}[case]
    assert all(w in msg for w in want), msg
    if case != "link":
        assert not job.exists() or os.listdir(job) == [], "nothing made in a refused folder"
    else:
        assert os.listdir(tmp_path / "elsewhere") == []
    if case == "root_world_writable":  # a shared scratch folder like /tmp (sticky) is fine
        os.chmod(root, 0o1777)
        NvmeParamFile(str(root), 0).close()


_CHILD = """
import os, sys, time
from shardspeed.offload.swap_dirs import make_swap_dir
swap = make_swap_dir(sys.argv[1], "param", 0, 0, "test")
open(os.path.join(swap.path, "params.bin"), "wb").write(b"\\0" * 8192)
print(swap.path, flush=True)
time.sleep(600)
"""


def _start(root: Path, job: str) -> tuple[subprocess.Popen, str]:
    env = dict(os.environ, TORCHELASTIC_RUN_ID=job,
               PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    p = subprocess.Popen([sys.executable, "-c", _CHILD, str(root)], env=env, stdout=subprocess.PIPE, text=True)
    path = p.stdout.readline().strip()  # type: ignore[union-attr]
    assert path, "the child did not start"
    return p, path


def test_killed_runs_swap_folder_is_reclaimed_at_the_next_start(tmp_path, monkeypatch):
    root = tmp_path / "nvme"
    killed, killed_dir = _start(root, "launch-1")
    killed.send_signal(signal.SIGKILL)
    killed.wait()
    host = Path(killed_dir).parent.name.split("-", 3)[3]
    # a live process's folder (this one's, made by hand under another job): kept
    live_dir = root / "shardspeed-swap-launch-2" / f"rank0-attempt0-pid{os.getppid()}-{host}" / "param-y"
    live_dir.mkdir(parents=True)
    # a folder whose named pid is gone but whose owner lock is held (another pid namespace, same host): kept
    held = root / "shardspeed-swap-launch-3" / f"rank0-attempt0-pid{_dead_pid()}-{host}" / "param-x"
    held.mkdir(parents=True, mode=0o700)
    os.chmod(held.parent.parent, 0o700)
    os.chmod(held.parent, 0o700)
    fd = os.open(held / OWNER_FILE, os.O_CREAT | os.O_RDWR, 0o600)
    import fcntl

    fcntl.flock(fd, fcntl.LOCK_EX)
    records: list = []
    handler = logging.Handler(logging.INFO)
    handler.emit = records.append  # type: ignore[method-assign]
    log = logging.getLogger("shardspeed")
    log.addHandler(handler)
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "launch-4")
    try:
        swap = make_swap_dir(str(root), "param", 0, 0, "test")
    finally:
        log.removeHandler(handler)
        os.close(fd)
    lines = [r.getMessage() for r in records if "removed" in r.getMessage()]
    assert len(lines) == 1 and f"{killed_dir} (" in lines[0], lines
    assert int(re.search(r"param-\w+ \((\d+) bytes", lines[0])[1]) >= 8192, lines  # its params.bin counted
    assert not os.path.exists(killed_dir) and not (root / "shardspeed-swap-launch-1").exists()
    assert os.path.isdir(live_dir) and held.is_dir(), "a live owner's folder is never removed"
    swap.remove()


def test_deepspeed_export_replaces_planted_links(writers, tmp_path, monkeypatch):
    pytest.importorskip("deepspeed")
    monkeypatch.setenv("DS_ACCELERATOR", os.environ.get("DS_ACCELERATOR", "cpu"))
    from shardspeed.checkpoint.deepspeed_layout.export import export_deepspeed

    _, root, _ = writers
    out = tmp_path / "ds"
    (out / "first").mkdir(parents=True)
    victims = [tmp_path / "v1", tmp_path / "v2"]
    for v in victims:
        v.write_bytes(VICTIM)
    os.symlink(victims[0], out / "first" / "mp_rank_00_model_states.pt")  # a fixed name of the export
    os.symlink(victims[1], out / "latest")
    export_deepspeed(str(root), str(out), world=1, stage=1, tag="first")
    assert all(v.read_bytes() == VICTIM for v in victims)
    assert not os.path.islink(out / "first" / "mp_rank_00_model_states.pt") and not os.path.islink(out / "latest")
    assert (out / "latest").read_text() == "first"
    sd = torch.load(out / "first" / "mp_rank_00_model_states.pt", weights_only=False)
    assert "module" in sd
