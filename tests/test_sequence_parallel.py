"""Sequence parallelism trains like the model without it: a tiny Llama (transformers, built from a config)
through shardspeed with Ulysses or ring attention, against the same model in one process on the same global
batch (token-mean loss per data replica, averaged over replicas; AdamW; clipped global norm; the true
gradient: ``sequence_parallel_gradients`` "mean"). Losses and parameters within 1e-5 in fp32, on every rank
(stage 3: the consolidated parameters on rank 0).

Registering replaces transformers' "sdpa" entry process-wide (DeepSpeed's behaviour): each rank computes its
references before the first registration. The "ds_order" cases train in DeepSpeed's documented order:
register (by the path of a saved config, or with another loaded model), then build, then initialize; the
forward-logits test does the same at SP 2 and SP 4 (2 KV heads), and shows the first-forward check."""
from __future__ import annotations

import pytest
from distributed import run_distributed

pytest.importorskip("transformers")

TOL = 1e-5
CKPT = {"activation_checkpointing": {"enabled": True, "cpu_checkpointing": True}}

# name: (heads, kv_heads, stage, sp, seq, pad_tail, config extra, train_sp keywords and "layers")
WORLD2 = {
    "ulysses_z0": (4, 2, 0, 2, 16, 0, {}, {}),
    "ulysses_z3": (4, 2, 3, 2, 16, 0, {}, {}),
    "ckpt_offload_tiled_z2": (4, 2, 2, 2, 16, 0, CKPT, {"tiled": 3, "tiled_loss": 3}),
    "ckpt_offload_z3": (4, 2, 3, 2, 16, 0, CKPT, {}),
    # stage 3 with tiling: the MLP's Linears are units (released between their calls); with 4 layers (a
    # unit is at most a quarter of the model) whole decoder layers are. (At 4 layers, more tiles or the
    # tiled loss move a few Adam updates of near-zero gradients by ~1.5e-5, at stage 2 alike: summation order)
    "tiled_mlp_tiled_loss_z3": (4, 2, 3, 2, 16, 0, {}, {"tiled": 3, "tiled_loss": 3}),
    "ckpt_offload_tiled_z3_layer_units": (4, 2, 3, 2, 16, 0, CKPT, {"tiled": 2, "layers": 4}),
    "tiled_mlp_z1": (4, 2, 1, 2, 16, 0, {}, {"tiled": 2}),
    "gqa_sp2_kv1_z1": (4, 1, 1, 2, 16, 0, {}, {}),
    "seq13_padded_z2": (4, 2, 2, 2, 13, 5, {}, {}),
    "ring_sp2_heads1_z2": (1, 1, 2, 2, 14, 3, {}, {"attention": "ring"}),
    "ds_order_path_z2": (4, 2, 2, 2, 16, 0, {}, {"order": "path"}),
}
WORLD4 = {
    "ulysses_sp4_kv2_z0": (4, 2, 0, 4, 16, 0, {}, {}),
    "ulysses_sp4_kv2_z3": (4, 2, 3, 4, 16, 0, {}, {}),
    "sp2xdp2_z0": (4, 2, 0, 2, 16, 4, {}, {}),
    "sp2xdp2_z1": (4, 2, 1, 2, 16, 4, {}, {}),
    "sp2xdp2_z2": (4, 2, 2, 2, 16, 4, {}, {}),
    "sp2xdp2_z3": (4, 2, 3, 2, 16, 4, {}, {}),
    "ring_sp4_heads2_z2": (2, 1, 2, 4, 19, 0, {}, {"attention": "ring"}),
    "ds_order_loaded_sp4_kv2_z1": (4, 2, 1, 4, 16, 0, {}, {"order": "loaded"}),
}


