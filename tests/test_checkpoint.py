"""Checkpoints: exact resume, resharding across world sizes and stages, consolidation, 16-bit export,
load_module_only, and clear errors for missing, truncated and corrupt files.

The distributed work runs in a few process groups (module fixture ``runs``), each doing many cases:
world 2 saves → world 4 saves → world 2 loads (a *new* process group: exact resume, 4→2) → world 1 loads
(2→1, errors) → world 4 loads (2→4). Tolerances: exact resume is bit-identical (losses and parameters);
resharding changes the reduction order, so losses and parameters agree within 1e-5 (fp32).
"""
from __future__ import annotations

import json
import os
import random
import shutil

import numpy as np
import pytest
import torch
from distributed import run_distributed
from models import make_batches, make_model, micro_batch

from shardspeed.checkpoint import consolidate, load_consolidated
from shardspeed.checkpoint.commit import read_latest, resolve
from shardspeed.checkpoint.consolidate import main as consolidate_main, parse_size
from shardspeed.checkpoint.format import ShardReader, write_safetensors
from shardspeed.checkpoint.metadata import Entry
from shardspeed.checkpoint.ranges import EntryIndex, plan_reads, read_range
from shardspeed.errors import CheckpointError

K = 3  # steps before and after the save
GLOBAL_BATCH = 8
RESUME_CASES = [("mlp", s, d) for s in (0, 1, 2, 3) for d in ("fp32", "bf16")] + [
    ("tied", 2, "fp32"), ("tied", 3, "fp32"), ("mlp_frozen", 1, "fp32"), ("mlp_frozen", 3, "fp32")]
# data-loader resume: 20 samples, world 2, micro-batch 4 → per rank batches of 4, 4, 2: 3 steps an epoch
LOADER_STAGES = (0, 2)
LOADER_SAMPLES, LOADER_STEPS = 20, 8
LOADER_SAVES = (3, 4)  # at the end of epoch 0 (before the loader noticed), and one batch into epoch 1


def _config(stage: int, world: int, dtype: str = "fp32") -> dict:
    cfg = {
        "train_batch_size": GLOBAL_BATCH,
        "train_micro_batch_size_per_gpu": GLOBAL_BATCH // world,
        "gradient_clipping": 0.5,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.01}},
        "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 10, "warmup_max_lr": 1e-2}},
        "zero_optimization": {"stage": stage, "reduce_bucket_size": 300,
                              "stage3_gather_16bit_weights_on_model_save": True},
    }
    if dtype == "bf16":
        cfg["bf16"] = {"enabled": True}
    return cfg


def _engine(kind: str, stage: int, dtype: str = "fp32", model_seed: int = 0, gather16: bool = True):
    import torch.distributed as dist

    import shardspeed

    cfg = _config(stage, dist.get_world_size(), dtype)
    cfg["zero_optimization"]["stage3_gather_16bit_weights_on_model_save"] = gather16
    cfg["zero_optimization"]["stage3_param_persistence_threshold"] = 100  # some units stay gathered
    engine, *_ = shardspeed.initialize(model=make_model(kind, model_seed), config=cfg)
    return engine


def _seed_all(seed: int) -> None:
    import torch.distributed as dist

    r = dist.get_rank()
    torch.manual_seed(seed + r)
    random.seed(seed + r)
    np.random.seed(seed + r)


def _steps(engine, kind: str, batches, noise: bool) -> list:
    """Train on ``batches``; with ``noise`` the inputs draw from torch, python and numpy RNGs (so a resume
    is only exact if every RNG state was restored)."""
    import torch.distributed as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    losses = []
    for b in batches:
        x, y = micro_batch(b, rank, world, 0, 1)
        if noise and x.is_floating_point():
            x = x + 0.01 * torch.randn_like(x) * (1 + random.random()) * (1 + float(np.random.rand()))
        loss = engine(x, y)
        engine.backward(loss)
        engine.step()
        t = loss.detach().float().clone()
        dist.all_reduce(t)
        losses.append(float(t) / world)
    return losses


