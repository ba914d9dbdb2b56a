"""DeepSpeed's checkpoints load into shardspeed and continue the run; ours convert to DeepSpeed's layout and
DeepSpeed continues them (DeepSpeed 0.19.8 as the oracle, gloo, ``DS_ACCELERATOR=cpu``; skipped without it).

World 2: DeepSpeed trains ``N`` steps of the tiny MLP, saves at ZeRO s and goes on for ``M`` steps (its
uninterrupted run); shardspeed at ZeRO t, built from another seed, loads the checkpoint and trains the same
``M`` steps: the losses equal DeepSpeed's to 1e-6 for every s and t in 0-3 (fp32), for bf16 (saved at
ZeRO 0, 1, 3), and for fp16 (ZeRO 2, with its dynamic loss scale moving; DeepSpeed refuses fp16 on its CPU
accelerator, so the test lets it: its ZeRO path runs on CPU tensors) to 1e-3, where DeepSpeed's run and
ours differ by one fp16 rounding with or without a checkpoint (the loaded run equals ours uninterrupted
exactly, and the scale goes on from DeepSpeed's); also a tied-embedding model, a frozen layer, two
parameter groups and ZeRO-2's ``elastic_checkpoint`` layout. DeepSpeed's universal layout
(``ds_to_universal``) of ZeRO 2 and 3 checkpoints loads the same way. Round trip: shardspeed saves,
``shardspeed convert`` writes DeepSpeed's layout for world 2 at ZeRO t (fp32 0-3, bf16 1 and 3, fp16 2), and
DeepSpeed continues with the losses shardspeed's own run has. World 4: the world-2 checkpoints
load at another world size and stage, and the parameters and Adam moments then saved equal DeepSpeed's
own (gathered with its ``safe_get_full_*`` API) exactly. DeepSpeed's default optimizers (FusedAdam, which
keeps Adam's ``step`` as an int, built as DeepSpeed's CPU op; torch's Adam and AdamW with ``torch_adam``)
load at ZeRO 0-3 with the parameters and moments DeepSpeed saved, exactly, and continue DeepSpeed's run.
"""
from __future__ import annotations

import logging
import os
import shutil
import subprocess
import sys
from typing import Any, Dict, List

import pytest
import torch
from distributed import run_distributed
from models import make_batches, make_model, micro_batch

pytest.importorskip("deepspeed")
os.environ.setdefault("DS_ACCELERATOR", "cpu")

N, M = 2, 3
TOL = 1e-6  # fp32 and bf16: the continued runs come out bit-equal
#: fp16 with a moving loss scale: DeepSpeed's ZeRO-2 and ours differ by one fp16 rounding of a loss at scale
#: 512, checkpoint or not; the loaded run equals our own uninterrupted one exactly
FP16_TOL = 1e-3
WORLD4_CASES = [(0, 1), (1, 2), (2, 3), (3, 0)]  # (DeepSpeed's stage at world 2, ours at world 4)
#: ours -> DeepSpeed's layout at (stage, dtype), DeepSpeed continues
ROUND_TRIPS = [(0, "fp32"), (1, "fp32"), (2, "fp32"), (3, "fp32"), (1, "bf16"), (3, "bf16"), (2, "fp16")]
#: (DeepSpeed's stage, ds_to_universal's extra flags): loaded at ZeRO (s + 1) % 4
UNIVERSAL_CASES = [(3, []), (2, ["--inject_missing_state"])]
#: (DeepSpeed's stage, dtype, ours)
LOW_PRECISION_CASES = [(1, "bf16", 0), (1, "bf16", 3), (0, "bf16", 1), (3, "bf16", 2), (2, "fp16", 1), (2, "fp16", 3)]
#: (model, DeepSpeed's stage, ours): tied weights, a frozen layer, two optimizer groups, ZeRO's elastic layout
EXTRA_CASES = [("tied", 3, 1), ("tied", 0, 2), ("mlp_frozen", 1, 3), ("mlp_frozen", 3, 0), ("groups", 0, 3),
               ("groups", 3, 2), ("elastic", 2, 0)]


