"""The pure parts of sequence parallelism: the batch split, tiled compute against untiled, the plan."""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from shardspeed.errors import ConfigError
from shardspeed.parallel.sp import (
    SequenceTiledCompute,
    TiledFusedLogitsLoss,
    TiledMLP,
    padded_length,
    sequence_tiled_compute,
    shard_batch,
    unshard,
)
from shardspeed.plan import ModelFacts, decide


def _batch(seq=7):
    ids = torch.arange(2 * seq).view(2, seq) % 11
    return {"input_ids": ids, "labels": ids.clone(), "attention_mask": torch.ones(2, seq, dtype=torch.long)}


@pytest.mark.parametrize("layout,world", [("contiguous", 2), ("contiguous", 3), ("zigzag", 2), ("zigzag", 4)])
def test_shard_batch_pads_shifts_and_reassembles(layout, world):
    b = _batch(7)
    parts = [shard_batch(b, r, world, layout=layout, pad_token_id=99) for r in range(world)]
    total = padded_length(7, world, layout)
    assert total % (world * (2 if layout == "zigzag" else 1)) == 0 and total >= 7
    ids = unshard([p["input_ids"] for p in parts], layout)
    labels = unshard([p["shift_labels"] for p in parts], layout)
    pos = unshard([p["position_ids"] for p in parts], layout)
    mask = unshard([p["attention_mask"] for p in parts], layout)
    assert torch.equal(ids[:, :7], b["input_ids"]) and (ids[:, 7:] == 99).all()
    # labels shifted before sharding: token t predicts t+1, -100 at the end and over the padding
    assert torch.equal(labels[:, :6], b["labels"][:, 1:]) and (labels[:, 6:] == -100).all()
    assert torch.equal(pos, torch.arange(total).expand(2, -1)) and mask[:, 7:].sum() == 0
    assert "labels" not in parts[0] and all(p["input_ids"].shape[1] == total // world for p in parts)


def test_zigzag_puts_head_and_tail_chunks_together():
    parts = [shard_batch({"input_ids": torch.arange(8).view(1, 8)}, r, 2, layout="zigzag") for r in range(2)]
    assert parts[0]["input_ids"].tolist() == [[0, 1, 6, 7]] and parts[1]["input_ids"].tolist() == [[2, 3, 4, 5]]


class _MLP(nn.Module):
    def __init__(self, h=6):
        super().__init__()
        self.up, self.down = nn.Linear(h, 2 * h), nn.Linear(2 * h, h)

    def forward(self, x):
        return self.down(torch.nn.functional.gelu(self.up(x)))


def _grads(module, x):
    return [x.grad.clone()] + [p.grad.clone() for p in module.parameters()]


def test_tiled_mlp_and_sequence_tiled_compute_match_untiled():
    torch.manual_seed(0)
    mlp = _MLP()
    x0 = torch.randn(2, 9, 6)
    x = x0.clone().requires_grad_()
    (mlp(x) ** 2).sum().backward()
    want = _grads(mlp, x)
    for run in (lambda x: TiledMLP.apply(lambda m, xs: m(xs), mlp, x, 4, None),
                lambda x: sequence_tiled_compute(lambda hidden: mlp(hidden), 9, 2, {"hidden": x}, {}, "hidden",
                                                 list(mlp.parameters()), output_reduction=None)):
        mlp.zero_grad()
        x = x0.clone().requires_grad_()
        (run(x) ** 2).sum().backward()
        for a, b in zip(_grads(mlp, x), want):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    with pytest.raises(ConfigError, match="output_reduction"):
        SequenceTiledCompute.apply(lambda hidden: hidden, 9, 2, ["hidden"], [], "hidden", None, 1, "max", x0)


def test_tiled_fused_logits_loss_matches_untiled():
    torch.manual_seed(0)
    head = nn.Linear(6, 13, bias=False)
    x0, y = torch.randn(2, 10, 6), torch.randint(0, 13, (2, 10))
    y[0, 7:] = -100

    def loss_fn(m, xs, ys):
        return torch.nn.functional.cross_entropy(m(xs).reshape(-1, 13), ys.reshape(-1), reduction="sum")

    x = x0.clone().requires_grad_()
    (loss_fn(head, x, y) * 0.5).backward()
    want = _grads(head, x)
    head.zero_grad()
    x = x0.clone().requires_grad_()
    (TiledFusedLogitsLoss.apply(loss_fn, head, x, y, None, 3, None, "sum") * 0.5).backward()
    for a, b in zip(_grads(head, x), want):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_plan_sequence_dimension():
    cfg = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 3, "sequence_parallel_size": 2,
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}, "zero_optimization": {"stage": 2}}
    plan = decide(cfg, 8)
    m = plan.mesh
    assert (m.data, m.sequence, m.shard_size, m.batch_world) == (4, 2, 8, 4)
    assert "sequence" in m.dims and plan.sharding.unit_world == 8  # ZeRO shards over data × sequence
    assert plan.batch.global_batch == 2 * 3 * 4  # SP ranks share samples: the batch counts data only
    with pytest.raises(ConfigError, match="sequence_parallel_size 2 with pipeline"):
        decide(cfg, 8, ModelFacts(pipeline_stages=2))
    with pytest.raises(ConfigError, match="sequence_parallel_size 4"):
        decide(dict(cfg, sequence_parallel_size=4), 6)


