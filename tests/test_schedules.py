"""LR schedules: hand-computed values at chosen steps, and DeepSpeed's lr_schedules as an oracle."""

import logging
from types import SimpleNamespace

import pytest
import torch

from shardspeed.errors import ConfigError
from shardspeed.optim import (
    LRRangeTest,
    OneCycle,
    WarmupCosineLR,
    WarmupDecayLR,
    WarmupLR,
    build_scheduler,
)


def adam(*lrs):
    groups = [{"params": [torch.nn.Parameter(torch.zeros(1))], "lr": lr} for lr in lrs]
    return torch.optim.Adam(groups, lr=lrs[0])


def lrs_at(sched, opt, steps):
    """{iteration: lr of group 0} after stepping to each listed iteration."""
    out = {}
    for it in range(max(steps) + 1):
        sched.step()
        if it in steps:
            out[it] = opt.param_groups[0]["lr"]
    return out


def approx(d):
    return {k: pytest.approx(v, rel=1e-6, abs=1e-12) for k, v in d.items()}


def test_warmup_lr_log():
    opt = adam(0.1)  # warmup_max_lr defaults to the optimizer's lr
    s = WarmupLR(opt, warmup_min_lr=0.01, warmup_num_steps=10)
    assert opt.param_groups[0]["lr"] == 0.01 and s.get_last_lr() == [0.01]  # before the first step
    # lr = 0.01 + 0.09 * log(it+1)/log(10): it1 -> log10(2) = 0.30103, it4 -> log10(5) = 0.69897
    assert lrs_at(s, opt, {0, 1, 4, 9, 10, 50}) == approx(
        {0: 0.01, 1: 0.0370927, 4: 0.0729073, 9: 0.1, 10: 0.1, 50: 0.1})


def test_warmup_lr_linear_per_group_and_min_two_steps():
    opt = adam(0.1, 0.2)
    s = WarmupLR(opt, warmup_num_steps=10, warmup_type="linear")
    for _ in range(6):
        s.step()  # it = 5: gamma 0.5
    assert s.get_last_lr() == pytest.approx([0.05, 0.1])
    s2 = WarmupLR(adam(0.1), warmup_num_steps=1, warmup_type="linear")
    assert s2.warmup_num_steps == 2  # N is at least 2, as in DeepSpeed
    s2.step()
    s2.step()  # it = 1: 1/2
    assert s2.get_last_lr() == pytest.approx([0.05])


def test_warmup_decay_lr():
    opt = adam(0.5)  # ignored: WarmupDecayLR's warmup_max_lr defaults to 0.001
    s = WarmupDecayLR(opt, total_num_steps=20, warmup_num_steps=10, warmup_type="linear")
    assert opt.param_groups[0]["lr"] == 0.0
    # warmup it/10 * 0.001; then (20 - it) / (20 - 10) * 0.001, floored at 0
    assert lrs_at(s, opt, {5, 9, 10, 15, 20, 25}) == approx(
        {5: 0.0005, 9: 0.0009, 10: 0.001, 15: 0.0005, 20: 0.0, 25: 0.0})


def test_warmup_cosine_lr():
    opt = adam(0.1)
    s = WarmupCosineLR(opt, total_num_steps=20, warmup_num_steps=10, warmup_min_ratio=0.1, cos_min_ratio=0.1,
                       warmup_type="linear")
    assert opt.param_groups[0]["lr"] == 0.0  # DeepSpeed: ratio 0 before the first step
    # warmup: ratio = 0.1 + 0.9*it/10; cosine: p = (it - 9)/10, ratio = 0.1 + 0.9*(1 + cos(pi p))/2
    # it10: p 0.1, (1 + 0.9510565)/2 = 0.9755283 -> ratio 0.9779754; it14: p 0.5 -> 0.55; it19+: 0.1
    assert lrs_at(s, opt, {0, 5, 10, 14, 19, 30}) == approx(
        {0: 0.01, 5: 0.055, 10: 0.09779754, 14: 0.055, 19: 0.01, 30: 0.01})


