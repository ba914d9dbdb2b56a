"""Sharded checkpoints of tensor-parallel models (issue 10): each entry of a slice records its place in the
full tensor (``Entry.tp``), so a checkpoint saved at TP 2 × DP 2 loads at TP 1 (any DP, any ZeRO stage)
and the reverse, and ``consolidate`` writes the full state dict.

One world-4 process group, per ZeRO stage (1 and 3): an uninterrupted TP2×DP2 run of 5 AdamW steps (with
clipping) saves after step 2; fresh engines at TP1×DP4 and at TP2×DP2 load it and run steps 3-5. The
TP2×DP2 resume is bit-for-bit; TP1×DP4 sums in another order: losses and parameters to 1e-6 relative. The
TP1 engine saves at step 5 and a TP2×DP2 engine loads that (the reverse direction); a world-1 engine (TP1)
loads the TP2 checkpoint too. Consolidated checkpoints equal the one-process reference's parameters
(1e-5 relative, the parity tolerance of tests/test_tp.py) and the model's state-dict names.
"""
from __future__ import annotations

import pytest
import torch
from distributed import run_distributed
from tp_models import (
    GLOBAL_BATCH,
    full_params,
    lm_loss,
    local_params,
    make_tp_model,
    tp_batches,
    tp_config,
    tp_reference,
)

SAVE_AT = 2