#: DeepSpeed's own optimizers, as its config picks them (stage, type, extra params): without ``torch_adam``
#: it builds FusedAdam (on ``DS_ACCELERATOR=cpu`` its CPU op, JIT-compiled once per machine), which keeps
#: Adam's ``step`` as an int; ``Adam`` means AdamW unless ``adam_w_mode`` is false (then L2 decay)
DEFAULT_CASES = [(0, "AdamW", {}), (1, "AdamW", {}), (2, "Adam", {}), (3, "AdamW", {}),
                 (1, "Adam", {"adam_w_mode": False}), (3, "Adam", {"adam_w_mode": False}),
                 (2, "Adam", {"torch_adam": True}), (1, "Adam", {"adam_w_mode": False, "torch_adam": True})]


def _config(stage: int, dtype: str = "fp32", opt: tuple = ("AdamW", {"torch_adam": True})) -> dict:
    cfg = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1, "gradient_clipping": 0.5,
           "optimizer": {"type": opt[0], "params": {"lr": 1e-2, "weight_decay": 0.01, **opt[1]}},
           "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 10, "warmup_max_lr": 1e-2}},
           "zero_optimization": {"stage": stage, "reduce_bucket_size": 300, "stage3_param_persistence_threshold": 0}}
    if dtype == "bf16":
        cfg["bf16"] = {"enabled": True}
    if dtype == "fp16":
        cfg["fp16"] = {"enabled": True, "initial_scale_power": 8, "loss_scale_window": 2}  # the scale moves
    return cfg


def _train(engine, batches) -> List[float]:
    """Each step's global mean loss (world × 2 samples per step)."""
    import torch.distributed as dist

    world, rank = dist.get_world_size(), dist.get_rank()
    dtype = next(engine.module.parameters()).dtype
    out = []
    for b in batches:
        x, y = micro_batch(b, rank, world, 0, 1)
        x, y = (t.to(dtype) if t.is_floating_point() else t for t in (x, y))
        loss = engine(x, y)
        engine.backward(loss)
        engine.step()
        total = loss.detach().float().clone()
        dist.all_reduce(total)
        out.append(float(total) / world)
    return out


def _deepspeed():
    import deepspeed
    from deepspeed.accelerator import get_accelerator

    type(get_accelerator()).is_fp16_supported = lambda self: True  # its ZeRO fp16 path runs on CPU tensors
    if not deepspeed.comm.is_initialized():
        deepspeed.init_distributed(dist_backend="gloo")  # over the group the harness created
    deepspeed.utils.logger.setLevel(logging.WARNING)
    return deepspeed


def _ds_state(engine, stage: int) -> Dict[str, List[torch.Tensor]]:
    """DeepSpeed's full fp32 parameters and Adam moments, by its own API."""
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

    out = {}
    for name, p in engine.module.named_parameters():
        if stage == 0:
            st = engine.optimizer.state[p]
            out[name] = [p.detach().float().clone(), st["exp_avg"].clone(), st["exp_avg_sq"].clone()]
        else:
            out[name] = [safe_get_full_fp32_param(p).clone()] + [
                safe_get_full_optimizer_state(p, k).clone() for k in ("exp_avg", "exp_avg_sq")]
    return out


def _model(kind: str, seed: int = 0):
    """The model and the parameter groups both engines get: ``groups`` is the MLP with two groups (biases
    without weight decay and at another learning rate); ``tied``, ``mlp_frozen`` as in models.py."""
    model = make_model("mlp" if kind in ("groups", "elastic") else kind, seed)
    trained = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    if kind != "groups":
        return model, [p for _, p in trained]
    return model, [{"params": [p for n, p in trained if n.endswith("weight")], "weight_decay": 0.1},
                   {"params": [p for n, p in trained if n.endswith("bias")], "weight_decay": 0.0, "lr": 3e-3}]


