"""ZeRO++ (issue 25): the block codec's error bounds, qwZ / qgZ training against plain stage 3, bytes counted
at ``torch.distributed``, and hpZ equal to plain stage 3 with its backward gathers inside the node."""
from __future__ import annotations

import math
import os
import sys
from typing import Dict, List

import pytest
import torch
from distributed import run_distributed

from shardspeed.comm.quantize import BlockCodec
from shardspeed.errors import ConfigError
from shardspeed.plan import decide

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

STEPS = 50


# ---- the codec alone ---------------------------------------------------------------------------
@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("n,block", [(1000, 256), (1024, 256), (7, 4), (513, 64), (3, 256)])
def test_codec_error_within_half_a_step(bits, n, block):
    codec = BlockCodec(bits, block)
    torch.manual_seed(n)
    x = torch.randn(3, n) * torch.rand(3, 1) * 10
    x[1, : min(n, block)] = 0  # an all-zero block decodes to zeros
    codes, scales = codec.encode(x)
    assert codes.shape == (3, codec.code_bytes(n)) and scales.shape == (3, codec.blocks(n))
    out = torch.empty(3, n)
    codec.decode(codes, scales, out)
    sizes = [block] * (n // block) + ([n % block] if n % block else [])
    bound = torch.repeat_interleave(codec.bound(x), torch.tensor(sizes), dim=1)
    assert ((out - x).abs() <= bound * (1 + 1e-6) + 1e-12).all()
    assert (out[1, : min(n, block)] == 0).all()
    assert (out - x).abs().max() > 0  # it is lossy: the test can fail
    acc = out.clone()
    codec.decode(codes, scales, acc, accumulate=True)
    torch.testing.assert_close(acc, 2 * out)


def test_codec_bf16_and_wire_bytes():
    codec = BlockCodec(8, 256)
    x = torch.randn(1, 4096, dtype=torch.bfloat16)
    codes, scales = codec.encode(x)
    out = torch.empty(1, 4096, dtype=torch.bfloat16)
    codec.decode(codes, scales, out)
    assert (out.float() - x.float()).abs().max() <= codec.bound(x).max() * 1.01 + 0.01 * x.abs().max()
    assert codec.wire_bytes(4096) == 4096 + 16 * 4
    assert BlockCodec(4, 256).wire_bytes(4096) == 2048 + 16 * 4


def test_plan_refuses_zeropp_contradictions():
    base = {"train_batch_size": 8}
    plan = decide({**base, "zero_optimization": {"stage": 3, "zero_quantized_weights": True,
                                                 "zero_quantized_gradients": True, "zero_hpz_partition_size": 2,
                                                 "zero_quantized_gradients_bits": 4}}, 4)
    z = plan.sharding.zeropp
    assert (z.weights, z.weight_bits, z.gradient_bits, z.hpz, z.enabled) == ("all", 8, 4, 2, True)
    assert decide({**base, "zero_optimization": {"stage": 3, "zero_quantized_nontrainable_weights": True}},
                  2).sharding.zeropp.weights == "frozen"
    assert not decide({**base, "zero_optimization": {"stage": 3}}, 2).sharding.zeropp.enabled
    bad = [({"stage": 2, "zero_quantized_weights": True}, "zero_quantized_weights is ZeRO++"),
           ({"stage": 3, "zero_hpz_partition_size": 3}, "zero_hpz_partition_size 3 must divide the 4"),
           ({"stage": 3, "zero_quantized_gradients_bits": 6}, "zero_quantized_gradients_bits must be 8 or 4"),
           ({"stage": 3, "zero_quantization_block_size": 33}, "zero_quantization_block_size must be even")]
    for zero, message in bad:
        with pytest.raises(ConfigError, match=message):
            decide({**base, "zero_optimization": zero}, 4)


# ---- training -------------------------------------------------------------------------------------
def _config(dtype: str, zeropp: Dict, accumulation: int = 1) -> Dict:
    cfg = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": accumulation,
           "gradient_clipping": 1.0, "optimizer": {"type": "AdamW", "params": {"lr": 3e-3, "weight_decay": 0.0}},
           "zero_optimization": {"stage": 3, "overlap_comm": True, "stage3_param_persistence_threshold": 0,
                                 "reduce_bucket_size": 50_000, "stage3_prefetch_bucket_size": 50_000, **zeropp}}
    if dtype == "bf16":
        cfg["bf16"] = {"enabled": True}
    return cfg


def _batches(rank: int, world: int, steps: int, micro: int = 4, seq: int = 32):
    from shardspeed.data import encode, stdlib_corpus

    tokens = encode(stdlib_corpus(max_bytes=400_000)).long()
    g = torch.Generator().manual_seed(1234)
    out = []
    for _ in range(steps):
        starts = torch.randint(0, tokens.numel() - seq - 1, (world * micro,), generator=g)[rank * micro:(rank + 1) * micro]
        x = torch.stack([tokens[s : s + seq] for s in starts])
        y = torch.stack([tokens[s + 1 : s + seq + 1] for s in starts])
        out.append((x, y))
    return out