def _params(engine) -> dict:
    """Every parameter, full and fp32, as the checkpoint sees it: trained ones from the fp32 master pieces of
    all ranks (so stage 3, where module parameters are placeholders, is checked too), the rest as held."""
    import torch.distributed as dist

    from shardspeed.checkpoint.engine_view import EngineView

    v = EngineView(engine)
    full = {name: torch.zeros(shape).reshape(-1) for name, shape, _ in v.unit_params()}
    shapes = {name: shape for name, shape, _ in v.unit_params()}
    for unit, pieces, frozen in zip(v.units, v.pieces(), v.frozen_pieces()):
        if v.writes_unit(unit):
            for pc in pieces:
                full[pc.name][pc.start : pc.end] = pc.master.float()
            for name, a, b, t in frozen:
                full[name][a:b] = t.float()
    for t in full.values():
        dist.all_reduce(t)
    out = {n: t.view(shapes[n]) for n, t in full.items()}
    for name, prm in v.other_params():
        out[name] = prm.detach().float().clone()
    return out


def _name(kind, stage, dtype, world=2) -> str:
    return f"{kind}-s{stage}-{dtype}-w{world}"


def _loader_engine(stage: int, model_seed: int = 0):
    import torch.distributed as dist

    import shardspeed

    g = torch.Generator().manual_seed(5)
    data = torch.utils.data.TensorDataset(torch.randn(LOADER_SAMPLES, 16, generator=g),
                                          torch.randn(LOADER_SAMPLES, 8, generator=g))
    engine, _, loader, _ = shardspeed.initialize(model=make_model("mlp", model_seed),
                                                 config=_config(stage, dist.get_world_size()), training_data=data)
    return engine, loader


def _loader_steps(engine, loader, steps: int, on_step=None) -> dict:
    """``steps`` steps over the engine's loader, epoch after epoch, as a script would write it (no
    ``set_epoch``: the loader reshuffles by itself). Returns the losses and this rank's inputs."""
    import torch.distributed as dist

    losses, inputs = [], []
    while len(losses) < steps:
        for x, y in loader:
            loss = engine(x, y)
            engine.backward(loss)
            engine.step()
            t = loss.detach().clone()
            dist.all_reduce(t)
            losses.append(float(t) / dist.get_world_size())
            inputs.append(x.clone())
            if on_step is not None:
                on_step(len(losses))
            if len(losses) == steps:
                break
    return {"losses": losses, "inputs": inputs}


# ---- process-group bodies (module level: they run in the ranks) -------------------------------------------
def _save_group(root: str, resume_cases, reshard_stages, loader_stages=()) -> dict:
    """Per case: 2K steps straight (the reference) and K steps then a save."""
    import torch.distributed as dist

    world = dist.get_world_size()
    out = {}
    for stage in loader_stages:
        e, loader = _loader_engine(stage)
        straight = _loader_steps(e, loader, LOADER_STEPS)
        e, loader = _loader_engine(stage)
        d = os.path.join(root, "loader", f"s{stage}")
        saving = _loader_steps(e, loader, LOADER_STEPS,
                               on_step=lambda n, e=e, d=d: e.save_checkpoint(d, tag=f"step{n}") if n in LOADER_SAVES else None)
        out[("loader", stage)] = {"straight": straight, "saving": saving}
    for kind, stage, dtype in resume_cases:
        batches = make_batches(kind, 2 * K, GLOBAL_BATCH)
        e = _engine(kind, stage, dtype)
        _seed_all(100)
        straight = _steps(e, kind, batches, noise=True)
        ref_params = _params(e)
        e = _engine(kind, stage, dtype)
        _seed_all(100)
        first = _steps(e, kind, batches[:K], noise=True)
        d = os.path.join(root, "resume", _name(kind, stage, dtype, world))
        e.save_checkpoint(d, client_state={"case": [kind, stage, dtype], "epoch": 7})
        out[("resume", kind, stage, dtype)] = {"straight": straight, "first": first, "params": ref_params,
                                               "saved_params": _params(e)}
    for stage in reshard_stages:
        batches = make_batches("mlp", 2 * K, GLOBAL_BATCH)
        e = _engine("mlp", stage)
        straight = _steps(e, "mlp", batches, noise=False)
        ref_params = _params(e)
        e = _engine("mlp", stage)
        _steps(e, "mlp", batches[:K], noise=False)
        e.save_checkpoint(os.path.join(root, "reshard", f"s{stage}-w{world}"))
        out[("reshard", stage)] = {"straight": straight, "params": ref_params, "saved_params": _params(e)}
    return out