def _ds_run(ds, base: str, stage: int, dtype: str, batches, kind: str = "mlp") -> Dict[str, Any]:
    model, params = _model(kind)
    cfg = _config(stage, dtype)
    if kind == "elastic":  # its lean layout: a state per group, no optimizer groups saved
        cfg["zero_optimization"]["elastic_checkpoint"] = True
    engine, *_ = ds.initialize(model=model, config=cfg, model_parameters=params)
    _train(engine, batches[:N])
    engine.save_checkpoint(f"{base}/{kind}{stage}{dtype}", client_state={"marker": stage})
    state = _ds_state(engine, stage) if dtype == "fp32" and kind == "mlp" else None
    losses = _train(engine, batches[N:])
    return {"losses": losses, "state": state, "scale": float(engine.optimizer.loss_scale) if dtype == "fp16" else None}


def _ours_continue(load_dir: str, stage: int, dtype: str, batches, tag=None, kind: str = "mlp") -> Dict[str, Any]:
    import shardspeed

    model, params = _model(kind, seed=7)
    engine, *_ = shardspeed.initialize(model=model, config=_config(stage, dtype), model_parameters=params)
    _, client = engine.load_checkpoint(load_dir, tag=tag)
    steps = engine.global_steps
    losses = _train(engine, batches[N:])
    return {"losses": losses, "client": client, "steps": steps, "scale": float(engine.cur_scale)}


def _round_trip(ds, base: str, stage: int, batches, dtype: str = "fp32") -> Dict[str, Any]:
    """Ours trains and saves; convert writes DeepSpeed's layout at ``stage``; both continue."""
    import torch.distributed as dist

    import shardspeed
    from shardspeed.checkpoint.deepspeed_layout.export import export_deepspeed

    engine, *_ = shardspeed.initialize(model=make_model("mlp"), config=_config(stage, dtype))
    _train(engine, batches[:N])
    engine.save_checkpoint(f"{base}/rt{stage}{dtype}", client_state={"marker": stage})
    if dist.get_rank() == 0:
        export_deepspeed(f"{base}/rt{stage}{dtype}", f"{base}/rt_ds{stage}{dtype}", world=2, stage=stage,
                         ds_config=_config(stage, dtype))
    dist.barrier()
    ours = _train(engine, batches[N:])
    model = make_model("mlp", seed=7)
    dse, *_ = ds.initialize(model=model, config=_config(stage, dtype), model_parameters=list(model.parameters()))
    _, client = dse.load_checkpoint(f"{base}/rt_ds{stage}{dtype}")
    return {"ours": ours, "deepspeed": _train(dse, batches[N:]), "marker": client.get("marker"),
            "scales": (float(engine.cur_scale), float(dse.optimizer.loss_scale)) if dtype == "fp16" else None}


def _errors(base: str) -> Dict[str, Any]:
    """A missing rank file and an unknown version: one-line CheckpointErrors, the engine untouched."""
    import torch.distributed as dist
    from models import gathered_params

    import shardspeed
    from shardspeed.errors import CheckpointError

    if dist.get_rank() == 0:
        for name in ("missing", "version"):
            shutil.copytree(f"{base}/mlp2fp32", f"{base}/{name}")
        os.remove(f"{base}/missing/global_step2/zero_pp_rank_1_mp_rank_00_optim_states.pt")
        file = f"{base}/version/global_step2/mp_rank_00_model_states.pt"
        sd = torch.load(file, weights_only=False)
        sd["ds_version"] = "9.1.0"
        torch.save(sd, file)
    dist.barrier()
    engine, *_ = shardspeed.initialize(model=make_model("mlp", seed=7), config=_config(2))
    before = gathered_params(engine)
    out: Dict[str, Any] = {}
    for name in ("missing", "version"):
        try:
            engine.load_checkpoint(f"{base}/{name}")
            out[name] = None
        except CheckpointError as exc:
            out[name] = str(exc)
    after = gathered_params(engine)
    out["untouched"] = all(torch.equal(before[n], after[n]) for n in before)
    return out


