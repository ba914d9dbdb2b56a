"""engine.compile() composed with tensor parallelism (our GPT, transformers' Llama), Ulysses sequence parallelism and MoE layers, and on
transformers' GPT-2 and Mixtral built from configs: 20 compiled steps equal 20 eager ones (fp32, 1e-4 relative;
backend ``aot_eager``: dynamo and AOTAutograd as inductor runs them), every block one graph with no break inside
(MoE layers stay eager, their neighbours compile), and a Hugging Face model caching by default trains without
its cache (no recompile per layer).

One 2-rank gloo group runs every case; the sequence-parallel one last (registering its attention replaces
transformers' "sdpa" entry process-wide).
"""
from __future__ import annotations

import logging

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from distributed import run_distributed
from models import gathered_params

pytest.importorskip("transformers")

STEPS, TOL, D = 20, 1e-4, 16


class MoEBlock(nn.Module):
    """A residual MLP and a residual MoE layer (shardspeed.moe.MoE: 4 experts over the expert group)."""

    def __init__(self, ep: int) -> None:
        from shardspeed.moe.layer import MoE

        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(D), nn.LayerNorm(D)
        self.mlp = nn.Sequential(nn.Linear(D, 2 * D), nn.GELU(), nn.Linear(2 * D, D))
        self.moe = MoE(D, nn.Sequential(nn.Linear(D, 2 * D), nn.GELU(), nn.Linear(2 * D, D)), num_experts=4,
                       ep_size=ep, k=2, min_capacity=4)

    def forward(self, x: torch.Tensor):
        x = x + self.mlp(self.norm1(x))
        h, aux, _ = self.moe(self.norm2(x))
        return x + h, aux


class MoENet(nn.Module):
    def __init__(self, ep: int) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(MoEBlock(ep) for _ in range(2))

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        aux = x.new_zeros(())
        for b in self.blocks:
            x, a = b(x)
            aux = aux + a
        return F.mse_loss(x, y) + 0.01 * aux


def _gpt2():
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)  # use_cache left at its default (True): compile() trains it without the cache
    return GPT2LMHeadModel(GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=2, n_head=2, resid_pdrop=0.0,
                                      embd_pdrop=0.0, attn_pdrop=0.0))


def _mixtral():
    from transformers import MixtralConfig, MixtralForCausalLM

    torch.manual_seed(0)
    return MixtralForCausalLM(MixtralConfig(vocab_size=64, hidden_size=32, intermediate_size=32, num_hidden_layers=4,
                                            num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=16,
                                            num_local_experts=4, num_experts_per_tok=2))


def _counts() -> tuple:
    from torch._dynamo.utils import counters

    return counters["stats"]["unique_graphs"], sum(counters["graph_break"].values())


def _tokens(step: int, rows: int, split: bool) -> torch.Tensor:
    import torch.distributed as dist

    g = torch.Generator().manual_seed(step + (1000 * dist.get_rank() if split else 0))
    return torch.randint(0, 64, (rows, 16), generator=g)


def _base(stage: int, micro: int, **extra) -> dict:
    return {"train_micro_batch_size_per_gpu": micro, "gradient_accumulation_steps": 1,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "eps": 1e-6}},
            "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0}, **extra}


def _engine_run(name: str, compiled: bool) -> dict:
    """20 steps of case ``name`` (eager or compiled); losses, this rank's parameters, graphs, breaks, targets."""
    import shardspeed

    if name in ("tp", "tp-dropout"):  # data 1 × model 2: our GPT's attention and MLP split over the model group
        from tp_models import make_tp_model

        drop = 0.1 if name == "tp-dropout" else 0.0  # attention dropout on split heads: the per-rank RNG stream
        model, cfg, moe = make_tp_model("gpt", dropout=drop), _base(1, 4, tensor_parallel={"autotp_size": 2}), False
    elif name == "tp-llama":  # transformers' Llama split by its preset: q/k/v and gate/up enter the region once
        from tp_models import make_tp_model

        model, cfg, moe = make_tp_model("llama"), _base(1, 4, tensor_parallel={"autotp_size": 2}), False
    elif name == "moe":  # 4 experts, 2 per rank (expert parallelism 2), ZeRO-2
        torch.manual_seed(0)
        model, cfg, moe = MoENet(ep=2), _base(2, 2), True
    elif name == "gpt2":
        model, cfg, moe = _gpt2(), _base(2, 2), False
    else:  # mixtral at ZeRO-3: 4 layers, so a unit (at most a quarter of the model) is a whole layer
        model, cfg, moe = _mixtral(), _base(3, 2), False
    params = None
    if moe:
        from shardspeed.moe.utils import split_params_into_different_moe_groups_for_optimizer as split

        params = split({"params": list(model.parameters()), "name": "dense"})
    engine, *_ = shardspeed.initialize(model=model, config=cfg, model_parameters=params)
    g0, b0 = _counts()
    if compiled:
        engine.compile(backend="aot_eager")
    torch.manual_seed(100)  # the MoE gates' random token selection draws alike in both runs
    losses = []
    for step in range(3 if name == "tp-dropout" else STEPS):
        if name == "moe":
            g = torch.Generator().manual_seed(step * 7 + engine.global_rank)
            loss = engine(torch.randn(2, 8, D, generator=g), torch.randn(2, 8, D, generator=g))
        elif name in ("tp", "tp-dropout"):
            x = _tokens(step, 4, split=False)
            loss = engine(x, torch.roll(x, -1, 1))
        elif name == "tp-llama":
            x = _tokens(step, 4, split=False)
            loss = engine(x, labels=x).loss
        else:
            x = _tokens(step, 2, split=True)
            loss = engine(x, labels=x).loss
        engine.backward(loss)
        engine.step()
        losses.append(float(loss.detach()))
    g1, b1 = _counts()
    blocks = engine.compiled_blocks
    out = {"losses": losses, "params": gathered_params(engine), "graphs": g1 - g0, "breaks": b1 - b0,
           "targets": [type(m).__name__ for m in blocks.modules], "no_cache": blocks.trains_without_cache}
    engine.destroy()
    return out