def _continue_from(d: str, kind: str, stage: int, dtype: str = "fp32", noise: bool = False) -> dict:
    e = _engine(kind, stage, dtype, model_seed=7)  # other initial weights: they must come from the checkpoint
    _seed_all(999)  # other RNG states: with noise they must come from the checkpoint
    before = torch.get_rng_state()
    path, client = e.load_checkpoint(d, load_rng_state=noise)  # off (DeepSpeed's default): the RNGs stay
    after_load = {"global_steps": e.global_steps, "global_samples": e.global_samples, "lr": e.get_lr(),
                  "client": client, "path": path, "rng_kept": torch.equal(torch.get_rng_state(), before)}
    losses = _steps(e, kind, make_batches(kind, 2 * K, GLOBAL_BATCH)[K:], noise=noise)
    return {"losses": losses, "params": _params(e), **after_load}


def _load_group(root: str, resume_cases, reshard_loads, extra: str, loader_stages=()) -> dict:
    import torch.distributed as dist

    world = dist.get_world_size()
    out = {}
    for stage in loader_stages:
        for k in LOADER_SAVES:
            e, loader = _loader_engine(stage, model_seed=7)
            e.load_checkpoint(os.path.join(root, "loader", f"s{stage}"), tag=f"step{k}")
            out[("loader", stage, k)] = dict(_loader_steps(e, loader, LOADER_STEPS - k), epoch=loader.sampler.epoch)
    for kind, stage, dtype in resume_cases:
        out[("resume", kind, stage, dtype)] = _continue_from(
            os.path.join(root, "resume", _name(kind, stage, dtype, world)), kind, stage, dtype, noise=True)
    for src_stage, src_world, stage in reshard_loads:
        out[("reshard", src_stage, src_world, stage)] = _continue_from(
            os.path.join(root, "reshard", f"s{src_stage}-w{src_world}"), "mlp", stage)
    if extra == "world2":
        # load_module_only: weights from the checkpoint, nothing else (DeepSpeed: the engine keeps its step
        # counters, optimizer state, schedule; the saved counters come back in client_state)
        e = _engine("mlp", 2, model_seed=7)
        _steps(e, "mlp", make_batches("mlp", 1, GLOBAL_BATCH), noise=False)
        opt_before = {k: {sk: sv.clone() for sk, sv in st.items()} for k, st in enumerate(e.optimizer.state.values())}
        lr_before = e.get_lr()
        path, client = e.load_checkpoint(os.path.join(root, "resume", _name("mlp", 1, "fp32")), load_module_only=True)
        opt_after = {k: dict(st) for k, st in enumerate(e.optimizer.state.values())}
        out["module_only"] = {"params": _params(e), "steps": e.global_steps, "samples": e.global_samples,
                              "micro": e.micro_steps, "opt_kept": opt_before.keys() == opt_after.keys() and all(
                                  torch.equal(opt_before[k][sk], opt_after[k][sk]) for k in opt_before
                                  for sk in opt_before[k]),
                              "lr_kept": lr_before == e.get_lr(), "client": client}
        # nothing to load
        out["empty"] = e.load_checkpoint(os.path.join(root, "nothing-here"))
        # 16-bit export at stage 2 (bf16), both formats
        e = _engine("tied", 2, "bf16")
        _steps(e, "tied", make_batches("tied", 1, GLOBAL_BATCH), noise=False)
        e.save_16bit_model(os.path.join(root, "export16"), "pytorch_model.bin")
        e.save_16bit_model(os.path.join(root, "export16"), "model.safetensors")
        out["export16"] = {n: p.detach().clone() for n, p in e.module.state_dict().items()}
        # stage 3: gathered into the file; with the gather option off, a clear error (not an empty file)
        e = _engine("tied", 3, "bf16", model_seed=0)
        _steps(e, "tied", make_batches("tied", 1, GLOBAL_BATCH), noise=False)
        e.save_16bit_model(os.path.join(root, "export16-s3"), "model.safetensors")
        out["export16_s3_masters"] = {n: p.detach().clone() for n, p in _params(e).items()}
        e = _engine("mlp", 3, gather16=False)
        try:
            e.save_16bit_model(os.path.join(root, "export16-off"))
            out["export16_off"] = None
        except CheckpointError as exc:
            out["export16_off"] = str(exc)
    if extra == "errors":
        errs = {}
        for case in ("missing", "truncated", "corrupt", "no_metadata"):
            try:
                _continue_from(os.path.join(root, "broken", case), "mlp", 1)
                errs[case] = None
            except CheckpointError as exc:
                errs[case] = str(exc)
        # strict name check: a checkpoint of another model
        try:
            e = _engine("mlp_unused", 1)
            e.load_checkpoint(os.path.join(root, "reshard", "s1-w2"))
            errs["strict"] = None
        except CheckpointError as exc:
            errs["strict"] = str(exc)
        e = _engine("mlp_unused", 1)
        e.load_checkpoint(os.path.join(root, "reshard", "s1-w2"), load_module_strict=False)
        errs["non_strict_steps"] = e.global_steps
        out["errors"] = errs
    return out