def test_long_context_estimate_per_rank():
    from shardspeed.estimate.activations import TransformerShape
    from shardspeed.estimate.long_context import long_context_activations

    shape = TransformerShape(n_layer=4, hidden=64, n_head=4, vocab=1000, ffn_hidden=128, max_seq=1 << 20)
    one = long_context_activations(shape, 1, 4096, 4)
    two = long_context_activations(shape, 1, 4096, 4, sp=2)
    assert (one.local_tokens, two.local_tokens) == (4096, 2048)
    assert abs(two.device_peak / one.device_peak - 0.5) < 0.05  # every term is linear in the local tokens
    off = long_context_activations(shape, 1, 4096, 4, sp=2, offload=True)
    assert off.host_bytes == 4 * 4 * 2048 * 64 and off.device_peak == two.device_peak - off.host_bytes
    tiled = long_context_activations(shape, 1, 4096, 4, sp=2, loss_tiles=8, mlp_tiles=4)
    assert tiled.device_peak < 0.5 * two.device_peak  # the logits dominate at vocab 1000 > hidden 64
    ring = long_context_activations(shape, 1, 4095, 4, sp=8, attention="ring", kv_heads=1)
    assert ring.local_tokens == 512  # padded to a multiple of 2P = 16
    with pytest.raises(ConfigError, match="does not divide"):
        long_context_activations(shape, 1, 4096, 4, sp=8)


