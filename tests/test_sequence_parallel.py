"""Sequence parallelism trains like the model without it: a tiny Llama (transformers, built from a config)
through shardspeed with Ulysses or ring attention, against the same model in one process on the same global
batch (token-mean loss per data replica, averaged over replicas; AdamW; clipped global norm; the true
gradient: ``sequence_parallel_gradients`` "mean"). Losses and
parameters within 1e-5 in fp32, on every rank (stage 3: the consolidated parameters on rank 0)."""
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
}
WORLD4 = {
    "ulysses_sp4_kv2_z0": (4, 2, 0, 4, 16, 0, {}, {}),
    "ulysses_sp4_kv2_z3": (4, 2, 3, 4, 16, 0, {}, {}),
    "sp2xdp2_z0": (4, 2, 0, 2, 16, 4, {}, {}),
    "sp2xdp2_z1": (4, 2, 1, 2, 16, 4, {}, {}),
    "sp2xdp2_z2": (4, 2, 2, 2, 16, 4, {}, {}),
    "sp2xdp2_z3": (4, 2, 3, 2, 16, 4, {}, {}),
    "ring_sp4_heads2_z2": (2, 1, 2, 4, 19, 0, {}, {"attention": "ring"}),
}


def _cases(cases):
    import sp_cases as C
    import torch.distributed as dist

    out = {}
    for name, (heads, kv, stage, sp, seq, pad_tail, extra, kw) in cases.items():
        kw = dict(kw)
        layers = kw.pop("layers", 2)
        steps = C.batches(dist.get_world_size() // sp, 1, seq, pad_tail=pad_tail)
        ref = C.reference(C.llama(heads, kv, layers), steps)
        # the true gradient ("mean"), which the clipped reference has (DeepSpeed's "sum": test_sp_grad_scale.py)
        cfg = C.config(stage, sp, **extra, sequence_parallel_gradients="mean")
        got = C.train_sp(C.llama(heads, kv, layers), cfg, steps, **kw)
        out[name] = dict(C.max_diff(got, ref), losses=got["losses"])
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
