"""The expert dimension in the plan (pure: no process group) and the estimator's MoE arithmetic."""
from __future__ import annotations

import pytest

from shardspeed.errors import ConfigError
from shardspeed.estimate.experts import capacity_all_to_all, moe_model_states, routed_all_to_all
from shardspeed.plan import ModelFacts, decide


def _cfg(stage: int = 0, **extra):
    return {"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": stage}, **extra}


def test_expert_dimension_from_the_model_and_from_autoep():
    plan = decide(_cfg(), 4, ModelFacts(ep_size=2))
    assert (plan.mesh.data, plan.mesh.expert, plan.mesh.shard_size, plan.mesh.expert_shard_size) == (2, 2, 4, 2)
    assert plan.batch.global_batch == 8  # every rank reads its own samples
    assert "expert" in plan.mesh.dims
    auto = decide(_cfg(expert_parallel={"enabled": True, "autoep_size": 4}), 4)
    assert (auto.mesh.data, auto.mesh.expert) == (1, 4)
    assert decide(_cfg(expert_parallel={"enabled": False, "autoep_size": 4}), 4).mesh.expert == 1


@pytest.mark.parametrize("config,facts,key", [
    (_cfg(expert_parallel={"enabled": True, "autoep_size": 4}), ModelFacts(ep_size=2), "autoep_size"),
    (_cfg(expert_parallel={"enabled": True, "autoep_size": 3}), None, "autoep_size"),
    (_cfg(), ModelFacts(ep_size=8), "ep_size"),
    (_cfg(use_data_before_expert_parallelism=True), ModelFacts(ep_size=2), "use_data_before_expert_parallelism"),
])
def test_contradictions_name_the_keys(config, facts, key):
    with pytest.raises(ConfigError, match=key):
        decide(config, 4, facts)


@pytest.mark.parametrize("stage,expected", [(0, 16 * (100 + 40 / 2)), (1, 8 * 100 + 8 * 100 / 4 + 8 * 20 + 8 * 20 / 2),
                                            (3, 16 * 100 / 4 + 16 * 20 / 2)])
def test_model_states_per_rank_by_ep(stage, expected):
    plan = decide(_cfg(stage), 4, ModelFacts(ep_size=2))  # data 2 x expert 2
    assert moe_model_states(plan, 100, 40).total == pytest.approx(expected)


def test_all_to_all_bytes():
    # 16 tokens, 4 experts, top-1, capacity 4: buffer 4 x 4 x 8 fp32 = 512 B; half leaves the rank, 4 exchanges
    assert capacity_all_to_all(16, 8, 4, 2).per_layer == 4 * 512 / 2
    assert routed_all_to_all(16, 8, 2, k=2, layers=3).per_step == 3 * 4 * (16 * 2 * 8 * 4) / 2


def test_autotuner_prices_experts_per_rank():
    """The cost model's model states of an MoE job: dense over data × expert, experts / EP over expert-data."""
    from shardspeed.autotune.model import ModelInfo, StateMemoryModel
    from shardspeed.autotune.space import Candidate

    info = ModelInfo(num_params=140, largest_unit=10, num_units=4, dtype="fp32", world_size=4, device_is_host=False,
                     expert_params=40, ep_size=2)
    for stage in (0, 1, 3):
        cand = Candidate(stage, 2, 1)
        plan = StateMemoryModel(info).plan(cand)
        assert plan.mesh.expert == 2
        assert StateMemoryModel(info).states(cand)[0] == pytest.approx(moe_model_states(plan, 100, 40).total)


@pytest.mark.parametrize("k,cf,drops", [(1, 1.0, True), (2, 0.5, True), (1, 8.0, False)])
def test_the_test_capacities_drop_tokens_or_not(k, cf, drops):
    """tests/test_moe.py's shapes (16 tokens a rank, 4 experts): its "drop" capacities do drop routes."""
    import torch

    from shardspeed.moe.gating import top1gating, top2gating

    torch.manual_seed(0)
    logits = torch.randn(16, 4) * 2
    routes = (top1gating(logits, cf, 4, use_rts=False) if k == 1
              else top2gating(logits, cf, 4, top2_2nd_expert_sampling=False))
    kept = int((routes.experts >= 0).sum())
    assert (kept < 16 * k) == drops, (kept, routes.capacity)


def test_estimate_command_prices_experts_by_ep(capsys):
    """``shardspeed estimate --params --expert-params --ep``: fp32 Adam, world 4. Stage 0 holds 16 bytes per dense
    parameter and per expert parameter / EP; stage 3 shards the dense ones over 4 ranks and the experts over the
    expert-data group (4 / EP); the all-to-all is bench_moe's model (12 layers, 8 experts, d 256, 64 tokens:
    capacity 8, 4 x 8 x 8 x 256 x 4 bytes per layer, (EP-1)/EP sent)."""
    import json

    from shardspeed.cli import main

    dense, expert = 1_000_000, 8_000_000
    for ep in (1, 2, 4):
        args = ["estimate", "--params", str(dense + expert), "--expert-params", str(expert), "--ep", str(ep),
                "--world", "4", "--dtype", "fp32", "--experts", "8", "--hidden", "256", "--tokens", "64",
                "--moe-layers", "12", "--json"]
        assert main(args) == 0
        rows = {r["stage"]: r for r in json.loads(capsys.readouterr().out)["rows"]}
        assert rows[0]["total"] == pytest.approx(16 * (dense + expert / ep))
        assert rows[3]["total"] == pytest.approx(16 * dense / 4 + 16 * (expert / ep) / (4 // ep))
        assert rows[0]["expert_data"] == 4 // ep
        assert rows[2]["all_to_all_bytes_per_step"] == pytest.approx(12 * 4 * 8 * 8 * 256 * 4 * (ep - 1) / ep)
    assert main(["estimate", "--params", "10M", "--expert-params", "20M", "--world", "4"]) == 2
    assert main(["estimate", "--params", "10M", "--expert-params", "8M", "--ep", "3", "--world", "4"]) == 2
    assert main(["estimate", "--params", "10M", "--expert-params", "8M", "--experts", "8", "--world", "4"]) == 2
    capsys.readouterr()