def _break_copies(root: str) -> None:
    src = os.path.join(root, "reshard", "s1-w2")
    tag = read_latest(src)
    for case in ("missing", "truncated", "corrupt", "no_metadata"):
        dst = os.path.join(root, "broken", case)
        shutil.copytree(src, dst)
        ck = os.path.join(dst, tag)
        victim = os.path.join(ck, "rank00001.safetensors")
        if case == "missing":
            os.remove(victim)
        elif case == "truncated":
            with open(victim, "r+b") as f:
                f.truncate(os.path.getsize(victim) - 100)
        elif case == "corrupt":  # same size, one byte flipped in the first tensor: only the CRC can tell
            with open(victim, "r+b") as f:
                header_len = int.from_bytes(f.read(8), "little")
                f.seek(8 + header_len + 2)
                b = f.read(1)
                f.seek(-1, 1)
                f.write(bytes([b[0] ^ 0xFF]))
        else:
            os.remove(os.path.join(ck, "metadata.json"))


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("ckpt"))
    res = {}
    res[2] = run_distributed(_save_group, 2, root, RESUME_CASES, [0, 1, 2, 3], LOADER_STAGES)[0]
    res[4] = run_distributed(_save_group, 4, root, [], [2, 3])[0]
    _break_copies(root)
    res["load2"] = run_distributed(_load_group, 2, root, RESUME_CASES, [(2, 4, 0), (3, 4, 1)], "world2",
                                    LOADER_STAGES)[0]
    res["load1"] = run_distributed(_load_group, 1, root, [], [(3, 2, 1), (2, 2, 0), (1, 2, 3)], "errors")[0]
    res["load4"] = run_distributed(_load_group, 4, root, [], [(1, 2, 3), (0, 2, 2), (2, 2, 0), (3, 2, 1)], "none")[0]
    res["root"] = root
    return res


# ---- exact resume ------------------------------------------------------------------------------------
@pytest.mark.parametrize("case", RESUME_CASES, ids=lambda c: "-".join(map(str, c)))
def test_exact_resume(runs, case):
    saved = runs[2][("resume", *case)]
    got = runs["load2"][("resume", *case)]
    assert saved["first"] == saved["straight"][:K]
    assert not got["rng_kept"]  # load_rng_state=True restored the saved RNG states
    assert got["losses"] == saved["straight"][K:], f"{case}: losses after resume differ"
    for n, p in saved["params"].items():
        assert torch.equal(got["params"][n], p), f"{case}: parameter {n} differs after resume"
    assert got["global_steps"] == K and got["global_samples"] == K * GLOBAL_BATCH
    assert got["client"] == {"case": list(case), "epoch": 7}


# ---- data-loader position -------------------------------------------------------------------------------
@pytest.mark.parametrize("stage", LOADER_STAGES)
@pytest.mark.parametrize("k", LOADER_SAVES)
def test_loader_resumes_at_the_next_batch(runs, stage, k):
    """Saved mid-run while iterating the engine's loader, resumed in a new process group: the same batches
    (rank 0's inputs, bit for bit) and bit-identical losses as the straight run, across the epoch boundary."""
    ref = runs[2][("loader", stage)]
    got = runs["load2"][("loader", stage, k)]
    assert ref["saving"]["losses"] == ref["straight"]["losses"]  # saving does not disturb the run
    assert len(got["inputs"]) == LOADER_STEPS - k
    for i, (a, b) in enumerate(zip(got["inputs"], ref["straight"]["inputs"][k:])):
        assert torch.equal(a, b), f"batch {k + i} differs after resuming at step {k}"
    assert got["losses"] == ref["straight"]["losses"][k:]
    assert got["epoch"] == 2  # 8 steps of 3 per epoch: epochs 0, 1 and into 2
    # epochs are reshuffled: epoch 1 does not repeat epoch 0's order
    assert not torch.equal(ref["straight"]["inputs"][0], ref["straight"]["inputs"][3])