def test_long_context_peak_prices_the_plain_loss_as_its_own_phase():
    """The model's own loss runs with no stage-3 unit gathered but the persistent ones and no gradient
    bucket yet: at a long sequence its peak is the held states plus the loss's working set (measured on the
    106M Llama: within 3%; priced with the backward's buffers it was 18-25% high). The tiled loss holds the
    head's unit and makes its gradient in the forward, so it stays in the backward phase."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from shardspeed.estimate.activations import TransformerShape
    from shardspeed.estimate.long_context import long_context_peak
    from shardspeed.estimate.model import describe_module

    hf = LlamaConfig(vocab_size=4000, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=4, tie_word_embeddings=False)
    cfg = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 3},
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}}
    shape = TransformerShape(n_layer=2, hidden=64, n_head=4, vocab=4000, ffn_hidden=128, max_seq=1 << 20)
    with torch.device("meta"):
        spec = describe_module(LlamaForCausalLM(hf), cfg, shape=shape)
    long, act = long_context_peak(spec, cfg, 2, 8192, 4, sp=2)
    assert long.phase == "loss" and "grad_buckets" not in long.terms
    persistent = sum(n for n in spec.stage3_units if n < 100_000) * 4  # DeepSpeed's default threshold, fp32
    assert long.terms["gathered"] == persistent and long.terms["activations"] == act.loss_peak
    assert act.device_peak == max(act.loss_peak, act.layer_peak) and act.loss_peak > act.layer_peak
    tiled, _ = long_context_peak(spec, cfg, 2, 8192, 4, sp=2, loss_tiles=8, mlp_tiles=8)
    assert tiled.phase == "backward" and tiled.terms["grad_buckets"] > 0
    short, _ = long_context_peak(spec, cfg, 2, 64, 4, sp=2)
    assert short.phase == "backward" and short.terms["gathered"] > persistent


class _SelfAttention(nn.Module):
    """An attention module: ``sp`` marks it as a sequence-parallel function does."""

    def __init__(self, sp: bool):
        super().__init__()
        self.proj, self.sp = nn.Linear(4, 4), sp

    def forward(self, x):
        if self.sp:
            from shardspeed.parallel.sp import mark_sequence_parallel

            mark_sequence_parallel(self)
        return self.proj(x)


class _BertAttention(nn.Module):  # an outer "attention" module holding the inner one (transformers' Bert)
    def __init__(self, sp: bool):
        super().__init__()
        self.self = _SelfAttention(sp)

    def forward(self, x):
        return self.self(x)


def test_first_forward_check_names_the_attention_module_that_skipped_sequence_parallelism():
    from shardspeed.runtime.sequence_parallel.attention_check import attention_modules, check_attention_on_first_forward

    ok = nn.Sequential(_BertAttention(True), _BertAttention(True))
    assert [n for n, _ in attention_modules(ok)] == ["0.self", "1.self"]  # the innermost only
    check_attention_on_first_forward(ok, 2)
    for _ in range(2):  # checked at the first call, then its hooks are gone
        ok(torch.ones(1, 4))
    assert all(not m._forward_hooks and not m._forward_pre_hooks for m in ok.modules())
    bad = nn.Sequential(_BertAttention(True), _BertAttention(False))
    check_attention_on_first_forward(bad, 2)
    with pytest.raises(ConfigError, match=r"^sequence_parallel_size 2: attention module '1.self' \(_SelfAttention\) "
                                          r"ran plain attention over this rank's shard"):
        bad(torch.ones(1, 4))
    bad(torch.ones(1, 4))  # one refusal: the hooks went with it
    plain = nn.Sequential(nn.Linear(4, 4))
    check_attention_on_first_forward(plain, 1)  # nothing to check at SP 1
    plain(torch.ones(1, 4))
    check_attention_on_first_forward(plain, 4)
    with pytest.raises(ConfigError, match="the first forward of Sequential ran no attention"):
        plain(torch.ones(1, 4))


def test_register_refuses_a_loaded_model_of_another_attention_implementation():
    pytest.importorskip("transformers")
    from sp_cases import llama, plain_sdpa

    from shardspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPAttentionHF

    with pytest.raises(ConfigError, match="core_attn_implementation 'sdpa' does not match the model's attention "
                                          "implementation 'eager'"):
        UlyssesSPAttentionHF.register_with_transformers(llama(attn="eager"), "sdpa", 2, 1)
    assert plain_sdpa()  # refused before anything was registered


class _Layer(nn.Module):  # a transformer block holding an attention module
    def __init__(self, sp: bool):
        super().__init__()
        self.attn = _BertAttention(sp)

    def forward(self, x):
        return self.attn(x)


def test_first_forward_check_hooks_the_block_not_the_attention_inside_it():
    """Attention inside a block (the repeated children of a ModuleList) is checked by hooks on its block, so
    engine.compile() sees a hook-free block and compiles it whole."""
    from shardspeed.runtime.compiling import compile_targets
    from shardspeed.runtime.sequence_parallel.attention_check import check_attention_on_first_forward

    ok = nn.ModuleList([_Layer(True), _Layer(True)])
    ok.forward = lambda x: ok[1](ok[0](x))  # type: ignore[method-assign]
    check_attention_on_first_forward(ok, 2)
    assert all(len(b._forward_hooks) == 1 and len(b._forward_pre_hooks) == 1 for b in ok)
    assert not any(m._forward_hooks or m._forward_pre_hooks for b in ok for m in b.modules() if m is not b)
    assert compile_targets(ok) == list(ok)  # whole blocks
    ok(torch.ones(1, 4))
    assert all(not m._forward_hooks and not m._forward_pre_hooks for m in ok.modules())
    bad = nn.ModuleList([_Layer(True), _Layer(False)])
    bad.forward = lambda x: bad[1](bad[0](x))  # type: ignore[method-assign]
    check_attention_on_first_forward(bad, 2)
    with pytest.raises(ConfigError, match=r"^sequence_parallel_size 2: attention module '1.attn.self' "
                                          r"\(_SelfAttention\) ran plain attention over this rank's shard"):
        bad(torch.ones(1, 4))
    assert all(not m._forward_hooks and not m._forward_pre_hooks for m in bad.modules())
