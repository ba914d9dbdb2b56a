"""The autotuner searches the sequence-parallel degree when the sequence is long: which degrees it offers,
the candidates (data x sequence keeps the global batch; the config's ``sequence_parallel_size``; the plan
decide makes of it), and the cost model (a rank holds and computes 1/SP of each sample's tokens)."""
from __future__ import annotations

import pytest

from shardspeed.autotune.model import LinkProfile, ModelInfo, StateMemoryModel, StepTimeModel
from shardspeed.autotune.space import (
    Candidate,
    TuningSpace,
    apply_candidate,
    default_space,
    enumerate_candidates,
    sequence_parallel_sizes,
)
from shardspeed.estimate.activations import TransformerShape
from shardspeed.estimate.long_context import long_context_activations
from shardspeed.plan import decide

# a Llama-8B-like shape (32 heads, vocab 128K)
SHAPE = TransformerShape(n_layer=32, hidden=4096, n_head=32, vocab=128256, ffn_hidden=14336, max_seq=1 << 20)
PSI = 8_000_000_000


def test_sp_degrees_only_when_activations_dominate():
    short, long = 2048, 256 * 1024
    # at 2K tokens one rank's activations are well below its 16 psi / 8 bytes of model states: no SP
    assert long_context_activations(SHAPE, 1, short, 2).device_peak < 16 * PSI / 8
    assert sequence_parallel_sizes(SHAPE, short, 8, PSI, 2) == (1,)
    # at 256K they are above: every degree dividing the world and the heads
    assert long_context_activations(SHAPE, 1, long, 2).device_peak > 16 * PSI / 8
    assert sequence_parallel_sizes(SHAPE, long, 8, PSI, 2) == (1, 2, 4, 8)
    # 12 heads at world 8: 8 does not divide them (Ulysses)
    twelve = TransformerShape(n_layer=4, hidden=768, n_head=12, vocab=32000, ffn_hidden=2048, max_seq=1 << 20)
    assert sequence_parallel_sizes(twelve, 1 << 20, 8, 100_000_000) == (1, 2, 4)


def test_candidates_keep_the_global_batch_and_decide_accepts_them():
    space = default_space(4, 4, sp_sizes=(1, 2, 4))
    assert space.sp_sizes == (1, 2, 4)
    cands = enumerate_candidates(TuningSpace(stages=(3,), micro_batches=(1, 2, 4), offload_optimizer=(False,),
                                             offload_param=(False,), sp_sizes=(1, 2, 4)), 4, 4)
    by_sp = {sp: [c for c in cands if c.sp == sp] for sp in (1, 2, 4)}
    # data-parallel size 4 / 2 / 1: per-rank batches 1 / 2 / 4, every divisor a micro-batch
    assert sorted(c.micro_batch for c in by_sp[1]) == [1]
    assert sorted(c.micro_batch for c in by_sp[2]) == [1, 2]
    assert sorted(c.micro_batch for c in by_sp[4]) == [1, 2, 4]
    for c in cands:
        cfg = apply_candidate({"zero_optimization": {"stage": 0}}, c, 4)
        assert cfg.get("sequence_parallel_size", 1) == c.sp and c.dp_size(4) * c.sp == 4
        plan = decide(cfg, 4)
        assert plan.mesh.sequence == c.sp and plan.batch.global_batch == 4 and plan.mesh.shard_size == 4
    assert Candidate(3, 1, 1, sp=2).name == "z3_mbs1_gas1_sp2"


def test_cost_model_divides_tokens_by_the_sequence_degree():
    info = ModelInfo(num_params=10_000_000, largest_unit=1_000_000, num_units=10, dtype="fp32", world_size=4,
                     device_is_host=False)
    mem = StateMemoryModel(info, base=1e8, act_per_sample=4e8)
    link = LinkProfile(latency_s=1e-4, bus_bandwidth=1e9, adam_s_per_elem=2e-9, host_adam_s_per_elem=4e-9,
                       copy_bandwidth=1e10)
    one, two = Candidate(3, 1, 1, sp=1), Candidate(3, 1, 1, sp=2)
    # same ZeRO group (data x sequence = 4) and so the same model states; half the activations per rank
    assert mem.states(one) == mem.states(two)
    assert mem.predict(one)[0] - mem.predict(two)[0] == pytest.approx(2e8)
    time = StepTimeModel(info, link)
    assert time.features(two)[1] == pytest.approx(time.features(one)[1] / 2)


def test_estimate_cli_prices_long_context(capsys):
    """``shardspeed estimate --sp`` prints the estimator's per-rank bytes: model states and activations."""
    import json

    import torch

    from shardspeed.cli import main
    from shardspeed.models import GPT, GPTConfig

    assert main(["estimate", "--preset", "small", "--world", "4", "--sp", "2", "--seq-len", "4096", "--tiles", "4",
                 "--dtype", "fp32", "--offload-activations", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    cfg = GPTConfig.preset("small")
    with torch.device("meta"):
        n = GPT(cfg).num_params()
    shape = TransformerShape(n_layer=cfg.n_layer, hidden=cfg.n_embd, n_head=cfg.n_head, vocab=cfg.vocab_size,
                             ffn_hidden=4 * cfg.n_embd, max_seq=cfg.block_size)
    act = long_context_activations(shape, 1, 4096, 4, sp=2, offload=True, mlp_tiles=4, loss_tiles=4)
    b = out["bytes_per_rank"]
    assert out["local_tokens"] == 2048 and b["model_states"] == pytest.approx(16 * n / 4)
    assert b["activations_device"] == pytest.approx(act.device_peak) and b["activations_host"] == pytest.approx(
        act.host_bytes) and act.host_bytes > 0
    assert main(["estimate", "--preset", "small", "--world", "4", "--sp", "3", "--seq-len", "64"]) == 2
