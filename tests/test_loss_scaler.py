"""Loss scalers: hand-written scale sequences, the floor error, and DeepSpeed as an oracle."""

import logging
import random

import pytest
import torch

from shardspeed.errors import LossScaleError
from shardspeed.precision import (
    DynamicLossScaler,
    StaticLossScaler,
    build_loss_scaler,
    has_inf_or_nan,
)

O, N = True, False  # noqa: E741  (overflow / clean step: one letter keeps the flag tables readable)


def run(scaler, flags):
    out = []
    for f in flags:
        scaler.update(f)
        out.append(scaler.scale)
    return out


def test_hysteresis_2_window_3_not_consecutive():
    s = DynamicLossScaler(init_scale=16, scale_window=3, min_scale=1, hysteresis=2)
    flags = [O, O, N, N, N, N, N, O, N, O, O, N]
    # it0: O uses up one hysteresis (2->1), scale stays; it1: O halves; it2..4: stable 0,1,2;
    # it5: stable 3 -> doubles and refills hysteresis; it7: O -> hysteresis 1; it8: N does not refill;
    # it9, it10: O halve each time (counter stays 1).
    assert run(s, flags) == [16, 8, 8, 8, 8, 16, 16, 16, 16, 8, 4, 4]


def test_hysteresis_2_window_3_consecutive():
    s = DynamicLossScaler(init_scale=16, scale_window=3, min_scale=1, hysteresis=2, consecutive_hysteresis=True)
    flags = [O, O, N, N, N, N, N, O, N, O, O, N]
    # Same until it8, whose clean step refills the counter: it9 only uses it up, it10 halves.
    assert run(s, flags) == [16, 8, 8, 8, 8, 16, 16, 16, 16, 16, 8, 8]


def test_growth_from_start_window_3():
    s = DynamicLossScaler(init_scale=1, scale_window=3, min_scale=1, hysteresis=2)
    # last_overflow_iter starts at -1, so the first doubling is at it3, then every 3 steps.
    assert run(s, [N] * 7) == [1, 1, 1, 2, 2, 2, 4]


def test_min_scale_floor_raises():
    s = DynamicLossScaler(init_scale=3, scale_window=1000, min_scale=1, hysteresis=1)
    assert run(s, [O, O]) == [1.5, 1]  # the second halving is clamped to the floor
    with pytest.raises(LossScaleError) as e:
        s.update(True)
    msg = str(e.value)
    assert "minimum loss scale" in msg and "bf16" in msg and "learning rate" in msg


def test_min_scale_with_hysteresis_uses_counter_before_raising():
    s = DynamicLossScaler(init_scale=1, scale_window=1000, min_scale=1, hysteresis=2)
    s.update(True)  # counter 2 -> 1, no error
    assert s.scale == 1
    with pytest.raises(LossScaleError):
        s.update(True)


def test_skip_at_floor_flag():
    s = DynamicLossScaler(init_scale=4, scale_window=2, min_scale=1, hysteresis=1, raise_error_at_min_scale=False)
    # 4 -> 2 -> 1 -> stays 1 -> stays 1; then clean it4 (stable 0), it5 (1), it6 (2 -> double).
    assert run(s, [O, O, O, O, N, N, N]) == [2, 1, 1, 1, 1, 1, 2]


def test_state_dict_round_trip():
    a = DynamicLossScaler(init_scale=16, scale_window=3, hysteresis=2)
    run(a, [O, N, O, N])
    b = DynamicLossScaler(init_scale=16, scale_window=3, hysteresis=2)
    b.load_state_dict(a.state_dict())
    flags = [N, N, O, O, N, N, N, N]
    assert run(b, flags) == run(a, flags)


def test_static_scaler():
    s = StaticLossScaler(128.0)
    s.update(True)
    s.update(False)
    assert s.scale == 128.0 and not s.dynamic and s.loss_scale == 128.0


