"""Pipeline parallelism (issue 11): partitions (pure), and parity of every schedule and ZeRO stage against a
one-process plain-torch reference (fp32 1e-5 relative, 5 steps, clipping on; bf16 2e-2), tied layers,
activation checkpointing, variable sequence length, and errors instead of hangs."""
from __future__ import annotations

import itertools
from typing import Dict, List

import pytest
import torch
import torch.nn as nn
from distributed import run_distributed
from pipe_models import batches, build, config, micro_batches, mlp_specs, reference, train

from shardspeed.errors import ConfigError, DistributedError, ShardspeedError
from shardspeed.pipe import LayerSpec, PipelineModule
from shardspeed.pipe.partition import (
    bubble_fraction,
    partition_balanced,
    partition_layers,
    partition_uniform,
    rank_of_stage,
    stages_of_rank,
)

SCHEDULES = ["1f1b", "gpipe", "interleaved_1f1b", "zbv", "dualpipev"]
STEPS, LR, CLIP = 5, 1e-2, 0.5


# ---- pure arithmetic --------------------------------------------------------------------------------
def test_partition_uniform_matches_deepspeed():
    assert partition_uniform(7, 3) == [0, 3, 5, 7]  # the first 7 % 3 stages take one more
    assert partition_uniform(4, 4) == [0, 1, 2, 3, 4]


def _brute_best(weights: List[int], parts: int) -> int:
    n = len(weights)
    best = None
    for cuts in itertools.combinations(range(1, n), parts - 1):
        b = [0, *cuts, n]
        heaviest = max(sum(weights[b[i]:b[i + 1]]) for i in range(parts))
        best = heaviest if best is None else min(best, heaviest)
    return best


@pytest.mark.parametrize("weights,parts", [([5, 1, 1, 1, 5, 2], 3), ([0, 0, 100], 2), ([3, 3, 3, 3], 4),
                                           ([10, 0, 0, 1, 0, 9, 2], 3), ([1] * 9, 4), ([0, 7, 0, 7, 0], 2)])
def test_partition_balanced_is_optimal_and_never_empty(weights, parts):
    b = partition_balanced(weights, parts)
    assert b[0] == 0 and b[-1] == len(weights) and len(b) == parts + 1
    assert all(b[i] < b[i + 1] for i in range(parts)), b
    assert max(sum(weights[b[i]:b[i + 1]]) for i in range(parts)) == _brute_best(weights, parts)


def test_partition_methods_and_errors():
    assert partition_layers("type:linear", [1, 0, 1, 0, 1, 0], ["Linear", "Tanh"] * 3, 3) == [0, 2, 4, 6]
    with pytest.raises(ConfigError, match="no layers"):
        partition_uniform(3, 4)
    with pytest.raises(ConfigError, match="matches none"):
        partition_layers("type:conv", [1, 1], ["Linear", "Linear"], 2)
    with pytest.raises(ConfigError, match="partition_method"):
        partition_layers("profile", [1, 1], ["Linear", "Linear"], 2)


def test_stage_placement_and_theory():
    assert [stages_of_rank(r, 4, 2, "interleaved_1f1b") for r in range(4)] == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert [stages_of_rank(r, 4, 2, "zbv") for r in range(4)] == [[0, 7], [1, 6], [2, 5], [3, 4]]
    for sched in ("interleaved_1f1b", "zbv", "1f1b"):
        v = 1 if sched == "1f1b" else 2
        for r in range(4):
            assert all(rank_of_stage(s, 4, v, sched) == r for s in stages_of_rank(r, 4, v, sched))
    with pytest.raises(ConfigError, match="virtual_stages"):
        stages_of_rank(0, 2, 3, "dualpipev")
    assert bubble_fraction("1f1b", 4, 8) == pytest.approx(3 / 11)
    assert bubble_fraction("interleaved_1f1b", 4, 8, 2) == pytest.approx(3 / 19)


class Counted(nn.Linear):
    built = 0

    def __init__(self, *a):
        super().__init__(*a)
        if self.weight.device.type != "meta":
            Counted.built += 1