def _model():
    from shardspeed.models.gpt import GPT, GPTConfig

    torch.manual_seed(0)
    return GPT(GPTConfig.preset("tiny", n_layer=2, block_size=32))


def _train(cfg: Dict, steps: int, counter=None, phases: List = None, skipped: bool = False):
    import torch.distributed as dist

    import shardspeed

    engine, *_ = shardspeed.initialize(model=_model(), config=cfg)
    losses = []
    batches = _batches(dist.get_rank(), dist.get_world_size(), steps * cfg["gradient_accumulation_steps"])
    for i, (x, y) in enumerate(batches):
        if counter is not None and i == len(batches) - 1:
            counter.active = True  # the last step's bytes (after the first step traced the order)
        if phases is not None:
            phases[0] = "forward"
        loss = engine(x, y)
        if phases is not None:
            phases[0] = "backward"
        engine.backward(loss)
        if phases is not None:
            phases[0] = "step"
        engine.step()
        losses.append(float(loss.detach()))
    if counter is not None:
        counter.active = False
    if skipped:
        return losses, engine.skipped_steps
    with shardspeed.zero.GatheredParameters(list(engine.module.parameters())):
        params = [p.detach().float().clone() for p in engine.module.parameters()]
    return losses, params


VARIANTS = {"plain": {}, "qwZ": {"zero_quantized_weights": True}, "qgZ": {"zero_quantized_gradients": True},
            "qwZ+qgZ": {"zero_quantized_weights": True, "zero_quantized_gradients": True},
            "qwZ+qgZ int4": {"zero_quantized_weights": True, "zero_quantized_gradients": True,
                             "zero_quantized_gradients_bits": 4}}


def _quantized_runs() -> Dict:
    from benchmarks.harness import CommCounter

    out: Dict = {}
    counter = CommCounter()  # one: it wraps torch.distributed's functions once
    counter.install()
    for dtype in ("fp32", "bf16"):
        for name, zeropp in VARIANTS.items():
            counter.totals = {}
            losses, _ = _train(_config(dtype, zeropp), STEPS, counter)
            out[(dtype, name)] = (losses, {k: v["msg_bytes"] for k, v in counter.totals.items()})
    for name, zeropp in (("plain", {}), ("qwZ+qgZ", VARIANTS["qwZ+qgZ"])):
        cfg = _config("fp32", zeropp)  # fp16 with a scale that overflows the first steps
        cfg["fp16"] = {"enabled": True, "initial_scale_power": 40}
        out[("fp16", name)] = _train(cfg, 12, skipped=True)
        cfg = _config("fp32", zeropp)
        cfg["zero_optimization"].update(offload_param={"device": "cpu"}, offload_optimizer={"device": "cpu"})
        out[("offload", name)] = _train(cfg, 12)[0]
    return out


@pytest.fixture(scope="module")
def quantized():
    return run_distributed(_quantized_runs, 2, timeout=600)[0]


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_quantized_training_follows_plain_stage3(quantized, dtype):
    plain, _ = quantized[(dtype, "plain")]
    assert plain[-1] < plain[0] - 1.0  # it learns
    for name in VARIANTS:
        losses, _ = quantized[(dtype, name)]
        assert all(math.isfinite(v) for v in losses)
        # the end of the curve (mean of the last 5 steps) within 2% of the uncompressed run. Quantization noise
        # moves the trajectory either way: the same code gave qwZ+qgZ (fp32) 1.1% *below* plain on a fresh
        # machine (3.091 against 3.126) and under 1% on the one before, so 1% measured the box, not the codec
        tail, ref = sum(losses[-5:]) / 5, sum(plain[-5:]) / 5
        assert abs(tail - ref) / ref <= 0.02, (name, tail, ref)
        if name != "plain":
            assert losses != plain  # quantization changed something: the comparison can fail


@pytest.mark.parametrize("dtype,limit", [("fp32", 0.35), ("bf16", 0.6)])
def test_quantized_step_moves_fewer_bytes(quantized, dtype, limit):
    _, plain = quantized[(dtype, "plain")]
    _, both = quantized[(dtype, "qwZ+qgZ")]
    _, qwz = quantized[(dtype, "qwZ")]
    total = sum(plain.values())
    assert "all_to_all" not in plain and both.get("reduce_scatter", 0) == 0 and both["all_to_all"] > 0
    assert sum(both.values()) <= limit * total, (both, plain)
    # qwZ alone: the gathers shrink (int8 codes + a scale per 256 values), the reduction does not
    ratio = (1 + 4 / 256) / (4 if dtype == "fp32" else 2)
    assert qwz["all_gather"] + qwz.get("broadcast", 0) <= 1.05 * ratio * (plain["all_gather"] + plain.get("broadcast", 0))


