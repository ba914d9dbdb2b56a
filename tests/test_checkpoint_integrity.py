"""Issue 16, items 2, 3, 4 and 6: every checkpoint byte a load uses is verified before use; a failed load
changes nothing on any rank (all or nothing, the same CheckpointError everywhere); checkpoint collectives
name their cause; failed saves and exports leave no temporary files.

One world-2 process group does every corruption case (fp16, so the loss scale is part of the state, at
stages 2 and 3): for each file of a checkpoint, one byte flipped at several places, one copy at a time.
"""
from __future__ import annotations

import glob
import json
import os
import shutil
import time

import crash_hook
import pytest
import torch
from distributed import run_distributed
from models import make_batches, make_model, micro_batch

from shardspeed.checkpoint import consolidate
from shardspeed.errors import CheckpointError


def _cfg(stage: int) -> dict:
    return {"train_micro_batch_size_per_gpu": 2, "gradient_clipping": 1.0,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
            "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0.0, "warmup_max_lr": 1e-2,
                                                         "warmup_num_steps": 10}},
            "fp16": {"enabled": True, "initial_scale_power": 8},
            "zero_optimization": {"stage": stage, "reduce_bucket_size": 300,
                                  "stage3_param_persistence_threshold": 0}}


def _train(engine, steps: int, seed: int) -> None:
    import torch.distributed as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    for b in make_batches("mlp", steps, 2 * world, seed=seed):
        engine.backward(engine(*micro_batch(b, rank, world, 0, 1)))
        engine.step()


def _snapshot(engine) -> dict:
    """Everything a load may change (params gathered at stage 3: a collective, every rank calls it)."""
    import random

    from models import gathered_params

    from shardspeed.checkpoint.engine_view import EngineView

    v = EngineView(engine)
    pieces = [pc for ps in v.pieces() for pc in ps]
    return {
        "params": {k: t.clone() for k, t in gathered_params(engine).items()},
        "masters": [pc.master.clone() for pc in pieces],
        "opt": [{k: (t.clone() if torch.is_tensor(t) else t) for k, t in engine.optimizer.state[pc.master].items()}
                for pc in pieces],
        "hyper": [{k: g[k] for k in ("lr", "betas", "weight_decay")} for g in engine.optimizer.param_groups],
        "steps": (engine.global_steps, engine.global_samples, engine.skipped_steps),
        "lr": engine.get_lr()[0],
        "sched": dict(v.parts.lr_scheduler.state_dict()),
        "scale": dict(v.parts.loss_scaler.state_dict()),
        "rng": (torch.get_rng_state().clone(), random.getstate()),
    }


def _same(a: dict, b: dict) -> list:
    """Names of the parts that differ."""
    diff = []
    if a["params"].keys() != b["params"].keys() or not all(torch.equal(a["params"][k], b["params"][k])
                                                             for k in a["params"]):
        diff.append("params")
    if not all(torch.equal(x, y) for x, y in zip(a["masters"], b["masters"])):
        diff.append("masters")
    for x, y in zip(a["opt"], b["opt"]):
        if x.keys() != y.keys() or not all(torch.equal(torch.as_tensor(x[k]), torch.as_tensor(y[k])) for k in x):
            diff.append("optimizer state")
            break
    for k in ("hyper", "steps", "lr", "sched", "scale"):
        if a[k] != b[k]:
            diff.append(k)
    if not torch.equal(a["rng"][0], b["rng"][0]) or a["rng"][1] != b["rng"][1]:
        diff.append("rng")
    return diff