def test_module_builds_only_its_stage_and_names_layers_globally(monkeypatch):
    import torch.distributed as dist

    monkeypatch.setattr(dist, "is_initialized", lambda: False)  # no process group (other tests may leave one)
    Counted.built = 0
    m = PipelineModule([LayerSpec(Counted, 4, 4) for _ in range(6)], num_stages=3, partition_method="uniform")
    assert Counted.built == 2 and m.chunk_layers(0) == [0, 1]  # stage 0 of 3 (no process group: pipe rank 0)
    assert sorted(n for n, _ in m.named_parameters()) == ["0.bias", "0.weight", "1.bias", "1.weight"]
    m.assign_stages(3, [2])
    assert m.chunk_layers(0) == [4, 5] and {n.split(".")[0] for n, _ in m.named_parameters()} == {"4", "5"}
    with pytest.raises(ConfigError, match="no layers"):
        PipelineModule([nn.Linear(2, 2)], num_stages=2)
    with pytest.raises(ConfigError, match="stage 1 of 2 .* no trainable parameters"):
        PipelineModule([nn.Linear(2, 2), nn.Tanh()], num_stages=2, partition_method="uniform")


# ---- world 2: PP=2, every schedule, ties, checkpointing, bf16, sequence length, errors ------------------
def _engine(kind: str, gas: int, **cfg_kw):
    import shardspeed

    model_kw = cfg_kw.pop("model_kw", {})
    engine, *_ = shardspeed.initialize(model=build(kind, 2, **model_kw), config=config(gas, **cfg_kw))
    return engine


def _expect(fn, exc, text: str) -> str:
    try:
        fn()
    except exc as e:
        assert text in str(e), str(e)
        return str(e)
    raise AssertionError(f"no {exc.__name__}")


def _plain_steps(engine, data: List[tuple], gas: int) -> List[float]:
    """A plain (non-pipeline) engine over nn.Sequential of the same layers: engine(x), backward, step."""
    import torch.distributed as dist

    dp, r = dist.get_world_size(), dist.get_rank()
    losses = []
    for b in data:
        total = torch.zeros(())
        for x, y in micro_batches(b, r, dp, gas):
            loss = nn.functional.mse_loss(engine(x), y)
            engine.backward(loss)
            engine.step()
            total += loss.detach()
        dist.all_reduce(total)
        losses.append(float(total) / (gas * dp))
    return losses


def _checkpoints(root: str) -> Dict[str, object]:
    """PP=2 trains 2 steps and saves; a plain engine (data-parallel 2, ZeRO 1) loads it, trains 2 steps and
    saves; PP=2 (ZeRO 0) loads that and trains the 5th step."""
    import shardspeed

    data = batches("mlp", STEPS, 8)
    losses = []
    pp = _engine("mlp", 4)
    losses += [float(pp.train_batch(iter(mb))) for mb in _micros(data[:2], 4)]
    pp.save_checkpoint(root, tag="pp2")
    torch.manual_seed(7)  # other initial weights: the load must replace them
    seq = nn.Sequential(*[s.build() if isinstance(s, LayerSpec) else s for s in mlp_specs()])
    plain, *_ = shardspeed.initialize(model=seq, config=config(2, stage=1))
    plain.load_checkpoint(root, tag="pp2")
    losses += _plain_steps(plain, data[2:4], 2)
    plain.save_checkpoint(root, tag="plain")
    back = _engine("mlp", 4)
    back.load_checkpoint(root, tag="plain")
    losses += [float(back.train_batch(iter(mb))) for mb in _micros(data[4:], 4)]
    params = {n: p.detach().float().clone() for n, p in back.module.named_parameters()}
    return {"losses": losses, "params": params, "steps": back.global_steps}


def _micros(data: List[tuple], gas: int) -> List[List[tuple]]:
    return [micro_batches(b, 0, 1, gas) for b in data]