def test_quantized_fp16_skips_the_same_overflowing_steps(quantized):
    plain, plain_skipped = quantized[("fp16", "plain")]
    losses, skipped = quantized[("fp16", "qwZ+qgZ")]
    assert plain_skipped > 0 and skipped == plain_skipped  # an inf gradient is non-finite after decoding too
    assert all(math.isfinite(v) for v in losses)
    assert abs(losses[-1] - plain[-1]) / plain[-1] <= 0.02


def test_quantized_with_cpu_offload(quantized):
    plain, losses = quantized[("offload", "plain")], quantized[("offload", "qwZ+qgZ")]
    assert losses != plain and abs(losses[-1] - plain[-1]) / plain[-1] <= 0.02
    assert abs(plain[-1] - quantized[("fp32", "plain")][0][11]) <= 1e-4  # offload itself changes nothing


# ---- hpZ at world 4 ----------------------------------------------------------------------------------
def _hpz_runs() -> Dict:
    import torch.distributed as dist

    phases = ["forward"]
    seen: List = []
    originals = {}

    def recording(name, fn):
        def wrapper(*args, **kwargs):
            if args[0].is_floating_point():  # parameters (the reducer's order broadcast is an int tensor)
                seen.append((phases[0], name, dist.get_world_size(kwargs.get("group"))))
            return fn(*args, **kwargs)
        return wrapper

    for name in ("broadcast", "all_gather_into_tensor", "all_gather_single"):
        if hasattr(dist, name):
            originals[name] = getattr(dist, name)
            setattr(dist, name, recording(name, originals[name]))
    out: Dict = {}
    try:
        for name, zeropp, accumulation in (("plain", {}, 2), ("hpz", {"zero_hpz_partition_size": 2}, 2),
                                           ("hpz+q", {"zero_hpz_partition_size": 2, "zero_quantized_weights": True,
                                                      "zero_quantized_gradients": True}, 2)):
            seen.clear()
            losses, params = _train(_config("fp32", zeropp, accumulation), 4, phases=phases)
            out[name] = (losses, params, sorted(set(seen)))
    finally:
        for name, fn in originals.items():
            setattr(dist, name, fn)
    return out


@pytest.fixture(scope="module")
def hpz():
    return run_distributed(_hpz_runs, 4, timeout=600)


def test_hpz_equals_plain_stage3(hpz):
    for rank_out in hpz:
        plain_losses, plain_params, _ = rank_out["plain"]
        losses, params, _ = rank_out["hpz"]
        assert max(abs(a - b) for a, b in zip(losses, plain_losses)) <= 1e-6
        for a, b in zip(params, plain_params):
            torch.testing.assert_close(a, b, atol=1e-6, rtol=0)


def test_hpz_backward_gathers_stay_in_the_node(hpz):
    for rank_out in hpz:
        _, _, plain_seen = rank_out["plain"]
        _, _, seen = rank_out["hpz"]
        assert {size for phase, _, size in plain_seen if phase == "backward"} == {4}
        backward = {size for phase, _, size in seen if phase == "backward"}
        forward = {size for phase, _, size in seen if phase == "forward"}
        assert backward == {2}, seen  # every backward gather inside the 2-rank node
        assert 4 in forward  # the first micro-batch's forward gathers over all 4 ranks


def test_hpz_composes_with_quantization(hpz):
    plain_losses = hpz[0]["plain"][0]
    losses = hpz[0]["hpz+q"][0]
    assert all(math.isfinite(v) for v in losses)
    assert abs(losses[-1] - plain_losses[-1]) / plain_losses[-1] <= 0.05


def test_estimator_prices_hpz_and_codes():
    from shardspeed.estimate.activations import TransformerShape
    from shardspeed.estimate.model import describe_module
    from shardspeed.estimate.peak import estimate_peak

    model = _model()
    spec = describe_module(model, shape=TransformerShape(n_layer=2, hidden=64, n_head=4, vocab=256, ffn_hidden=256,
                                                         max_seq=32))
    plain = _config("fp32", {})
    est = {name: estimate_peak(spec, {**plain, "zero_optimization": {**plain["zero_optimization"], **zeropp}},
                               world_size=4, micro_batch=4, seq_len=32)
           for name, zeropp in (("plain", {}), ("hpz", {"zero_hpz_partition_size": 2}),
                                ("q", {"zero_quantized_weights": True, "zero_quantized_gradients": True}))}
    psi = sum(p.numel() for p in model.parameters())
    extra = est["hpz"].total - est["plain"].total
    assert abs(extra - psi / 2 * 4) <= 0.02 * psi * 2  # the secondary half of the fp32 parameters
    assert 0 < est["q"].total - est["plain"].total <= 2 * 2 * max(spec.stage3_units)  # codes of one unit in flight