def test_static_scaler_skip_warning_names_dtype_and_cause():
    """A skipped step under a static scaler names what happened: an fp16 overflow under the scale, or
    non-finite gradients in fp32/bf16 training (no loss scaling there to overflow)."""
    cases = [
        (StaticLossScaler(128.0), "fp16 overflow (inf/nan gradients) with static loss scale 128: step skipped"),
        (build_loss_scaler(fp16_enabled=False, compute_dtype=torch.float32),
         "non-finite gradients (inf/nan) in fp32 training (no loss scaling): step skipped"),
        (build_loss_scaler(fp16_enabled=False, compute_dtype=torch.bfloat16),
         "non-finite gradients (inf/nan) in bf16 training (no loss scaling): step skipped"),
        (build_loss_scaler(fp16_enabled=False), "non-finite gradients (inf/nan) in fp32/bf16 training"),
        (build_loss_scaler(fp16_enabled=True, loss_scale=512, compute_dtype=torch.float16),
         "fp16 overflow (inf/nan gradients) with static loss scale 512"),
    ]
    log = logging.getLogger("shardspeed.precision.loss_scaler")
    records: list = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = records.append  # type: ignore[method-assign]
    log.addHandler(handler)  # on the logger itself: the "shardspeed" logger may not propagate to the root
    try:
        for scaler, expected in cases:
            records.clear()
            scaler.update(False)
            assert not records
            scaler.update(True)
            messages = [r.getMessage() for r in records]
            assert len(messages) == 1 and expected in messages[0], (expected, messages)
            if scaler.dtype != "fp16":
                assert "fp16" not in messages[0] and "loss scale" not in messages[0], messages
    finally:
        log.removeHandler(handler)


def test_build_loss_scaler():
    kw = dict(loss_scale=0, initial_scale_power=16, loss_scale_window=1000, hysteresis=2,
              consecutive_hysteresis=False, min_loss_scale=1)
    off = build_loss_scaler(fp16_enabled=False, **kw)
    assert isinstance(off, StaticLossScaler) and off.scale == 1.0
    static = build_loss_scaler(fp16_enabled=True, **{**kw, "loss_scale": 512})
    assert isinstance(static, StaticLossScaler) and static.scale == 512
    dyn = build_loss_scaler(fp16_enabled=True, **{**kw, "initial_scale_power": 12, "hysteresis": 3,
                                                   "loss_scale_window": 7, "min_loss_scale": 0.5})
    assert isinstance(dyn, DynamicLossScaler) and dyn.dynamic
    assert (dyn.scale, dyn.hysteresis, dyn.scale_window, dyn.min_scale) == (4096, 3, 7, 0.5)


def test_has_inf_or_nan():
    ok = [torch.ones(3), None, torch.zeros(0), torch.full((2, 2), 65504.0, dtype=torch.float16)]
    r = has_inf_or_nan(ok)
    assert r.dim() == 0 and r.item() == 0.0
    assert has_inf_or_nan(ok + [torch.tensor([1.0, float("nan")])]).item() == 1.0
    assert has_inf_or_nan(ok + [torch.tensor([-float("inf")], dtype=torch.bfloat16)]).item() == 1.0
    assert has_inf_or_nan([]).item() == 0.0


def _deepspeed_scaler_cls(monkeypatch):
    monkeypatch.setenv("DS_ACCELERATOR", "cpu")
    ls = pytest.importorskip("deepspeed.runtime.fp16.loss_scaler")
    monkeypatch.setattr(ls.dist, "get_rank", lambda *a, **k: 0)  # logs only; no process group here
    return ls.DynamicLossScaler


@pytest.mark.parametrize("consecutive", [False, True])
@pytest.mark.parametrize("raise_at_min", [False, True])
def test_matches_deepspeed(monkeypatch, consecutive, raise_at_min):
    DSScaler = _deepspeed_scaler_cls(monkeypatch)
    rng = random.Random(1234 + consecutive + 2 * raise_at_min)
    cfg = dict(init_scale=2.0**6, scale_window=3, min_scale=1.0)
    ref = DSScaler(delayed_shift=2, consecutive_hysteresis=consecutive,
                   raise_error_at_min_scale=raise_at_min, **cfg)
    ours = DynamicLossScaler(hysteresis=2, consecutive_hysteresis=consecutive,
                             raise_error_at_min_scale=raise_at_min, **cfg)
    for step in range(200):
        overflow = rng.random() < 0.45
        ref_err = ours_err = None
        try:
            ref.update_scale(overflow)
        except Exception as e:  # DeepSpeed raises a bare Exception at the floor
            ref_err = e
        try:
            ours.update(overflow)
        except LossScaleError as e:
            ours_err = e
        assert (ref_err is None) == (ours_err is None), f"step {step}"
        if ours_err is not None:
            break
        assert (ours.scale, ours.cur_hysteresis, ours.last_overflow_iter) == (
            ref.cur_scale, ref.cur_hysteresis, ref.last_overflow_iter), f"step {step}"
