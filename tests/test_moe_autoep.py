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
    """A zero router: equal scores, and torch.topk breaks the tie the same way for every token (experts 2 and
    3 on this build, checked in the test): the first step sends nothing to one rank's experts at EP 2."""
    with torch.no_grad():
        for layer in model.model.layers:
            layer.mlp.gate.weight.zero_()


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
    for name, stage, idle in (("z2", 2, False), ("z3", 3, False), ("z3-idle", 3, True), ("z3-ckpt", 3, False)):
        model = _mixtral()
        if idle:
            _idle_router(model)
        cfg = _config(stage, 2)
        if name.endswith("ckpt"):  # every decoder layer checkpointed: its recompute repeats the exchanges
            cfg["activation_checkpointing"] = {"enabled": True}
        engine, *_ = shardspeed.initialize(model=model, config=cfg)
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


@pytest.mark.parametrize("name", ["z2", "z3", "z3-ckpt"])
def test_autoep_mixtral_matches_transformers(results, name):
    assert results[name] == pytest.approx(_reference(), rel=1e-5, abs=1e-6)


def test_autoep_idle_experts_at_stage3(results):
    chosen = set(map(tuple, torch.topk(torch.softmax(torch.zeros(64, 4), -1), 2, dim=-1)[1].tolist()))
    assert len(chosen) == 1 and set(next(iter(chosen))) in ({0, 1}, {2, 3})  # one rank's experts get no token
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


def _tiny(family: str):
    import transformers

    common = dict(vocab_size=VOCAB, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                  num_key_value_heads=1, max_position_embeddings=32, output_router_logits=True)
    if family == "qwen3_moe":
        cfg = transformers.Qwen3MoeConfig(intermediate_size=32, moe_intermediate_size=8, num_experts=4,
                                          num_experts_per_tok=2, head_dim=8, **common)
        return transformers.Qwen3MoeForCausalLM(cfg)
    cfg = transformers.DeepseekV3Config(intermediate_size=32, moe_intermediate_size=8, n_routed_experts=4,
                                        num_experts_per_tok=2, n_shared_experts=1, first_k_dense_replace=0,
                                        n_group=1, topk_group=1, kv_lora_rank=8, q_lora_rank=None,
                                        qk_rope_head_dim=4, qk_nope_head_dim=4, v_head_dim=8, **common)
    return transformers.DeepseekV3ForCausalLM(cfg)


@pytest.mark.parametrize("family", ["qwen3_moe", "deepseek_v3"])
@pytest.mark.parametrize("grouped", [True, False])
def test_autoep_blocks_compute_what_transformers_computes(family, grouped):
    """One process (EP 1): the converted experts give transformers' loss and gradients (grouped_mm or bmm)."""
    pytest.importorskip("transformers")
    from types import SimpleNamespace

    from shardspeed.moe.autoep import ExpertParallelExperts, convert_model

    torch.manual_seed(0)
    ref = _tiny(family)
    ours = _tiny(family)
    ours.load_state_dict(ref.state_dict())
    cfg = SimpleNamespace(preset_model=None, expert_pattern=None, moe_layer_pattern=None, use_grouped_mm=grouped)
    assert convert_model(ours, cfg, None, 0, 1) == 1
    assert any(isinstance(m, ExpertParallelExperts) for m in ours.modules())
    ids = torch.randint(0, VOCAB, (2, T), generator=torch.Generator().manual_seed(1))
    a, b = ref(input_ids=ids, labels=ids).loss, ours(input_ids=ids, labels=ids).loss
    a.backward()
    b.backward()
    assert float(b) == pytest.approx(float(a), rel=1e-6)
    for (name, p), q in zip(ref.named_parameters(), ours.parameters()):
        assert torch.allclose(p.grad, q.grad, rtol=1e-5, atol=1e-7), name