def test_one_cycle_lr_and_momentum():
    opt = adam(0.5)
    opt.param_groups[0]["betas"] = (0.95, 0.98)
    s = OneCycle(opt, cycle_min_lr=0.01, cycle_max_lr=0.1, cycle_first_step_size=4, decay_lr_rate=0.5,
                 decay_step_size=2)
    g = opt.param_groups[0]
    assert g["lr"] == 0.01 and g["betas"] == (0.8, 0.98)  # beta2 kept (DeepSpeed would force 0.99)
    # scale: it0 -> 1/8 of the cycle = 0.25 up; it3 -> top; it5 -> halfway down; it7 -> bottom.
    # After the cycle: 0.01 / (1 + 0.5 * k / 2), k = it - 7: it8 -> 0.008, it11 -> 0.005.
    expected = {0: (0.0325, 0.875), 3: (0.1, 0.8), 5: (0.055, 0.85), 7: (0.01, 0.9), 8: (0.008, 0.9),
                11: (0.005, 0.9)}
    for it in range(12):
        s.step()
        if it in expected:
            lr, mom = expected[it]
            assert g["lr"] == pytest.approx(lr) and g["betas"][0] == pytest.approx(mom), it
            assert g["betas"][1] == 0.98


def test_one_cycle_staircase_and_no_momentum_for_sgd():
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    s = OneCycle(opt, cycle_min_lr=0.01, cycle_max_lr=0.1, cycle_first_step_size=4, cycle_first_stair_count=2)
    assert not s.cycle_momentum
    # stairs of half the amplitude: it0 (pos 0.5) 0, it1 (pos 1) 0.5, it3 top, it4 (pos 1.5 going down) 0.5
    assert lrs_at(s, opt, {0, 1, 3, 4}) == approx({0: 0.01, 1: 0.055, 3: 0.1, 4: 0.055})


def test_lr_range_test():
    opt = adam(1.0)
    s = LRRangeTest(opt, lr_range_test_min_lr=0.001, lr_range_test_step_size=4, lr_range_test_step_rate=2.0)
    assert opt.param_groups[0]["lr"] == 0.001
    # 0.001 * (1 + 2 * (it+1)/4)
    assert lrs_at(s, opt, {0, 3}) == approx({0: 0.0015, 3: 0.003})
    opt = adam(1.0)
    s = LRRangeTest(opt, lr_range_test_min_lr=0.001, lr_range_test_step_size=4, lr_range_test_step_rate=2.0,
                    lr_range_test_staircase=True)
    # 0.001 * (1 + 2 * floor((it+1)/4))
    assert lrs_at(s, opt, {2, 3, 6, 7}) == approx({2: 0.001, 3: 0.003, 6: 0.003, 7: 0.005})


def test_state_dict_round_trip_reapplies_lr():
    opt = adam(0.1)
    s = WarmupLR(opt, warmup_num_steps=10)
    for _ in range(4):
        s.step()
    assert s.state_dict() == {"last_batch_iteration": 3}
    opt2 = adam(0.1)
    s2 = WarmupLR(opt2, warmup_num_steps=10)
    s2.load_state_dict(s.state_dict())
    assert opt2.param_groups[0]["lr"] == opt.param_groups[0]["lr"]
    s.step()
    s2.step()
    assert s2.get_last_lr() == s.get_last_lr()


def test_tensor_lr_is_filled_in_place():
    opt = torch.optim.Adam([torch.nn.Parameter(torch.zeros(1))], lr=torch.tensor(0.1))
    lr_tensor = opt.param_groups[0]["lr"]
    s = WarmupLR(opt, warmup_max_lr=0.1, warmup_num_steps=10, warmup_type="linear")
    for _ in range(6):
        s.step()
    assert opt.param_groups[0]["lr"] is lr_tensor and lr_tensor.item() == pytest.approx(0.05)


def test_build_scheduler_names_and_errors():
    c = lambda t, **p: SimpleNamespace(type=t, params=p)  # noqa: E731
    assert build_scheduler(None, adam(0.1)) is None
    assert type(build_scheduler(c("warmupdecaylr", total_num_steps=100), adam(0.1))) is WarmupDecayLR
    assert type(build_scheduler(c("WarmupLR"), adam(0.1))) is WarmupLR
    assert type(build_scheduler(c("StepLR", step_size=3), adam(0.1))) is torch.optim.lr_scheduler.StepLR
    assert type(build_scheduler(c("cosineannealinglr", T_max=10), adam(0.1))) is torch.optim.lr_scheduler.CosineAnnealingLR
    with pytest.raises(ConfigError, match="WarmupLRR.*WarmupCosineLR.*StepLR"):
        build_scheduler(c("WarmupLRR"), adam(0.1))
    with pytest.raises(ConfigError, match="warmup_steps"):
        build_scheduler(c("WarmupLR", warmup_steps=10), adam(0.1))
    with pytest.raises(ConfigError, match="total_num_steps"):
        build_scheduler(c("WarmupCosineLR"), adam(0.1))
    with pytest.raises(ConfigError, match="warmup_type"):
        build_scheduler(c("WarmupLR", warmup_type="cosine"), adam(0.1))
    with pytest.raises(ConfigError, match="warmup_num_steps"):
        build_scheduler(c("WarmupLR", warmup_num_steps=0), adam(0.1))
    with pytest.raises(ConfigError, match="warmup_max_lr"):
        build_scheduler(c("WarmupLR", warmup_max_lr=[0.1, 0.2]), adam(0.1))


