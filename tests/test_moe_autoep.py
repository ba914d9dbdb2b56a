"""AutoEP (the ``expert_parallel`` block) on transformers' Mixtral, and checkpoints keyed by expert id.

World 2, EP 2: Mixtral from a tiny config trains like transformers' own Mixtral without expert parallelism
in one process (the mean of the two ranks' losses, router auxiliary loss included) at ZeRO 2 and 3, also
when every token goes to the experts of rank 0 (rank 1's experts idle: ZeRO 3 must not hang, their
gradients are zero); a save at EP 2 resumes bit-exactly at EP 2 and like the continuation at EP 1.
"""
from __future__ import annotations

from typing import Any, Dict, List

import pytest
import torch

from tests.distributed import run_distributed

STEPS, B, T, VOCAB = 2, 2, 8, 64


def _mixtral(seed: int = 0):
    from transformers import MixtralConfig, MixtralForCausalLM

    cfg = MixtralConfig(vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                        num_attention_heads=2, num_key_value_heads=1, num_local_experts=4, num_experts_per_tok=2,
                        max_position_embeddings=32, output_router_logits=True, router_aux_loss_coef=0.05,
                        tie_word_embeddings=False)
    torch.manual_seed(seed)
    return MixtralForCausalLM(cfg)


def _batches(world: int, steps: int = STEPS, seed: int = 5) -> List[List[torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [[torch.randint(0, VOCAB, (B, T), generator=g) for _ in range(world)] for _ in range(steps)]


def _config(stage: int, ep: int) -> Dict[str, Any]:
    cfg: Dict[str, Any] = {"train_micro_batch_size_per_gpu": B, "gradient_accumulation_steps": 1,
                           "optimizer": {"type": "AdamW", "params": {"lr": 0.01, "weight_decay": 0.0,
                                                                      "torch_adam": True}},
                           "zero_optimization": {"stage": stage}}
    if ep > 1:
        cfg["expert_parallel"] = {"enabled": True, "autoep_size": ep, "preset_model": "mixtral"}
    return cfg


def _idle_router(model) -> None:
    with torch.no_grad():  # every token's top-2: experts 0 and 1 (rank 0's at EP 2)
        for layer in model.model.layers:
            layer.mlp.gate.weight.zero_()
            layer.mlp.gate.weight[:2, 0] = 1e-3


def _step(engine, ids) -> float:
    import torch.distributed as dist

    loss = engine(input_ids=ids, labels=ids).loss
    engine.backward(loss)
    engine.step()
    mean = loss.detach().clone()
    dist.all_reduce(mean)
    return float(mean) / dist.get_world_size()


def _run(tmp: str) -> Dict[str, Any]:
    import torch.distributed as dist

    import shardspeed

    rank, world = dist.get_rank(), dist.get_world_size()
    out: Dict[str, Any] = {}
    for name, stage, idle in (("z2", 2, False), ("z3", 3, False), ("z3-idle", 3, True)):
        model = _mixtral()
        if idle:
            _idle_router(model)
        engine, *_ = shardspeed.initialize(model=model, config=_config(stage, 2))
        out[name] = [_step(engine, b[rank]) for b in _batches(world)]
        if idle:
            grads = [float(engine.get_global_grad_norm())]
            out[name + "-norm"] = grads
    # checkpoint: save at EP 2 after 2 steps, continue 2; resume at EP 2 and at EP 1
    batches = _batches(world, 4, seed=9)
    engine, *_ = shardspeed.initialize(model=_mixtral(), config=_config(2, 2))
    for b in batches[:2]:
        _step(engine, b[rank])
    engine.save_checkpoint(tmp, tag="ep2")
    out["cont"] = [_step(engine, b[rank]) for b in batches[2:]]
    for ep in (2, 1):
        engine, *_ = shardspeed.initialize(model=_mixtral(seed=1), config=_config(2, ep))
        engine.load_checkpoint(tmp, tag="ep2")
        out[f"resume{ep}"] = [_step(engine, b[rank]) for b in batches[2:]]
    out["dir"] = tmp
    return out


def _reference(idle: bool = False) -> List[float]:
    model = _mixtral()
    if idle:
        _idle_router(model)
    opt = torch.optim.AdamW(model.parameters(), lr=0.01, weight_decay=0.0)
    losses = []
    for chunks in _batches(2):
        opt.zero_grad()
        loss = torch.stack([model(input_ids=ids, labels=ids).loss for ids in chunks]).mean()
        loss.backward()
        opt.step()
        losses.append(float(loss))
    return losses


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    pytest.importorskip("transformers")
    return run_distributed(_run, 2, str(tmp_path_factory.mktemp("moe_ckpt")), timeout=400)[0]


@pytest.mark.parametrize("name", ["z2", "z3"])
def test_autoep_mixtral_matches_transformers(results, name):
    assert results[name] == pytest.approx(_reference(), rel=1e-5, abs=1e-6)


def test_autoep_idle_experts_at_stage3(results):
    assert results["z3-idle"] == pytest.approx(_reference(idle=True), rel=1e-5, abs=1e-6)


def test_checkpoint_ep2_resumes_at_ep2_and_ep1(results):
    assert results["resume2"] == results["cont"]  # bit-exact
    assert results["resume1"] == pytest.approx(results["cont"], rel=1e-5, abs=1e-6)



def test_consolidate_gives_hf_names(results, tmp_path):
    from shardspeed.checkpoint.consolidate import consolidate, load_consolidated

    consolidate(results["dir"], str(tmp_path), tag="ep2")
    full = load_consolidated(str(tmp_path))
    names = set(_mixtral().state_dict())
    assert set(full) == names
    assert full["model.layers.0.mlp.experts.gate_up_proj"].shape == (4, 64, 16)  # all four experts, by id