def _cases(cases):
    import shutil
    import tempfile

    import sp_cases as C
    import torch.distributed as dist

    # every reference first: the first registration replaces "sdpa" in this process
    refs = {}
    for name, (heads, kv, _, sp, seq, pad_tail, _, kw) in cases.items():
        steps = C.batches(dist.get_world_size() // sp, 1, seq, pad_tail=pad_tail)
        refs[name] = (steps, C.reference(C.llama(heads, kv, kw.get("layers", 2)), steps))
    out = {}
    tmp = tempfile.mkdtemp()
    for name, (heads, kv, stage, sp, _, _, extra, kw) in cases.items():
        kw = dict(kw)
        layers, order = kw.pop("layers", 2), kw.pop("order", None)
        steps, ref = refs[name]
        model = C.llama(heads, kv, layers)
        if order is not None:  # DeepSpeed's order: register (a path, or another loaded model), then build
            if order == "path":
                kw["register_with"] = tempfile.mkdtemp(dir=tmp)
                C.llama_config(heads, kv, layers).save_pretrained(kw["register_with"])
            else:
                kw["register_with"] = C.llama(heads, kv, layers, seed=7)
            model = lambda heads=heads, kv=kv, layers=layers: C.llama(heads, kv, layers)  # noqa: E731
        # the true gradient ("mean"), which the clipped reference has (DeepSpeed's "sum": test_sp_grad_scale.py)
        got = C.train_sp(model, C.config(stage, sp, **extra, sequence_parallel_gradients="mean"), steps, **kw)
        out[name] = dict(C.max_diff(got, ref), losses=got["losses"])
    shutil.rmtree(tmp)
    return out


def _check(results, cases):
    for name in cases:
        per_rank = [r[name] for r in results]
        for rank, res in enumerate(per_rank):
            assert res["loss"] < TOL and res["param"] < TOL, (name, rank, res)
        # the same loss on every rank (sequence shards and data replicas alike)
        assert all(r["losses"] == per_rank[0]["losses"] for r in per_rank), (name, [r["losses"] for r in per_rank])


def test_sequence_parallel_world2():
    _check(run_distributed(_cases, 2, WORLD2, timeout=600), WORLD2)


def test_sequence_parallel_world4():
    _check(run_distributed(_cases, 4, WORLD4, timeout=900), WORLD4)


def _deepspeed_order_logits():
    """Forward logits in DeepSpeed's order, gathered over the sequence group, against references computed
    before any registration; then the first-forward check's refusals."""
    import tempfile

    import sp_cases as C
    import torch
    import torch.distributed as dist
    from transformers import LlamaForCausalLM

    import shardspeed
    from shardspeed.errors import ConfigError
    from shardspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPAttentionHF

    ids = torch.randint(0, C.VOCAB, (2, 16), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        ref = C.llama(4, 2)(input_ids=ids).logits  # "sdpa" still transformers' own here
    tmp = tempfile.TemporaryDirectory()
    path = [tmp.name]
    dist.broadcast_object_list(path, src=0)  # transformers writes a checkpoint on rank 0 only
    path = path[0]
    if dist.get_rank() == 0:
        C.llama(4, 2).save_pretrained(path)
    dist.barrier()
    out = {}
    # SP 2 (x DP 2): registered with another loaded model, then the trained model built from a config
    mpu = UlyssesSPAttentionHF.register_with_transformers(C.llama(4, 2, seed=5), "sdpa", 2, 2)
    engine, *_ = shardspeed.initialize(model=C.llama(4, 2), config=C.config(0, 2, micro=2), mpu=mpu)
    out["sp2_built"] = float((C.sp_logits(engine, ids, mpu) - ref).abs().max())
    # SP 4, 2 KV heads (replicated), ZeRO 3: registered by path, then from_pretrained
    mpu = UlyssesSPAttentionHF.register_with_transformers(path, "sdpa", 4, 2)
    model = LlamaForCausalLM.from_pretrained(path, attn_implementation="sdpa")
    engine, *_ = shardspeed.initialize(model=model, config=C.config(3, 4, micro=2), mpu=mpu)
    out["sp4_from_pretrained_z3"] = float((C.sp_logits(engine, ids, mpu) - ref).abs().max())
    # a model whose attention is not the registered one: the first forward stops with one line
    for name, model in (("eager", C.llama(4, 2, attn="eager")),
                        ("no_attention", torch.nn.Sequential(torch.nn.Embedding(C.VOCAB, 8)))):
        engine, *_ = shardspeed.initialize(model=model, config=C.config(0, 4, micro=2), mpu=mpu)
        try:
            engine(ids[:, :4])
            out[name] = None
        except ConfigError as e:
            out[name] = str(e)
    dist.barrier()
    tmp.cleanup()
    return out


def test_deepspeed_order_forward_logits_and_first_forward_check():
    for res in run_distributed(_deepspeed_order_logits, 4, timeout=600):
        assert res["sp2_built"] < TOL and res["sp4_from_pretrained_z3"] < TOL, res
        assert "attention module 'model.layers.0.self_attn' (LlamaAttention, attn_implementation 'eager') ran " \
               "plain attention" in res["eager"], res
        assert "\n" not in res["eager"]
        assert res["no_attention"].startswith("sequence_parallel_size 4: the first forward of Sequential ran no "
                                              "attention through the sequence-parallel attention"), res