def _world2(root: str) -> Dict[str, object]:
    import torch.distributed as dist

    out: Dict[str, object] = {"ckpt_roundtrip": _checkpoints(root)}
    for sched in SCHEDULES:
        out[sched] = train(_engine("mlp", 4, schedule=sched), "mlp", STEPS, 4)
    out["tied_1f1b"] = train(_engine("tied", 4), "tied", STEPS, 4, seqs=[8, 6, 8, 5])
    out["tied_zbv"] = train(_engine("tied", 4, schedule="zbv"), "tied", STEPS, 4, seqs=[8, 6])
    out["ckpt"] = train(_engine("mlp", 4, model_kw={"activation_checkpoint_interval": 2}), "mlp", STEPS, 4)
    out["bf16"] = train(_engine("mlp", 4, bf16={"enabled": True}), "mlp", STEPS, 4)
    out["fp16"] = train(_engine("mlp", 4, fp16={"enabled": True, "initial_scale_power": 8}), "mlp", STEPS, 4)
    engine = _engine("mlp", 2)
    x, y = batches("mlp", 1, 4)[0]
    errors = {
        "forward": _expect(lambda: engine(x), ShardspeedError, "train_batch"),
        "backward": _expect(lambda: engine.backward(x.sum()), ShardspeedError, "train_batch"),
        "step": _expect(lambda: engine.step(), ShardspeedError, "train_batch"),
    }
    short = [(x[:2], y[:2])] * (2 if dist.get_rank() == 0 else 1)  # the last stage's iterator runs dry
    errors["count"] = _expect(lambda: engine.train_batch(iter(short)), DistributedError, "micro-batch counts disagree")
    k = dist.get_rank()  # the last stage's labels come from another micro-batch
    skewed = [(x[2 * ((i + k) % 2): 2 * ((i + k) % 2) + 2], y[2 * ((i + k) % 2): 2 * ((i + k) % 2) + 2])
              for i in range(2)]
    errors["skew"] = _expect(lambda: engine.train_batch(iter(skewed)), DistributedError, "different micro-batches")
    errors["divide"] = _expect(lambda: build("mlp", 3), ConfigError, "does not divide")
    errors["empty"] = _expect(lambda: _engine("tied", 4, schedule="interleaved_1f1b",
                                              pipeline={"schedule": "interleaved_1f1b", "virtual_stages": 3}),
                              ConfigError, "no layers")
    loss = engine.eval_batch(iter([(x[:2], y[:2])] * 2))
    out["eval"] = float(loss)
    out["errors"] = errors
    return out


@pytest.fixture(scope="module")
def ckpt_root(tmp_path_factory):
    return str(tmp_path_factory.mktemp("pipe_ckpt"))


@pytest.fixture(scope="module")
def world2(ckpt_root):
    return run_distributed(_world2, 2, ckpt_root, timeout=300)


def _close(got: Dict[str, torch.Tensor], ref: Dict[str, torch.Tensor], tol: float) -> None:
    """fp32: 1e-5 of the parameter's largest magnitude; 16-bit: 2e-2 relative and absolute, as test_parity."""
    assert got, "no parameters"
    for name, t in got.items():
        r = ref[name]
        if tol >= 1e-2:
            torch.testing.assert_close(t, r, rtol=tol, atol=tol, msg=lambda m, name=name: f"{name}: {m}")
            continue
        err = float((t - r).abs().max() / r.abs().max().clamp_min(1e-12))
        assert err < tol, f"{name}: relative error {err:.2e} >= {tol}"


def _check(results: List[dict], key: str, ref: dict, tol: float) -> None:
    for rank_out in results:
        got = rank_out[key]
        assert got["losses"] == pytest.approx(ref["losses"], rel=tol), key
        _close(got["params"], ref["params"], tol)
    names = set().union(*(set(r[key]["params"]) for r in results))
    assert names == set(ref["params"]), f"{key}: the ranks together hold every parameter"


@pytest.mark.parametrize("sched", SCHEDULES)
def test_pp2_schedule_matches_reference(world2, sched):
    _check(world2, sched, reference("mlp", batches("mlp", STEPS, 8), LR, CLIP), 1e-5)


def test_pp2_tied_embeddings_and_variable_sequence_length(world2):
    _check(world2, "tied_1f1b", reference("tied", batches("tied", STEPS, 8, [8, 6, 8, 5]), LR, CLIP), 1e-5)
    _check(world2, "tied_zbv", reference("tied", batches("tied", STEPS, 8, [8, 6]), LR, CLIP), 1e-5)


def test_pp2_activation_checkpointing(world2):
    _check(world2, "ckpt", reference("mlp", batches("mlp", STEPS, 8), LR, CLIP, checkpoint_interval=2), 1e-5)


def test_pp2_bf16_and_fp16(world2):
    _check(world2, "bf16", reference("mlp", batches("mlp", STEPS, 8), LR, CLIP, dtype=torch.bfloat16), 2e-2)
    _check(world2, "fp16", reference("mlp", batches("mlp", STEPS, 8), LR, CLIP, dtype=torch.float16), 2e-2)