# ---- resharding -----------------------------------------------------------------------------------------
RESHARDS = [("load2", 2, 4, 0), ("load2", 3, 4, 1), ("load1", 3, 2, 1), ("load1", 2, 2, 0), ("load1", 1, 2, 3),
            ("load4", 1, 2, 3), ("load4", 0, 2, 2), ("load4", 2, 2, 0), ("load4", 3, 2, 1)]


@pytest.mark.parametrize("group,src_stage,src_world,stage", RESHARDS,
                         ids=lambda *a: None)
def test_reshard_continues_like_the_original_run(runs, group, src_stage, src_world, stage):
    ref = runs[src_world][("reshard", src_stage)]
    got = runs[group][("reshard", src_stage, src_world, stage)]
    assert got["global_steps"] == K
    assert got["rng_kept"]  # the default, as DeepSpeed: the load leaves every RNG as it was
    torch.testing.assert_close(torch.tensor(got["losses"]), torch.tensor(ref["straight"][K:]), rtol=1e-5, atol=1e-6)
    for n, p in ref["params"].items():
        torch.testing.assert_close(got["params"][n], p, rtol=1e-5, atol=1e-6, msg=lambda m, n=n: f"{n}: {m}")


# ---- consolidation and export ----------------------------------------------------------------------------
@pytest.mark.parametrize("case", [("tied", 2, "fp32"), ("tied", 3, "fp32"), ("mlp_frozen", 1, "fp32"),
                                  ("mlp_frozen", 3, "fp32"), ("mlp", 2, "bf16")])
def test_consolidate_equals_gathered_params(runs, case, tmp_path):
    kind, stage, dtype = case
    saved = runs[2][("resume", *case)]
    files = consolidate(os.path.join(runs["root"], "resume", _name(*case)), str(tmp_path), max_shard_size="2KB")
    assert len(files) > 1 and os.path.isfile(tmp_path / "model.safetensors.index.json")
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    sd = load_consolidated(str(tmp_path))
    assert set(index["weight_map"]) == set(sd)
    model = make_model(kind, seed=3)
    model.load_state_dict(sd, strict=True)  # tied names present, nothing missing
    for n, p in model.named_parameters():
        assert p.dtype == torch.float32
        assert torch.equal(p.detach(), saved["saved_params"][n]), n  # the fp32 masters, bit for bit
    if kind == "tied":
        assert model.head.weight is model.wte.weight


def test_consolidate_cli_single_file(runs, tmp_path):
    from shardspeed.cli import main as cli_main

    rc = cli_main(["consolidate", os.path.join(runs["root"], "resume", _name("mlp", 0, "fp32")), str(tmp_path)])
    assert rc == 0 and os.listdir(tmp_path) == ["model.safetensors"]
    make_model("mlp").load_state_dict(load_consolidated(str(tmp_path)))
    assert consolidate_main([str(tmp_path / "nowhere"), str(tmp_path / "out")]) == 1


def test_save_16bit_model(runs):
    from safetensors.torch import load_file

    want = runs["load2"]["export16"]
    d = os.path.join(runs["root"], "export16")
    for sd in (torch.load(os.path.join(d, "pytorch_model.bin")), load_file(os.path.join(d, "model.safetensors"))):
        assert set(sd) == set(want)
        for n, t in want.items():
            assert sd[n].dtype == torch.bfloat16 and torch.equal(sd[n], t), n
        make_model("tied").to(torch.bfloat16).load_state_dict(sd)
    sd = load_file(os.path.join(runs["root"], "export16-s3", "model.safetensors"))
    masters = runs["load2"]["export16_s3_masters"]
    assert set(sd) == {"wte.weight", "wpe.weight", "block.0.weight", "block.0.bias", "block.2.weight",
                       "block.2.bias", "ln.weight", "ln.bias", "head.weight"}
    for n, t in masters.items():  # stage 3 gathered the shards: every weight is the bf16 of its master
        assert sd[n].numel() and torch.equal(sd[n], t.bfloat16()), n
    assert torch.equal(sd["head.weight"], sd["wte.weight"])
    err = runs["load2"]["export16_off"]
    assert err and "stage3_gather_16bit_weights_on_model_save" in err