def _world2(base: str) -> Dict[str, Any]:
    import torch.distributed as dist

    import shardspeed

    ds = _deepspeed()
    batches = make_batches("mlp", N + M, 4)
    out: Dict[str, Any] = {"ds": {}, "ours": {}, "rt": {}, "fresh": {}}
    for stage in range(4):
        out["ds"][(stage, "fp32")] = _ds_run(ds, base, stage, "fp32", batches)
    out["ds"][(1, "bf16")] = _ds_run(ds, base, 1, "bf16", batches)
    out["ds"][(2, "fp16")] = _ds_run(ds, base, 2, "fp16", batches)
    for s in range(4):
        for t in range(4):
            out["ours"][(s, "fp32", t)] = _ours_continue(f"{base}/mlp{s}fp32", t, "fp32", batches)
    for s, dtype in ((0, "bf16"), (3, "bf16")):
        out["ds"][(s, dtype)] = _ds_run(ds, base, s, dtype, batches)
    for s, dtype, t in LOW_PRECISION_CASES:
        out["ours"][(s, dtype, t)] = _ours_continue(f"{base}/mlp{s}{dtype}", t, dtype, batches)
        if dtype == "fp16":  # our own uninterrupted run
            engine, *_ = shardspeed.initialize(model=make_model("mlp"), config=_config(t, dtype))
            out["fresh"][(dtype, t)] = _train(engine, batches)[N:]
    for kind, s, t in EXTRA_CASES:
        out["ds"][(kind, s)] = _ds_run(ds, base, s, "fp32", make_batches(kind, N + M, 4), kind)
        out["ours"][(kind, s, t)] = _ours_continue(f"{base}/{kind}{s}fp32", t, "fp32", make_batches(kind, N + M, 4),
                                                   kind=kind)
    if dist.get_rank() == 0:  # DeepSpeed's own converter to its universal layout (ZeRO 1-2 need its flag)
        for s, extra in UNIVERSAL_CASES:
            args = ["--input_folder", f"{base}/mlp{s}fp32/global_step2", "--output_folder",
                    f"{base}/mlp{s}fp32/global_step2_universal", "--num_extract_workers", "1",
                    "--num_merge_workers", "1"] + extra
            subprocess.run([sys.executable, "-m", "deepspeed.checkpoint.ds_to_universal"] + args, check=True,
                           capture_output=True, env={**os.environ, "DS_ACCELERATOR": "cpu"})
    dist.barrier()
    out["universal"] = {s: _ours_continue(f"{base}/mlp{s}fp32", (s + 1) % 4, "fp32", batches,
                                          tag="global_step2_universal") for s, _ in UNIVERSAL_CASES}
    for stage, dtype in ROUND_TRIPS:
        out["rt"][(stage, dtype)] = _round_trip(ds, base, stage, batches, dtype)
    out["errors"] = _errors(base)
    return out


def _world4(base: str) -> List[str]:
    import shardspeed

    paths = []
    for s, t in WORLD4_CASES:
        engine, *_ = shardspeed.initialize(model=make_model("mlp", seed=7), config=_config(t))
        engine.load_checkpoint(f"{base}/mlp{s}fp32")
        paths.append(engine.save_checkpoint(f"{base}/w4_{s}_{t}"))
    return paths


def _default_optimizers(base: str) -> Dict[str, Any]:
    """Each of :data:`DEFAULT_CASES`: DeepSpeed trains N steps, saves, and goes on for M; ours (at the next
    stage) loads, saves at once (to compare the loaded state with DeepSpeed's) and trains the same M steps."""
    import shardspeed

    ds = _deepspeed()
    batches = make_batches("mlp", N + M, 4)
    out: Dict[Any, Any] = {}
    for i, (s, name, params) in enumerate(DEFAULT_CASES):
        opt = (name, params)
        model = make_model("mlp")
        engine, *_ = ds.initialize(model=model, config=_config(s, opt=opt), model_parameters=list(model.parameters()))
        inner = getattr(engine.optimizer, "optimizer", engine.optimizer)
        _train(engine, batches[:N])
        engine.save_checkpoint(f"{base}/default{i}", client_state={"marker": i})
        state = _ds_state(engine, s)
        want = _train(engine, batches[N:])
        t = s % 3 + 1
        ours, *_ = shardspeed.initialize(model=make_model("mlp", seed=7), config=_config(t, opt=opt))
        _, client = ours.load_checkpoint(f"{base}/default{i}")
        saved, steps = ours.save_checkpoint(f"{base}/default{i}_ours"), ours.global_steps
        out[i] = {"class": type(inner).__name__, "ds": want, "ds_state": state, "ours": _train(ours, batches[N:]),
                  "client": client, "steps": steps, "saved": saved}
    return out