def test_checkpoint_pp2_to_plain_engine_and_back(world2):
    """Entries are keyed by global layer index and name: PP=2 → plain engine (no pipeline) → PP=2 resumes
    as if never interrupted (optimizer state included)."""
    _check(world2, "ckpt_roundtrip", reference("mlp", batches("mlp", STEPS, 8), LR, CLIP), 1e-5)
    assert world2[0]["ckpt_roundtrip"]["steps"] == STEPS


def test_consolidate_pipeline_checkpoint(world2, ckpt_root, tmp_path):
    """`consolidate` of the PP=2 checkpoint (saved after 2 steps) is the whole model's state dict."""
    from shardspeed.checkpoint import consolidate, load_consolidated

    consolidate(ckpt_root, str(tmp_path), tag="pp2")
    got = load_consolidated(str(tmp_path))
    ref = reference("mlp", batches("mlp", STEPS, 8)[:2], LR, CLIP)["params"]
    assert set(got) == set(ref)
    _close(got, ref, 1e-5)


def test_pp2_errors_not_hangs(world2):
    for rank_out in world2:
        assert set(rank_out["errors"]) == {"forward", "backward", "step", "count", "skew", "divide", "empty"}
    assert "pipe rank 0: 2, pipe rank 1: 1" in world2[0]["errors"]["count"]


def test_pp2_eval_batch_returns_the_loss_everywhere(world2):
    # the engine that saw only the failed steps is untouched: eval loss = the initial model's loss
    x, y = batches("mlp", 1, 4)[0]
    model = build("mlp", 1)
    with torch.no_grad():
        expected = float(nn.functional.mse_loss(model(x[:2]), y[:2]))
    assert world2[0]["eval"] == pytest.approx(expected, rel=1e-5)
    assert world2[1]["eval"] == world2[0]["eval"]


# ---- world 4: PP2 × DP2 at ZeRO 0-3, PP=4 with every schedule ------------------------------------------
def _world4(root: str) -> Dict[str, object]:
    import shardspeed

    engine, *_ = shardspeed.initialize(model=build("mlp", 4), config=config(4))
    engine.load_checkpoint(root, tag="pp2")  # saved by PP=2 after 2 steps (world2's _checkpoints)
    data = batches("mlp", STEPS, 8)[2:]
    out: Dict[str, object] = {"pp4_from_pp2": {"losses": [float(engine.train_batch(iter(micro_batches(b, 0, 1, 4))))
                                                         for b in data],
                                              "params": {n: p.detach().float().clone()
                                                         for n, p in engine.module.named_parameters()}}}
    for stage in (0, 1, 2, 3):
        out[f"dp2_z{stage}"] = train(_engine("tied", 2, stage=stage), "tied", STEPS, 2, seqs=[8, 6])
    out["dp2_z3_zbv"] = train(_engine("mlp", 2, stage=3, schedule="zbv"), "mlp", STEPS, 2)
    for sched in SCHEDULES:
        engine, *_ = shardspeed.initialize(model=build("mlp8", 4), config=config(8, schedule=sched))
        out[f"pp4_{sched}"] = train(engine, "mlp8", STEPS, 8)
    return out


@pytest.fixture(scope="module")
def world4(world2, ckpt_root):  # after world2: it loads the checkpoint world2 saved
    return run_distributed(_world4, 4, ckpt_root, timeout=400)


def test_checkpoint_pp2_loads_at_pp4(world4):
    ref = reference("mlp", batches("mlp", STEPS, 8), LR, CLIP)
    _check(world4, "pp4_from_pp2", {"losses": ref["losses"][2:], "params": ref["params"]}, 1e-5)


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_pp2_dp2_zero_stage_matches_reference(world4, stage):
    _check(world4, f"dp2_z{stage}", reference("tied", batches("tied", STEPS, 8, [8, 6]), LR, CLIP), 1e-5)


def test_pp2_dp2_zero3_zero_bubble(world4):
    _check(world4, "dp2_z3_zbv", reference("mlp", batches("mlp", STEPS, 8), LR, CLIP), 1e-5)


@pytest.mark.parametrize("sched", SCHEDULES)
def test_pp4_schedule_matches_reference(world4, sched):
    _check(world4, f"pp4_{sched}", reference("mlp8", batches("mlp8", STEPS, 16), LR, CLIP), 1e-5)