# ---- load options and errors -------------------------------------------------------------------------------
def test_load_module_only(runs):
    got = runs["load2"]["module_only"]
    saved = runs[2][("resume", "mlp", 1, "fp32")]
    for n, p in saved["saved_params"].items():
        assert torch.equal(got["params"][n], p), n
    assert (got["steps"], got["samples"], got["micro"]) == (1, GLOBAL_BATCH, 1)  # the engine's own counters
    assert got["opt_kept"] and got["lr_kept"]
    assert got["client"] == {"case": ["mlp", 1, "fp32"], "epoch": 7, "global_steps": K,
                             "global_samples": K * GLOBAL_BATCH, "skipped_steps": 0}
    assert runs["load2"]["empty"] == (None, None)


def test_errors_name_the_bad_file(runs):
    errs = runs["load1"]["errors"]
    assert "rank00001.safetensors" in errs["missing"] and "missing" in errs["missing"]
    assert "rank00001.safetensors" in errs["truncated"] and "truncated" in errs["truncated"]
    assert "rank00001.safetensors" in errs["corrupt"] and "checksum" in errs["corrupt"]
    assert "metadata.json" in errs["no_metadata"]
    assert errs["strict"] and "unused" in errs["strict"] and "load_module_strict=False" in errs["strict"]
    assert errs["non_strict_steps"] == K


# ---- pure parts: no process group ----------------------------------------------------------------------------
def test_plan_reads_and_holes():
    es = [Entry("w", "", 0, 4, "a", "k0"), Entry("w", "", 4, 10, "b", "k1")]
    idx = EntryIndex(es)
    plan = plan_reads(idx.overlapping("w", "", 2, 7), 2, 7)
    assert [(e.key, s, d, n) for e, s, d, n in plan] == [("k0", 2, 0, 2), ("k1", 0, 2, 3)]
    with pytest.raises(CheckpointError, match=r"\[10, 12\)"):
        plan_reads(idx.overlapping("w", "", 8, 12), 8, 12)


def test_streamed_safetensors_are_standard(tmp_path):
    from safetensors import safe_open

    ts = {"a": torch.randn(3, 5), "b": torch.arange(7, dtype=torch.int64), "c": torch.randn(4).bfloat16(),
          "d": torch.tensor(3.0)}
    path = str(tmp_path / "x.safetensors")
    w = write_safetensors(path, list(ts.items()), metadata={"format": "pt"})
    assert w.bytes == os.path.getsize(path)
    with safe_open(path, "pt") as f:
        for k, t in ts.items():
            assert torch.equal(f.get_tensor(k), t)
    r = ShardReader(str(tmp_path))
    assert torch.equal(r.read("x.safetensors", "a", w.tensor_crc32["a"]), ts["a"])
    with pytest.raises(CheckpointError, match="checksum"):
        r.read("x.safetensors", "a", w.tensor_crc32["a"] ^ 1)
    es = [Entry("w", "", 0, 7, "x.safetensors", "b", w.tensor_crc32["b"])]
    assert read_range(r, EntryIndex(es), "w", "", 2, 5, dtype=torch.int64).tolist() == [2, 3, 4]


def test_parse_size():
    assert parse_size("5GB") == 5 * 10**9 and parse_size("2KiB") == 2048 and parse_size(123) == 123
    with pytest.raises(CheckpointError):
        parse_size("lots")


def test_resolve_falls_back_to_moved_aside_copy(tmp_path):
    old = tmp_path / "global_step3.old-abc"
    old.mkdir()
    (old / "metadata.json").write_text("{}")
    assert resolve(str(tmp_path), "global_step3") == str(old)
    with pytest.raises(CheckpointError, match="not found"):
        resolve(str(tmp_path), "global_step4")