def _sp_run(compiled: bool) -> dict:
    """Ulysses at sequence parallelism 2 (tests/sp_cases.py's Llama: config.use_cache left True), ZeRO-1."""
    import sp_cases as C

    g0, b0 = _counts()
    got = C.train_sp(C.llama(4, 2, 2), C.config(1, 2, sequence_parallel_gradients="mean"),
                     C.batches(1, 1, 16, steps=STEPS), compile_backend="aot_eager" if compiled else None)
    g1, b1 = _counts()
    return {"losses": got["losses"], "params": got["params"], "graphs": g1 - g0, "breaks": b1 - b0}


def _group() -> dict:
    logging.getLogger("shardspeed").setLevel(logging.WARNING)
    out = {}
    for name in ("tp", "tp-llama", "tp-dropout", "moe", "gpt2", "mixtral"):
        out[name] = (_engine_run(name, False), _engine_run(name, True))
    out["ulysses"] = (_sp_run(False), _sp_run(True))
    return out


def _close(a, b) -> bool:
    return bool(torch.allclose(torch.as_tensor(a), torch.as_tensor(b), rtol=TOL, atol=TOL))


# case: (compiled targets, graphs at most, trains without the cache)
EXPECTED = {
    "tp": ({"Block": 2}, 1, False),  # the block's tensor-parallel collectives: functional collectives in the graph
    "tp-llama": ({"LlamaDecoderLayer": 2}, 1, True),  # the siblings' shared entry kept nothing: no recompile
    # the MoE layers eager; norms and MLPs compiled: LayerNorm twice (the first block's input needs no grad)
    "moe": ({"LayerNorm": 4, "Sequential": 2}, 3, False),
    "gpt2": ({"GPT2Block": 2}, 1, True),
    "mixtral": ({"MixtralDecoderLayer": 4}, 1, True),  # attention, router and experts (grouped_mm) in one graph
}


def test_compiled_compositions_equal_eager():
    results = run_distributed(_group, 2, timeout=600)
    for rank, res in enumerate(results):
        for name, (eager, compiled) in res.items():
            assert len(compiled["losses"]) == (3 if name == "tp-dropout" else STEPS)
            assert _close(compiled["losses"], eager["losses"]), (name, rank, compiled["losses"], eager["losses"])
            assert eager["params"] is not None
            for n, p in eager["params"].items():
                assert _close(compiled["params"][n], p), (name, rank, n)
            assert eager["breaks"] == 0
            if name == "tp-dropout":  # the RNG fork around the attention: get_state and set_state break the block
                assert compiled["breaks"] == 2 and compiled["graphs"] <= 4, (compiled["breaks"], compiled["graphs"])
                assert compiled["targets"] == ["Block", "Block"]
                continue
            assert compiled["breaks"] == 0, (name, compiled["breaks"])
            if name == "ulysses":  # two decoder layers, one graph (the sequence all-to-alls inside it)
                assert compiled["graphs"] == 1 and eager["graphs"] == 0, compiled["graphs"]
                continue
            targets, graphs, no_cache = EXPECTED[name]
            got = {t: compiled["targets"].count(t) for t in set(compiled["targets"])}
            assert got == targets, (name, got)
            assert eager["graphs"] == 0 and 1 <= compiled["graphs"] <= graphs, (name, compiled["graphs"])
            assert compiled["no_cache"] is no_cache, name


def test_training_forwards_of_a_caching_hf_model_run_without_the_cache(caplog):
    """The hook compile() adds to a Hugging Face model whose config caches (the group above shows its effect:
    GPT-2's and Mixtral's layers compile once, not once per layer): a training forward with gradients builds no
    cache, evaluation and no-grad forwards keep it, an explicit use_cache=True in training is kept with one
    warning; a model that does not cache gets no hook."""
    from shardspeed.runtime.compiled_blocks import CompiledBlocks, TrainWithoutCache, caches_in_training

    model = _gpt2()
    blocks = CompiledBlocks()
    assert not blocks.is_compiled and blocks.modules == () and not blocks.trains_without_cache
    assert caches_in_training(model)
    handle = model.register_forward_pre_hook(TrainWithoutCache("GPT2LMHeadModel"), with_kwargs=True)
    x = torch.randint(0, 64, (2, 16))
    model.train()
    assert model(x, labels=x).past_key_values is None and model.config.use_cache
    with torch.no_grad():
        assert model(x).past_key_values is not None  # no backward: the cache as configured
    model.eval()
    assert model(x).past_key_values is not None
    model.train()
    with caplog.at_level(logging.WARNING, logger="shardspeed.compile"):
        for _ in range(2):
            assert model(x, use_cache=True).past_key_values is not None
    # Only our logger's records: transformers' own warnings reach caplog when an earlier test in the same
    # process turned on its propagation (the CI order does).
    assert [r.getMessage() for r in caplog.records if r.name == "shardspeed.compile"] == [
        "GPT2LMHeadModel: a compiled training forward with use_cache=True builds a cache that training never reads "
        "and recompiles each layer once; pass use_cache=False"]
    handle.remove()
    assert model(x).past_key_values is not None
    model.config.use_cache = False
    assert not caches_in_training(model) and not caches_in_training(MoENet(ep=1))