@pytest.fixture(scope="module")
def default_results(tmp_path_factory, deepspeed_fused_adam):
    base = str(tmp_path_factory.mktemp("ds_default_opt"))
    return run_distributed(_default_optimizers, 2, base, timeout=900, collective_timeout=300.0)[0]


def test_deepspeeds_default_optimizers_continue(default_results):
    """FusedAdam (int ``step``) and torch's Adam/AdamW, as DeepSpeed's config picks them: the loaded
    parameters and moments equal DeepSpeed's exactly, and the continued losses DeepSpeed's own."""
    for i, (s, name, params) in enumerate(DEFAULT_CASES):
        got = default_results[i]
        what = f"DeepSpeed ZeRO {s} {name} {params} ({got['class']}) -> ours {s % 3 + 1}"
        assert got["class"] == ("FusedAdam" if not params.get("torch_adam") else
                                "Adam" if params.get("adam_w_mode") is False else "AdamW"), what
        assert got["steps"] == N and got["client"] == {"marker": i}, what
        loaded = _read_ours(got["saved"], got["ds_state"])
        for n, want in got["ds_state"].items():
            for g, w, st in zip(loaded[n], want, ("weights", "exp_avg", "exp_avg_sq")):
                assert torch.equal(g, w.float().reshape(-1)), f"{what}: {n} {st}"
    diffs = {i: max(abs(a - b) for a, b in zip(default_results[i]["ours"], default_results[i]["ds"]))
             for i in range(len(DEFAULT_CASES))}
    assert all(d <= TOL for d in diffs.values()), [(DEFAULT_CASES[i], default_results[i]["class"], d)
                                                        for i, d in diffs.items()]


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    base = str(tmp_path_factory.mktemp("ds_ckpt"))
    # rank 0 runs DeepSpeed's ds_to_universal (a subprocess) while rank 1 waits at a barrier: minutes on a busy box
    return base, run_distributed(_world2, 2, base, timeout=600, collective_timeout=300.0)[0]


def _close(got: List[float], want: List[float], tol: float, what: str) -> None:
    torch.testing.assert_close(torch.tensor(got, dtype=torch.float64), torch.tensor(want, dtype=torch.float64),
                               rtol=tol, atol=tol, msg=lambda m: f"{what}: {m}")


def test_every_stage_continues_deepspeeds_run(results):
    _, r = results
    for case, got in r["ours"].items():
        if isinstance(case[0], str):
            continue
        s, dtype, t = case
        want = r["ds"][(s, dtype)]["losses"]
        _close(got["losses"], want, FP16_TOL if dtype == "fp16" else TOL, f"DeepSpeed ZeRO {s} {dtype} -> ours {t}")
        assert got["steps"] == N and got["client"] == {"marker": s}
        if dtype == "fp16":  # the dynamic loss scale went on from where DeepSpeed's was (doubling every 2 steps)
            assert got["scale"] == r["ds"][(s, dtype)]["scale"] > 2 ** 8, (s, t, got["scale"])
            assert got["losses"] == r["fresh"][(dtype, t)], (s, t)


def test_tied_frozen_and_grouped_models_continue(results):
    _, r = results
    for kind, s, t in EXTRA_CASES:
        got = r["ours"][(kind, s, t)]
        _close(got["losses"], r["ds"][(kind, s)]["losses"], TOL, f"{kind}: DeepSpeed ZeRO {s} -> ours {t}")
        assert got["steps"] == N


def test_universal_layout_continues(results):
    _, r = results
    for s, got in r["universal"].items():
        _close(got["losses"], r["ds"][(s, "fp32")]["losses"], TOL, f"universal of ZeRO {s} -> ours {(s + 1) % 4}")
        assert got["steps"] == N


def test_round_trip_through_deepspeeds_layout(results):
    _, r = results
    for (stage, dtype), got in r["rt"].items():
        _close(got["deepspeed"], got["ours"], FP16_TOL if dtype == "fp16" else TOL, f"ours -> DeepSpeed ZeRO {stage} {dtype}")
        assert got["marker"] == stage
        if dtype == "fp16":  # DeepSpeed's loss scale went on from ours
            assert got["scales"][0] == got["scales"][1] > 2 ** 8, got["scales"]