# ---- pure parts: no process group -----------------------------------------------------------------
def test_slice_arithmetic_round_trips():
    """local → full → local is the identity for every slice layout; the slices of all ranks tile the
    full tensor; a local box maps to its box in the full tensor (None across fused blocks)."""
    from shardspeed.checkpoint.slices import full_to_local, local_box_to_full, local_to_full, plan_sliced

    shape = (12, 3, 4)
    full = torch.arange(12 * 3 * 4)
    for dim, blocks, size in ((0, 1, 2), (0, 3, 2), (1, 1, 3), (2, 1, 4), (0, 3, 4)):
        seen = torch.zeros(full.numel(), dtype=torch.int64)
        for rank in range(size):
            spec = (dim, blocks, rank, size)
            local = torch.arange(full.numel() // size)
            f = local_to_full(shape, spec, local)
            seen[f] += 1
            mask, back = full_to_local(shape, spec, f)
            assert bool(mask.all()) and torch.equal(back, local)
        assert bool((seen == 1).all()), (dim, blocks, size)
    # fused q/k/v (3 blocks of 4 rows), size 2, rank 1: local rows 0-1 are full rows 2-3, rows 2-3 are 6-7
    assert local_box_to_full(shape, (0, 3, 1, 2), [0, 0, 0], [2, 3, 4]) == ([2, 0, 0], [2, 3, 4])
    assert local_box_to_full(shape, (0, 3, 1, 2), [2, 1, 0], [1, 1, 4]) == ([6, 1, 0], [1, 1, 4])
    assert local_box_to_full(shape, (0, 3, 1, 2), [1, 0, 0], [2, 3, 4]) is None
    # rank 0 of TP 2 along dim 0 wants local elements [10, 30) from two TP-3-along-dim-1 entries and the rest
    entries = [((1, 1, r, 3), 0, 48) for r in range(3)]
    for chunk in (7, 1 << 22):  # chunk boundaries inside the range
        got = torch.full((20,), -1, dtype=torch.int64)
        for k, dst, src in plan_sliced(shape, (0, 1, 0, 2), 10, 30, entries, chunk=chunk):
            rank_full = local_to_full(shape, entries[k][0], torch.arange(48))
            assert bool((got[dst] == -1).all())  # each element once
            got[dst] = full[rank_full][src]
        assert torch.equal(got, local_to_full(shape, (0, 1, 0, 2), torch.arange(10, 30)))
    from shardspeed.errors import CheckpointError

    with pytest.raises(CheckpointError, match="is in no checkpoint file"):
        list(plan_sliced(shape, None, 0, 48, entries[:2]))


def test_copy_runs_equal_the_element_plan():
    """The segment-level copies give what the element-level plan gives, for slicings along the same or
    different dimensions, fused blocks, and ZeRO-style ranges that start and end inside rows."""
    from shardspeed.checkpoint.slices import copy_runs, local_to_full

    shape = (12, 8)
    full = torch.arange(96)
    cases = [((0, 3, 1, 2), [((0, 3, r, 4), 0, 24) for r in range(4)]),  # fused: TP2 from TP4
             ((1, 1, 0, 2), [((1, 1, r, 4), lo, hi) for r in range(4) for lo, hi in ((0, 5), (5, 24))]),
             (None, [((1, 1, r, 2), lo, hi) for r in range(2) for lo, hi in ((0, 17), (17, 48))]),
             ((1, 1, 1, 4), [(None, 0, 40), (None, 40, 96)]),
             ((0, 1, 1, 2), [((1, 1, r, 2), 0, 48) for r in range(2)])]  # different dimensions
    for want, entries in cases:
        n = 96 if want is None else 96 // want[3]
        for start, end in ((0, n), (3, n - 5), (7, 8)):
            got = torch.full((end - start,), -1, dtype=torch.int64)
            for k, dst, src, ln in copy_runs(shape, want, start, end, entries):
                held = full[local_to_full(shape, entries[k][0], torch.arange(entries[k][1], entries[k][2]))]
                got[dst : dst + ln] = held[src : src + ln]
            assert torch.equal(got, local_to_full(shape, want, torch.arange(start, end))), (want, start, end)
    from shardspeed.errors import CheckpointError

    with pytest.raises(CheckpointError, match="in two checkpoint entries"):
        copy_runs(shape, (1, 1, 0, 2), 0, 48, [(None, 0, 50), (None, 40, 96)])
    with pytest.raises(CheckpointError, match="is in no checkpoint file"):
        copy_runs(shape, (1, 1, 0, 2), 0, 48, [((1, 1, 1, 2), 0, 48)])


# ---- world 4 ----------------------------------------------------------------------------------------
def _train(engine, steps):
    import torch.distributed as dist

    dp, r = engine.dp_world_size, engine.mpu.get_data_parallel_rank()
    n = GLOBAL_BATCH // dp
    losses = []
    for x, y in [tp_batches()[i] for i in steps]:
        loss = lm_loss("gpt", engine, x[r * n:(r + 1) * n], y[r * n:(r + 1) * n])
        engine.backward(loss)
        engine.step()
        total = loss.detach().float().clone()
        dist.all_reduce(total)
        losses.append(float(total) / dist.get_world_size())
    return losses


def _engine(tp, stage, offload=False):
    import shardspeed

    cfg = tp_config(tp, stage)
    if offload:
        cfg["zero_optimization"]["offload_optimizer"] = {"device": "cpu"}
    engine, *_ = shardspeed.initialize(model=make_tp_model("gpt"), config=cfg)
    return engine


def _full(engine):
    """The full parameters (every rank: gathered over the model group)."""
    import torch.distributed as dist

    mine = local_params(engine)
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    return full_params(every, engine.mpu.get_model_parallel_world_size())


def _stage(out_dir, stage):
    import torch.distributed as dist

    from shardspeed.checkpoint.consolidate import consolidate, load_consolidated

    res = {}
    first = _engine(2, stage)
    _train(first, range(SAVE_AT))
    first.save_checkpoint(out_dir, "tp2")
    res["uninterrupted"] = _train(first, range(SAVE_AT, 5))
    res["uninterrupted_params"] = _full(first)
    first.save_checkpoint(out_dir, "tp2_end")
    for name, tp in (("tp1", 1), ("tp2", 2)):
        e = _engine(tp, stage)
        e.load_checkpoint(out_dir, "tp2")
        res[f"{name}_steps"] = e.global_steps
        res[name] = _train(e, range(SAVE_AT, 5))
        res[f"{name}_params"] = _full(e)
        if tp == 1:
            e.save_checkpoint(out_dir, "tp1_end")
    back = _engine(2, stage)  # the reverse: TP1×DP4 → TP2×DP2
    back.load_checkpoint(out_dir, "tp1_end")
    res["back_params"] = _full(back)
    if dist.get_rank() == 0:
        res["coverage"] = _coverage(f"{out_dir}/tp2")
        for tag in ("tp2_end", "tp1_end"):
            consolidate(f"{out_dir}/{tag}", f"{out_dir}/{tag}_full")
            res[f"{tag}_consolidated"] = load_consolidated(f"{out_dir}/{tag}_full")
    dist.barrier()
    return res


def _coverage(path):
    """Per saved tensor: (elements its weight entries hold in all, its numel, whether they are slices)."""
    from shardspeed.checkpoint.metadata import WEIGHT, CheckpointMetadata

    meta = CheckpointMetadata.read(path)
    out = {}
    for name, info in meta.tensors.items():
        es = [e for e in meta.entries if e.tensor == name and e.state == WEIGHT]
        out[name] = (sum(e.end - e.start for e in es), info.numel, any(e.tp is not None for e in es))
    return out


def _offload(out_dir):
    """Offloaded optimizer state (masters and moments in the host store, by tile): TP2×DP2 stage 2 saves
    after step 2; a TP1×DP4 stage-1 engine without offload loads it, and an offloaded TP2 engine loads the
    TP1 engine's checkpoint back."""
    first = _engine(2, 2, offload=True)
    _train(first, range(SAVE_AT))
    first.save_checkpoint(out_dir, "tp2")
    res = {"uninterrupted": _train(first, range(SAVE_AT, 5)), "uninterrupted_params": _full(first)}
    e = _engine(1, 1)
    e.load_checkpoint(out_dir, "tp2")
    res["tp1"] = _train(e, range(SAVE_AT, 5))
    res["tp1_params"] = _full(e)
    e.save_checkpoint(out_dir, "tp1_end")
    back = _engine(2, 2, offload=True)
    back.load_checkpoint(out_dir, "tp1_end")
    res["back_params"] = _full(back)
    return res


def _world4(out_dir):
    out = {stage: _stage(f"{out_dir}/stage{stage}", stage) for stage in (1, 3)}
    out["offload"] = _offload(f"{out_dir}/offload")
    return out


def _world1(out_dir):
    """One process, TP 1, ZeRO 0: loads the TP2×DP2 stage-1 checkpoint, runs steps 3-5."""
    e = _engine(1, 0)
    e.load_checkpoint(f"{out_dir}/stage1", "tp2")
    return {"losses": _train(e, range(SAVE_AT, 5)), "params": _full(e)}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("tp_ckpt")
    world4 = run_distributed(_world4, 4, str(out), timeout=300)
    world1 = run_distributed(_world1, 1, str(out), timeout=120)[0]
    return world4, world1


def _close(got, want, tol, what):
    for name, w in want.items():
        err = float((got[name] - w).norm() / w.norm())
        assert err <= tol, f"{what} {name}: relative error {err:.2e} > {tol}"


@pytest.mark.parametrize("stage", (1, 3, "offload"))
def test_resume_across_tensor_parallel_layouts(runs, stage):
    r = runs[0][0][stage]
    if stage != "offload":
        assert r["tp1_steps"] == r["tp2_steps"] == SAVE_AT
        assert r["tp2"] == r["uninterrupted"]  # same layout: bit for bit
        for name, got in r["tp2_params"].items():
            assert torch.equal(got, r["uninterrupted_params"][name]), name
    torch.testing.assert_close(torch.tensor(r["tp1"]), torch.tensor(r["uninterrupted"]), rtol=1e-6, atol=0)
    _close(r["tp1_params"], r["uninterrupted_params"], 1e-6, f"stage {stage} TP1×DP4")
    # TP1 → TP2: the loaded slices are the TP1 engine's parameters, exactly
    for name, got in r["back_params"].items():
        assert torch.equal(got, r["tp1_params"][name]), name


@pytest.mark.parametrize("stage", (1, 3))
def test_every_element_is_saved_once(runs, stage):
    """Slices of every model rank tile the tensor; replicated parameters (norms, biases of row-parallel
    layers, position embeddings) are written by model rank 0 only."""
    cov = runs[0][0][stage]["coverage"]
    for name, (held, numel, _) in cov.items():
        assert held == numel, f"{name}: {held} elements saved for {numel}"
    assert cov["blocks.0.attn.c_attn.weight"][2] and not cov["blocks.0.ln_1.weight"][2]


@pytest.mark.parametrize("stage", (1, 3))
def test_consolidate_is_the_full_state_dict(runs, stage):
    r = runs[0][0][stage]
    ref = tp_reference("gpt")["params"]
    names = set(make_tp_model("gpt").state_dict())
    for tag in ("tp2_end", "tp1_end"):
        sd = r[f"{tag}_consolidated"]
        assert set(sd) == names
        for name, want in ref.items():
            assert sd[name].shape == want.shape
        _close(sd, ref, 1e-5, f"stage {stage} {tag}")
    for name, got in r["tp2_end_consolidated"].items():
        if name in r["uninterrupted_params"]:
            assert torch.equal(got, r["uninterrupted_params"][name]), name


def test_world1_loads_a_tensor_parallel_checkpoint(runs):
    world4, world1 = runs
    r = world4[0][1]
    torch.testing.assert_close(torch.tensor(world1["losses"]), torch.tensor(r["uninterrupted"]), rtol=1e-6, atol=0)
    _close(world1["params"], r["uninterrupted_params"], 1e-6, "world 1")


# ---- pipeline × tensor parallelism (world 4) ----------------------------------------------------------
def _pipe_engine(stages, tp):
    from test_pipe_tp import _config, _model

    import shardspeed

    cfg = _config(1)
    cfg["tensor_parallel"]["autotp_size"] = tp
    engine, *_ = shardspeed.initialize(model=_model(stages, True), config=cfg)
    return engine


def _pipe_train(engine, steps):
    from test_pipe_tp import GAS, MICRO, _batches

    out = []
    for x, y in [_batches()[i] for i in steps]:
        micros = [(x[k * MICRO:(k + 1) * MICRO], y[k * MICRO:(k + 1) * MICRO]) for k in range(GAS)]
        out.append(float(engine.train_batch(iter(micros))))
    return out


def _pipe_world4(out_dir):
    """PP2 × TP2 (tied embedding split by vocabulary on both stages), ZeRO 1, saves after step 2; a
    one-stage TP1 × DP4 pipeline engine loads it and runs steps 3-5 (losses 1e-6 relative to the
    uninterrupted run, which is the reference's to 1e-5); rank 0 consolidates the end (1e-5)."""
    import torch.distributed as dist

    from shardspeed.checkpoint.consolidate import consolidate, load_consolidated

    first = _pipe_engine(2, 2)
    _pipe_train(first, range(SAVE_AT))
    first.save_checkpoint(out_dir, "pptp")
    res = {"uninterrupted": _pipe_train(first, range(SAVE_AT, 5))}
    first.save_checkpoint(out_dir, "pptp_end")
    e = _pipe_engine(1, 1)
    e.load_checkpoint(out_dir, "pptp")
    res["tp1"] = _pipe_train(e, range(SAVE_AT, 5))
    if dist.get_rank() == 0:
        consolidate(f"{out_dir}/pptp_end", f"{out_dir}/pptp_full")
        res["consolidated"] = load_consolidated(f"{out_dir}/pptp_full")
    dist.barrier()
    return res


def test_pipeline_tensor_parallel_checkpoint(tmp_path):
    from test_pipe_tp import _reference

    r = run_distributed(_pipe_world4, 4, str(tmp_path), timeout=240)[0]
    assert all(loss > 3.0 for loss in r["uninterrupted"])  # about ln 64: real losses on this rank
    torch.testing.assert_close(torch.tensor(r["tp1"]), torch.tensor(r["uninterrupted"]), rtol=1e-6, atol=0)
    ref = _reference(True)
    torch.testing.assert_close(torch.tensor(r["uninterrupted"]), torch.tensor(ref["losses"][SAVE_AT:]), rtol=1e-5,
                               atol=0)
    assert set(r["consolidated"]) >= set(ref["params"])
    _close(r["consolidated"], ref["params"], 1e-5, "PP2×TP2 consolidated")