def _flips(ck: str) -> list:
    """(file, offset, what) for each place to flip one byte: every file of the checkpoint, in its middle,
    and in the parts a load reads separately (a safetensors header, the RNG tensor, a number in the
    metadata's Python RNG state, common.pt's first bytes)."""
    out = []
    for name in sorted(os.listdir(ck)):
        path = os.path.join(ck, name)
        size = os.path.getsize(path)
        out.append((name, size // 2, "middle"))
        if name.endswith(".safetensors"):
            with open(path, "rb") as f:
                n = int.from_bytes(f.read(8), "little")
                header = json.loads(f.read(n))
            out.append((name, 8 + n // 2, "header"))
            out.append((name, 8 + n + header["rng/torch"]["data_offsets"][0] + 100, "rng tensor"))
            out.append((name, 8 + n + 3, "first tensor"))
        elif name == "metadata.json":
            text = open(path).read()
            i = text.index('"python":[3,[') + len('"python":[3,[') + 2
            out.append((name, i, "python rng number"))
            out.append((name, text.index('"lr":') + len('"lr":') + 1, "lr hyper-parameter"))
            out.append((name, len(text) - 5, "end"))
        elif name == "common.pt":
            out.append((name, 40, "start"))
            out.append((name, size - 30, "end"))
    return out


def _corruption_group(root: str, stages) -> dict:
    import torch.distributed as dist

    import shardspeed

    rank = dist.get_rank()
    res = {}
    for stage in stages:
        base = os.path.join(root, f"s{stage}")
        engine, *_ = shardspeed.initialize(model=make_model("mlp"), config=_cfg(stage))
        _train(engine, 2, seed=1)
        path = engine.save_checkpoint(base, tag="good")
        _train(engine, 2, seed=2)  # the engine now differs from the checkpoint in every part
        flips = _flips(path) if rank == 0 else None
        flips = [flips]
        dist.broadcast_object_list(flips, src=0)
        before = _snapshot(engine)
        cases = {}
        for i, (name, off, what) in enumerate(flips[0]):
            d = os.path.join(root, f"s{stage}-{i}")
            if rank == 0:
                shutil.copytree(base, d)
                with open(os.path.join(d, "good", name), "r+b") as f:
                    f.seek(off)
                    b = f.read(1)
                    f.seek(off)
                    f.write(bytes([b[0] ^ 0x01]))
            dist.barrier()
            try:
                engine.load_checkpoint(d)
                err = None
            except CheckpointError as exc:
                err = str(exc)
            except Exception as exc:  # noqa: BLE001 - recorded: the test says which kind it was
                err = f"NOT A CheckpointError: {type(exc).__name__}: {exc}"
            cases[(name, what)] = {"error": err, "changed": _same(before, _snapshot(engine)) if err else None}
            if err is None:
                break  # the engine is loaded now: later cases would compare against the wrong state
        # the intact copy still loads, and does change the engine
        engine.load_checkpoint(base)
        res[stage] = {"cases": cases, "intact_changed": _same(before, _snapshot(engine)), "rank": rank}
    return res


@pytest.fixture(scope="module")
def corruption(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("integrity"))
    return run_distributed(_corruption_group, 2, root, (2, 3), timeout=400)


@pytest.mark.parametrize("stage", [2, 3])
def test_one_flipped_byte_in_any_file_fails_every_rank_and_changes_nothing(corruption, stage):
    r0, r1 = corruption[0][stage], corruption[1][stage]
    assert r0["cases"].keys() == r1["cases"].keys()
    files = {name for name, _ in r0["cases"]}
    assert {"metadata.json", "common.pt", "rank00000.safetensors", "rank00001.safetensors"} <= files
    for case, got0 in r0["cases"].items():
        got1 = r1["cases"][case]
        assert got0["error"] is not None and got1["error"] is not None, (case, got0, got1)
        assert "NOT A" not in got0["error"] and "NOT A" not in got1["error"], (case, got0, got1)
        assert got0["error"] == got1["error"], case  # the same CheckpointError on every rank
        assert case[0] in got0["error"], (case, got0["error"])  # naming the file
        assert got0["changed"] == [] and got1["changed"] == [], (case, got0["changed"], got1["changed"])
    assert "masters" in r0["intact_changed"] and "steps" in r0["intact_changed"]


# ---- saves: one rank only, a rank killed, a write failing midway ----------------------------------------
def _save_on_rank0_only(root: str, rank1_exits: bool):
    import torch.distributed as dist

    import shardspeed
    from shardspeed.errors import DistributedError

    engine, *_ = shardspeed.initialize(model=make_model("mlp"), config=_cfg(2))
    _train(engine, 1, seed=1)
    if dist.get_rank() == 1:
        if not rank1_exits:
            time.sleep(14)  # alive, not taking part
        return {"rank": 1}
    t0 = time.monotonic()
    try:
        engine.save_checkpoint(root, tag="only0")
        return {"rank": 0, "error": None}
    except DistributedError as exc:
        return {"rank": 0, "error": str(exc), "seconds": time.monotonic() - t0,
                "left": sorted(os.listdir(root))}
    except Exception as exc:  # noqa: BLE001
        return {"rank": 0, "error": f"NOT A DistributedError: {type(exc).__name__}: {exc}"}


@pytest.mark.parametrize("rank1_exits", [False, True], ids=["rank1-idle", "rank1-gone"])
def test_save_on_one_rank_only_names_the_cause(tmp_path, rank1_exits):
    res = run_distributed(_save_on_rank0_only, 2, str(tmp_path), rank1_exits, final_barrier=False,
                          collective_timeout=8, timeout=90, may_die=[1])
    r0 = res[0]
    assert r0["error"] and "NOT A" not in r0["error"], r0
    assert "every rank must call save_checkpoint" in r0["error"], r0["error"]
    assert "_object" in r0["error"] or "barrier" in r0["error"], r0["error"]  # the operation
    assert r0["seconds"] < 8 + 5, r0  # within the collective timeout
    assert not [p for p in r0["left"] if ".tmp-" in p], r0["left"]


def _killed_during_save(root: str):
    import torch.distributed as dist

    import shardspeed
    from shardspeed.errors import DistributedError

    engine, *_ = shardspeed.initialize(model=make_model("mlp"), config=_cfg(2))
    _train(engine, 1, seed=1)
    engine.save_checkpoint(root, tag="good")
    _train(engine, 1, seed=2)
    crash_hook.install("after_files@1")
    try:
        engine.save_checkpoint(root, tag="bad")
    except DistributedError as exc:
        return {"error": str(exc), "left": sorted(os.listdir(root)), "rank": dist.get_rank()}
    except Exception as exc:  # noqa: BLE001
        return {"error": f"NOT A DistributedError: {type(exc).__name__}: {exc}"}
    return {"error": None}


def test_rank_killed_during_save_gives_the_survivor_a_distributed_error(tmp_path):
    res = run_distributed(_killed_during_save, 2, str(tmp_path), final_barrier=False, collective_timeout=20,
                          timeout=90, may_die=[1])
    r0 = res[0]
    assert r0["error"] and "NOT A" not in r0["error"], r0
    assert "every rank must call save_checkpoint" in r0["error"]
    assert r0["left"] == ["good", "latest"], r0["left"]  # no temporary directory, the previous checkpoint kept


def _failing_saves(root: str):
    import torch.distributed as dist

    import shardspeed
    import shardspeed.checkpoint.save as save_mod

    rank = dist.get_rank()
    engine, *_ = shardspeed.initialize(model=make_model("mlp"), config=_cfg(2))
    _train(engine, 1, seed=1)
    engine.save_checkpoint(root)  # global_step1: the good one
    good = _snapshot(engine)
    _train(engine, 1, seed=2)
    out = {}
    real_st, real_synced, real_commit = save_mod.write_safetensors, save_mod.write_file_synced, save_mod.commit

    def st_full_disk(path, items, **kw):  # rank 1 writes part of its file, then the disk is full
        with open(path, "wb") as f:
            f.write(b"\0" * 1000)
        raise OSError(28, "No space left on device")

    def synced_full_disk(path, data):
        with open(path, "wb") as f:
            f.write(data[:10])
        raise OSError(28, "No space left on device")

    def commit_fails(save_dir, tmp, tag, latest):
        raise OSError(30, "Read-only file system")

    for case in ("rank1_file", "rank0_metadata", "commit"):
        if case == "rank1_file" and rank == 1:
            save_mod.write_safetensors = st_full_disk
        if case == "rank0_metadata" and rank == 0:
            save_mod.write_file_synced = synced_full_disk
        if case == "commit" and rank == 0:
            save_mod.commit = commit_fails
        try:
            engine.save_checkpoint(root)
            out[case] = None
        except CheckpointError as exc:
            out[case] = str(exc)
        finally:
            save_mod.write_safetensors, save_mod.write_file_synced, save_mod.commit = \
                real_st, real_synced, real_commit
        dist.barrier()
        out[case + "_left"] = sorted(os.listdir(root))
        dist.barrier()  # every rank has listed before rank 0 starts the next case's save
    if os.geteuid() != 0:  # a read-only directory (root ignores the mode): fails before anything is written
        if rank == 0:
            os.chmod(root, 0o555)
        dist.barrier()
        try:
            engine.save_checkpoint(root)
            out["readonly"] = None
        except CheckpointError as exc:
            out["readonly"] = str(exc)
        dist.barrier()
        if rank == 0:
            os.chmod(root, 0o755)
        out["readonly_left"] = sorted(os.listdir(root))
    fresh, *_ = shardspeed.initialize(model=make_model("mlp", seed=7), config=_cfg(2))
    path, _ = fresh.load_checkpoint(root)  # `latest`
    out["loaded"] = os.path.basename(path)
    out["same_as_good"] = _same(good, _snapshot(fresh))
    return out


def test_failed_save_leaves_no_temporary_files_and_latest_still_loads(tmp_path):
    res = run_distributed(_failing_saves, 2, str(tmp_path), timeout=120)
    for r in res:
        assert "rank 1 could not write" in r["rank1_file"] and "No space left" in r["rank1_file"]
        assert "metadata" in r["rank0_metadata"] and "No space left" in r["rank0_metadata"]
        assert "could not commit" in r["commit"]
        if "readonly" in r:
            assert r["readonly"] and "cannot create" in r["readonly"]
        for case in ("rank1_file", "rank0_metadata", "commit", "readonly"):
            if case + "_left" in r:
                assert r[case + "_left"] == ["global_step1", "latest"], (case, r[case + "_left"])
        assert r["loaded"] == "global_step1"
        assert r["same_as_good"] == [] or r["same_as_good"] == ["rng"], r["same_as_good"]


def _tag_cases(root: str):
    import torch.distributed as dist

    import shardspeed

    rank, out = dist.get_rank(), {}
    for mode in ("FAIL", "WARN", "IGNORE"):
        engine, *_ = shardspeed.initialize(model=make_model("mlp"),
                                           config={**_cfg(1), "checkpoint": {"tag_validation": mode}})
        _train(engine, 1, seed=1)
        d = os.path.join(root, mode)
        try:
            out[mode] = os.path.basename(engine.save_checkpoint(d, tag=f"t{rank}"))
        except CheckpointError as exc:
            out[mode] = str(exc)
        dist.barrier()
        out[mode + "_left"] = sorted(os.listdir(d))
        dist.barrier()
    return out


def test_tags_that_differ_between_ranks_follow_tag_validation(tmp_path):
    """FAIL: an error on every rank and nothing written; WARN (DeepSpeed's default) and IGNORE: one checkpoint
    under rank 0's tag, never a directory per rank."""
    for r in run_distributed(_tag_cases, 2, str(tmp_path), timeout=120):
        assert "ranks disagree on the checkpoint tag (rank 0: 't0', rank 1: 't1')" in r["FAIL"]
        assert r["FAIL_left"] == []
        for mode in ("WARN", "IGNORE"):
            assert r[mode] == "t0" and r[mode + "_left"] == ["latest", "t0"], (mode, r)


# ---- consolidate: a failure leaves no model.safetensors.tmp ----------------------------------------------
def _save_one(root: str):
    import shardspeed

    engine, *_ = shardspeed.initialize(model=make_model("mlp"), config=_cfg(2))
    _train(engine, 1, seed=1)
    return engine.save_checkpoint(root, tag="t")


def test_failed_consolidate_leaves_no_tmp(tmp_path):
    path = run_distributed(_save_one, 2, str(tmp_path / "ck"))[0]
    victim = os.path.join(path, "rank00001.safetensors")
    with open(victim, "r+b") as f:
        n = int.from_bytes(f.read(8), "little")
        f.seek(8 + n + 5)
        b = f.read(1)
        f.seek(8 + n + 5)
        f.write(bytes([b[0] ^ 0x01]))
    out = tmp_path / "out"
    with pytest.raises(CheckpointError, match="rank00001.safetensors"):
        consolidate(path, str(out))
    assert not glob.glob(str(out / "*.tmp*")), os.listdir(out)
    assert not (out / "model.safetensors").exists()


# ---- the metadata checksum, without a process group -----------------------------------------------------
def _meta_json() -> str:
    from shardspeed.checkpoint.metadata import CheckpointMetadata, Entry, FileInfo, TensorInfo

    meta = CheckpointMetadata(tag="t", world_size=1, zero_stage=2, train_dtype="float32",
                              tensors={"w": TensorInfo([4], "float32", "param")}, aliases={},
                              entries=[Entry("w", "", 0, 4, "rank00000.safetensors", "w/w/0", 123)],
                              files={"rank00000.safetensors": FileInfo(0, 100, 5, 7)},
                              optimizer={"class": "AdamW", "param_groups": {"0": {"lr": 0.01, "betas": [0.9, 0.999]}}},
                              rng={"0": {"py": {"python": [3, [1, 2, 3], None]}, "tensors": {}}})
    return meta.to_json()


def test_metadata_checksum_catches_any_changed_value_and_old_versions_warn_once(caplog):
    import shardspeed.checkpoint.metadata as md

    text = _meta_json()
    assert md.CheckpointMetadata.from_json(text).files["rank00000.safetensors"].header_crc32 == 7
    for i, c in enumerate(text):  # every byte, flipped in its lowest bit: refused, or means the same thing
        bad = text[:i] + chr(ord(c) ^ 1) + text[i + 1:]
        try:
            got = md.CheckpointMetadata.from_json(bad, "m")
        except CheckpointError:
            continue
        assert json.loads(bad) == json.loads(text), (i, bad[max(i - 20, 0):i + 20])
        assert got.to_json() == text
    d = json.loads(text)
    del d["checksum"]
    with pytest.raises(CheckpointError, match="no checksum"):
        md.CheckpointMetadata.from_json(json.dumps(d), "m")
    d["version"] = 2  # as written before format 3: loads, with one warning per process
    for f in d["files"].values():
        del f["header_crc32"]
    md._warn_unverified.cache_clear()  # logged once per file and version
    with caplog.at_level("WARNING", logger="shardspeed"):
        for _ in range(2):
            assert md.CheckpointMetadata.from_json(json.dumps(d), "m").version == 2
    assert sum("not verified" in r.getMessage() for r in caplog.records) == 1
