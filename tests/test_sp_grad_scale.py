"""Sequence-parallel gradient scale (issue 36, item 2). DeepSpeed 0.19.8 sums the SP ranks' gradients and
divides by data only (``allreduce_bucket``'s ``dp_world_size / sequence_parallel_size``), so with SP P its
gradients, their norm and what clipping sees are P times the true ones. shardspeed's default
(``sequence_parallel_gradients`` "sum") does the same; "mean" gives the true gradient.

The tiny Llama of tests/sp_cases.py, SP 2 on world 2, fp32, torch's AdamW, 3 steps, with ``gradient_clipping``
1.5 × the true norm of step 0: between clip / P and clip, so step 0 is clipped in DeepSpeed's convention and
not in the true one. DeepSpeed (ZeRO 2, ``DS_ACCELERATOR=cpu``) and shardspeed "sum" (ZeRO 2 and 3) give the
same losses, grad norms and weights to 1e-6, and the one-process reference's with its gradients times P
before the clip to 1e-5, while the true-gradient reference (what "mean" gives: test_sequence_parallel.py)
ends more than 1e-4 away."""
from __future__ import annotations

import os

import pytest
from distributed import run_distributed

pytest.importorskip("transformers")
P = 2
TOL = 1e-6


def _reference(steps, clip: float, scale: float):
    """One process, no SP: each step's replica-mean loss; the gradients times ``scale`` (DeepSpeed's P, or 1)
    before the clip; returns losses, pre-clip norms and weights."""
    import sp_cases as C
    import torch

    model = C.llama()
    opt = torch.optim.AdamW(model.parameters(), lr=C.LR, weight_decay=0.0)
    losses, norms = [], []
    for step in steps:
        opt.zero_grad()
        total = sum(model(**b).loss for b in step) / len(step)
        total.backward()
        for p in model.parameters():
            p.grad.mul_(scale)
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), clip)))
        opt.step()
        losses.append(float(total.detach()))
    return {"losses": losses, "norms": norms, "params": {n: p.detach().clone() for n, p in model.named_parameters()}}


def _config(stage: int, clip: float, grads=None) -> dict:
    import sp_cases as C

    cfg = dict(C.config(stage, P), gradient_clipping=clip)
    cfg["optimizer"] = {"type": "AdamW", "params": {"lr": C.LR, "weight_decay": 0.0, "torch_adam": True}}
    if grads is not None:
        cfg["sequence_parallel_gradients"] = grads
    return cfg


def _train(engine, mpu, steps, gathered) -> dict:
    from shardspeed.parallel.sp import sequence_parallel_loss, shard_batch

    group, rank = mpu.get_sequence_parallel_group(), mpu.get_sequence_parallel_rank()
    losses, norms = [], []
    for step in steps:
        b = shard_batch(step[0], rank, P)
        logits = engine(input_ids=b["input_ids"], position_ids=b["position_ids"]).logits
        loss = sequence_parallel_loss(logits, b["shift_labels"], group)
        engine.backward(loss)
        engine.step()
        losses.append(float(loss.detach()))
        norms.append(float(engine.get_global_grad_norm()))
    with gathered():
        params = {n: p.detach().clone() for n, p in engine.module.named_parameters()}
    return {"losses": losses, "norms": norms, "params": params}


def _ours(clip_factor: float):
    import contextlib

    import sp_cases as C

    import shardspeed
    import shardspeed.zero
    from shardspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPAttentionHF

    steps = C.batches(1, 1, 16, pad_tail=3)
    true = _reference(steps, float("inf"), 1.0)
    clip = clip_factor * true["norms"][0]
    out = {"clip": clip, "true": true, "ref_mean": _reference(steps, clip, 1.0), "ref_sum": _reference(steps, clip, P)}
    mpu = None
    for name, stage, grads in (("sum_z2", 2, None), ("sum_z3", 3, "sum")):
        model = C.llama()
        reg = UlyssesSPAttentionHF.register_with_transformers(model, "sdpa", P, 1)
        mpu = mpu or reg
        engine, *_ = shardspeed.initialize(model=model, config=_config(stage, clip, grads), mpu=reg)
        gathered = (lambda e=engine: shardspeed.zero.GatheredParameters(list(e.module.parameters()))) \
            if stage == 3 else contextlib.nullcontext
        out[name] = _train(engine, reg, steps, gathered)
    return out


def _deepspeed(clip: float):
    import contextlib
    import logging

    import deepspeed
    import sp_cases as C
    from deepspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPAttentionHF

    deepspeed.init_distributed(dist_backend="gloo")
    deepspeed.utils.logger.setLevel(logging.WARNING)
    steps = C.batches(1, 1, 16, pad_tail=3)
    model = C.llama()
    mpu = UlyssesSPAttentionHF.register_with_transformers(model, "sdpa", P, 1)
    engine, *_ = deepspeed.initialize(model=model, config=_config(2, clip), mpu=mpu)
    return _train(engine, mpu, steps, contextlib.nullcontext)


def _max_param_diff(a: dict, b: dict) -> float:
    return max(float((a[k] - b[k]).abs().max()) for k in a)


def test_sp_gradients_are_summed_over_sequence_ranks_like_deepspeed():
    pytest.importorskip("deepspeed")
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    ours = run_distributed(_ours, 2, 1.5, timeout=600)
    clip = ours[0]["clip"]
    ds = run_distributed(_deepspeed, 2, clip, timeout=600)
    true_norm = ours[0]["true"]["norms"][0]
    assert clip / P < true_norm < clip  # clipped in DeepSpeed's convention (norm P × true), not in the true one
    for rank in range(2):
        got, want = ours[rank], ds[rank]
        assert abs(want["norms"][0] - P * true_norm) < 1e-5 * P * true_norm, (want["norms"], true_norm)
        for name in ("sum_z2", "sum_z3"):
            r = got[name]
            assert max(abs(a - b) for a, b in zip(r["losses"], want["losses"])) < TOL, (name, r["losses"], want)
            assert max(abs(a - b) / b for a, b in zip(r["norms"], want["norms"])) < TOL, (name, r["norms"], want)
            assert _max_param_diff(r["params"], want["params"]) < TOL, name
            assert _max_param_diff(r["params"], got["ref_sum"]["params"]) < 1e-5, name  # the reference times P
        # the case tells the conventions apart: the true gradient's update differs by far more than the tolerance
        assert _max_param_diff(got["sum_z2"]["params"], got["ref_mean"]["params"]) > 100 * TOL
