"""The sequence-parallel loop of tests/sp_cases.py under DeepSpeed 0.19.8's Ulysses (ALST API, SP 2, world 2,
ZeRO 2 and 3, ``DS_ACCELERATOR=cpu``) gives the losses of the model without SP, as shardspeed does
(tests/test_sequence_parallel.py). No clipping here: DeepSpeed sums SP ranks' gradients without dividing
(its gradients are P times the true ones), which Adam does not see but a clipped norm would.

Time: the optimizer is torch's AdamW (the reference's) passed in: the config's "AdamW" makes DeepSpeed
JIT-load its CPU FusedAdam, probing the CPU in subprocesses (~5 s per rank)."""
from __future__ import annotations

import os

import pytest
from distributed import run_distributed

pytest.importorskip("deepspeed")
pytest.importorskip("transformers")
os.environ.setdefault("DS_ACCELERATOR", "cpu")


def _deepspeed_vs_reference(stages):
    import deepspeed
    import sp_cases as C
    import torch
    import torch.distributed as dist
    from deepspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPAttentionHF

    from shardspeed.parallel.sp import sequence_parallel_loss, shard_batch

    out = {}
    steps = C.batches(1, 1, 16, pad_tail=3)
    ref = C.reference(C.llama(), steps, clip=0.0)  # before DeepSpeed replaces transformers' "sdpa" entry
    deepspeed.init_distributed(dist_backend="gloo")
    mpu = None
    for stage in stages:
        model = C.llama()
        if mpu is None:  # DeepSpeed replaces the "sdpa" entry process-wide, once
            mpu = UlyssesSPAttentionHF.register_with_transformers(model, "sdpa", 2, 1)
        cfg = dict(C.config(stage, 2), gradient_clipping=0.0)
        del cfg["optimizer"]
        opt = torch.optim.AdamW(model.parameters(), lr=C.LR, weight_decay=0.0)
        engine, *_ = deepspeed.initialize(model=model, config=cfg, mpu=mpu, optimizer=opt)
        group, rank = mpu.get_sequence_parallel_group(), mpu.get_sequence_parallel_rank()
        losses = []
        for step in steps:
            b = shard_batch(step[0], rank, 2)
            logits = engine(input_ids=b["input_ids"], position_ids=b["position_ids"]).logits
            loss = sequence_parallel_loss(logits, b["shift_labels"], group)
            engine.backward(loss)
            engine.step()
            losses.append(float(loss.detach()))
        out[stage] = {"deepspeed": losses, "reference": ref["losses"], "rank": dist.get_rank()}
    return out


def test_deepspeed_ulysses_matches_reference():
    results = run_distributed(_deepspeed_vs_reference, 2, (2, 3), timeout=600)
    for res in results:
        for stage, r in res.items():
            diff = max(abs(a - b) for a, b in zip(r["deepspeed"], r["reference"]))
            assert diff < 1e-5, (stage, r)