# ---------------------------------------------------------------- DeepSpeed oracle

ORACLE_CASES = [
    ("WarmupLR", dict(warmup_min_lr=0.001, warmup_num_steps=20)),
    ("WarmupLR", dict(warmup_min_lr=[0.0, 0.01], warmup_max_lr=[0.1, 0.3], warmup_num_steps=15,
                      warmup_type="linear")),
    ("WarmupDecayLR", dict(total_num_steps=40, warmup_num_steps=10)),
    ("WarmupDecayLR", dict(total_num_steps=30, warmup_min_lr=0.01, warmup_max_lr=0.2, warmup_num_steps=8,
                           warmup_type="linear")),
    ("WarmupCosineLR", dict(total_num_steps=40, warmup_num_steps=10, warmup_min_ratio=0.05)),
    ("WarmupCosineLR", dict(total_num_steps=35, warmup_num_steps=5, cos_min_ratio=0.2, warmup_type="linear")),
    ("OneCycle", dict(cycle_min_lr=0.01, cycle_max_lr=0.1, cycle_first_step_size=10, cycle_second_step_size=15,
                      decay_lr_rate=0.1, decay_step_size=3, decay_mom_rate=0.05)),
    ("OneCycle", dict(cycle_min_lr=[0.01, 0.02], cycle_max_lr=[0.1, 0.2], cycle_first_step_size=8,
                      cycle_first_stair_count=3, cycle_second_stair_count=2)),
    ("LRRangeTest", dict(lr_range_test_min_lr=0.001, lr_range_test_step_size=7, lr_range_test_step_rate=0.5)),
    ("LRRangeTest", dict(lr_range_test_min_lr=[0.001, 0.002], lr_range_test_step_size=5,
                         lr_range_test_staircase=True)),
]


@pytest.mark.parametrize("name, params", ORACLE_CASES, ids=[f"{n}-{i}" for i, (n, _) in enumerate(ORACLE_CASES)])
def test_matches_deepspeed(monkeypatch, name, params):
    monkeypatch.setenv("DS_ACCELERATOR", "cpu")
    ds = pytest.importorskip("deepspeed.runtime.lr_schedules")
    logging.getLogger("DeepSpeed").setLevel(logging.ERROR)
    ref_opt, our_opt = adam(0.1, 0.3), adam(0.1, 0.3)
    ref = getattr(ds, name)(ref_opt, **params)
    ours = build_scheduler(SimpleNamespace(type=name, params=params), our_opt)

    def snapshot(opt):
        return [x for g in opt.param_groups for x in (g["lr"], g["betas"][0])]

    assert snapshot(our_opt) == pytest.approx(snapshot(ref_opt), rel=1e-12, abs=1e-15)
    for step in range(50):
        ref.step()
        ours.step()
        assert snapshot(our_opt) == pytest.approx(snapshot(ref_opt), rel=1e-12, abs=1e-15), step
        assert ours.get_lr() == pytest.approx(ref.get_lr(), rel=1e-12, abs=1e-15), step
        if name == "OneCycle":  # (beta1, beta2) per group, as DeepSpeed's; beta2 is the group's (DeepSpeed: 0.99)
            mine, theirs = ours.get_mom(), ref.get_mom()
            assert [type(m) for m in mine] == [type(m) for m in theirs] == [tuple] * len(theirs)
            assert [m[0] for m in mine] == pytest.approx([m[0] for m in theirs], rel=1e-12), step
            assert [m[1] for m in mine] == [g["betas"][1] for g in our_opt.param_groups]
    assert ours.state_dict() == ref.state_dict()