def test_unmappable_checkpoints_fail_before_loading(results):
    _, r = results
    err = r["errors"]
    assert err["missing"] is not None and "zero_pp_rank_1_mp_rank_00_optim_states.pt is missing" in err["missing"]
    assert "partition_count" in err["missing"]
    assert err["version"] is not None and "'ds_version'" in err["version"] and "mp_rank_00_model_states.pt" in err["version"]
    assert all("\n" not in e for e in (err["missing"], err["version"]))
    assert err["untouched"]


def test_loads_at_world_four_exactly(results):
    from shardspeed.checkpoint.format import ShardReader
    from shardspeed.checkpoint.metadata import CheckpointMetadata
    from shardspeed.checkpoint.ranges import EntryIndex, read_range

    base, r = results
    paths = run_distributed(_world4, 4, base, timeout=600, collective_timeout=300.0)[0]
    for (s, t), path in zip(WORLD4_CASES, paths):
        meta = CheckpointMetadata.read(path)
        assert meta.world_size == 4 and meta.zero_stage == t
        reader, index = ShardReader(path), EntryIndex(meta.entries, meta.shapes)
        for name, want in r["ds"][(s, "fp32")]["state"].items():
            n = want[0].numel()
            for state, w in zip(("", "exp_avg", "exp_avg_sq"), want):
                got = read_range(reader, index, name, state, 0, n).view(w.shape)
                assert torch.equal(got, w.float()), f"DeepSpeed ZeRO {s} -> ours {t} at world 4: {name} {state}"


def _read_ours(path: str, names) -> Dict[str, List[torch.Tensor]]:
    from shardspeed.checkpoint.format import ShardReader
    from shardspeed.checkpoint.metadata import CheckpointMetadata
    from shardspeed.checkpoint.ranges import EntryIndex, read_range

    meta = CheckpointMetadata.read(path)
    reader, index = ShardReader(path), EntryIndex(meta.entries, meta.shapes)
    return {n: [read_range(reader, index, n, st, 0, meta.tensors[n].numel) for st in ("", "exp_avg", "exp_avg_sq")]
            for n in names}


def test_convert_command_both_ways(results, capsys):
    """``shardspeed convert``: DeepSpeed's ZeRO-2 checkpoint to ours holds DeepSpeed's parameters and moments
    exactly; ours to DeepSpeed's ZeRO-1 layout for 4 ranks reads back (through our DeepSpeed reader) the
    same; a shardspeed checkpoint without --world/--stage is a usage error naming them."""
    from shardspeed.checkpoint.deepspeed_layout import open_deepspeed
    from shardspeed.checkpoint.ranges import EntryIndex, read_range
    from shardspeed.cli import main

    base, r = results
    want = r["ds"][(2, "fp32")]["state"]
    assert main(["convert", f"{base}/mlp2fp32", f"{base}/cli_ours"]) == 0
    got = _read_ours(f"{base}/cli_ours/global_step2", want)
    for name, w in want.items():
        for g, x in zip(got[name], w):
            assert torch.equal(g, x.float().reshape(-1)), name
    assert main(["convert", f"{base}/cli_ours", f"{base}/cli_ds", "--world", "4", "--stage", "1"]) == 0
    assert len([f for f in os.listdir(f"{base}/cli_ds/global_step2") if f.endswith("optim_states.pt")]) == 4
    src = open_deepspeed(f"{base}/cli_ds", "global_step2")
    assert src is not None and src.meta.world_size == 4 and src.meta.zero_stage == 1
    index = EntryIndex(src.meta.entries, src.meta.shapes)
    for name, w in want.items():
        for st, x in zip(("", "exp_avg", "exp_avg_sq"), w):
            assert torch.equal(read_range(src.reader, index, name, st, 0, x.numel()), x.float().reshape(-1)), name
    capsys.readouterr()
    assert main(["convert", f"{base}/cli_ours", f"{base}/cli_bad"]) == 1
    assert "--world and --stage" in capsys.readouterr().err
