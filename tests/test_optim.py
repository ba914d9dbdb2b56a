"""build_optimizer / rebuild_optimizer, Lamb and Lion against hand-computed updates."""

import io
import math
from types import SimpleNamespace

import pytest
import torch

from shardspeed.errors import ConfigError
from shardspeed.optim import Lamb, Lion, build_optimizer, rebuild_optimizer
from shardspeed.optim.builder import _fused_applies


def cfg(type_, **params):
    return SimpleNamespace(type=type_, params=params)


def params_(*values):
    return [torch.nn.Parameter(torch.tensor(v, dtype=torch.float32)) for v in values]


# ---------------------------------------------------------------- names and hyper-parameters


def test_adam_is_adamw_with_deepspeed_defaults():
    opt = build_optimizer(cfg("Adam", lr=3e-4, betas=[0.8, 0.95]), params_([1.0]))
    assert type(opt) is torch.optim.AdamW
    d = opt.defaults
    assert (d["lr"], d["betas"], d["eps"], d["weight_decay"]) == (3e-4, (0.8, 0.95), 1e-8, 0.0)
    assert d["fused"] is True  # CPU float params: fused is the measured fastest


def test_adam_w_mode_false_is_torch_adam():
    opt = build_optimizer(cfg("adam", adam_w_mode=False, weight_decay=0.1), params_([1.0]))
    assert type(opt) is torch.optim.Adam and opt.defaults["weight_decay"] == 0.1


def test_adamw_ignores_adam_w_mode_and_torch_adam_keeps_torch_defaults():
    assert type(build_optimizer(cfg("ADAMW", adam_w_mode=False), params_([1.0]))) is torch.optim.AdamW
    opt = build_optimizer(cfg("AdamW", torch_adam=True), params_([1.0]))
    assert type(opt) is torch.optim.AdamW and opt.defaults["weight_decay"] == 0.01  # torch's default
    assert opt.defaults["fused"] is None and opt.defaults["foreach"] is None  # torch's kernel choice, as DeepSpeed


def test_other_names():
    p = params_([1.0])
    sgd = build_optimizer(cfg("sgd", lr=0.1, momentum=0.9, nesterov=True), p)
    assert type(sgd) is torch.optim.SGD and sgd.defaults["momentum"] == 0.9 and sgd.defaults["nesterov"]
    assert type(build_optimizer(cfg("Adagrad", lr=0.1), p)) is torch.optim.Adagrad
    lamb = build_optimizer(cfg("LAMB", lr=0.01, weight_decay=0.1, bias_correction=False, max_coeff=5.0), p)
    assert type(lamb) is Lamb
    d = lamb.defaults
    assert (d["lr"], d["weight_decay"], d["bias_correction"], d["max_coeff"], d["min_coeff"]) == (
        0.01, 0.1, False, 5.0, 0.01)
    lion = build_optimizer(cfg("Lion"), p)
    assert type(lion) is Lion and lion.defaults["lr"] == 1e-3 and lion.defaults["betas"] == (0.9, 0.999)
    rms = build_optimizer(cfg("rmsprop", lr=0.01, alpha=0.9), p)
    assert type(rms) is torch.optim.RMSprop and rms.defaults["alpha"] == 0.9


def test_param_groups_keep_their_options():
    a, b = params_([1.0], [2.0])
    opt = build_optimizer(cfg("adamw", lr=0.1, weight_decay=0.01), [{"params": [a]}, {"params": [b], "weight_decay": 0.0}])
    assert [g["weight_decay"] for g in opt.param_groups] == [0.01, 0.0]


def test_fused_selection():
    assert _fused_applies(torch.optim.AdamW, [torch.zeros(2), torch.zeros(2, dtype=torch.bfloat16)])
    assert not _fused_applies(torch.optim.AdamW, [torch.zeros(2, device="meta")])
    assert not _fused_applies(torch.optim.RMSprop, [torch.zeros(2)])
    opt = build_optimizer(cfg("adam", foreach=True), params_([1.0]))
    assert opt.defaults["foreach"] is True and not opt.defaults["fused"]


def test_adam_vs_l2_adam_one_step():
    # p = [1, -2], g = [0.5, 0.1], lr 0.1, wd 0.1. First Adam step moves each weight by lr*sign(grad).
    # AdamW: p*(1 - lr*wd) - lr*sign(g)         = [0.99 - 0.1, -1.98 - 0.1] = [0.89, -2.08]
    # Adam (L2): g' = g + wd*p = [0.6, -0.1]; p - lr*sign(g') = [0.9, -1.9]
    for mode, expected in [(True, [0.89, -2.08]), (False, [0.9, -1.9])]:
        (p,) = params_([1.0, -2.0])
        p.grad = torch.tensor([0.5, 0.1])
        build_optimizer(cfg("adam", lr=0.1, weight_decay=0.1, adam_w_mode=mode), [p]).step()
        torch.testing.assert_close(p.detach(), torch.tensor(expected), atol=1e-6, rtol=0)


# ---------------------------------------------------------------- errors


@pytest.mark.parametrize(
    "c, needle",
    [
        (cfg("Adamm"), "Adamm"),
        (cfg("adam", momentum=0.9), "momentum"),
        (cfg("lion", eps=1e-8), "eps"),
        (cfg("lamb", nesterov=True), "nesterov"),
        (cfg("sgd", betas=[0.9, 0.9]), "betas"),
        (cfg("adam", max_grad_norm=1.0), "gradient_clipping"),
        (cfg("adam", bias_correction=False), "bias_correction"),
        (cfg("OneBitAdam"), "OneBitAdam"),
        (cfg("LBFGS"), "LBFGS"),
    ],
)
def test_bad_names_and_params(c, needle):
    with pytest.raises(ConfigError) as e:
        build_optimizer(c, params_([1.0]))
    assert needle in str(e.value) and "\n" not in str(e.value)


def test_unknown_name_lists_valid_names():
    with pytest.raises(ConfigError, match="adamw.*lamb.*lion.*RMSprop"):
        build_optimizer(cfg("nope"), params_([1.0]))


# ---------------------------------------------------------------- Lamb


def test_lamb_one_step_hand_computed():
    # lr 0.1, betas (0.9, 0.999), eps 0. Step 1: m = 0.1 g, v = 0.001 g^2, so u = m/sqrt(v) = sqrt(10)*sign(g)
    # and step_size = lr*sqrt(1-0.999)/(1-0.9) = sqrt(0.001); step_size * sqrt(10) = 0.1.
    # a = [3, 4], g = [1, -2]: ||a|| = 5, ||u|| = sqrt(20), ratio 1.118034 -> a -= 0.1118034*sign(g)
    # b = [0.003, 0.004]: ratio 0.005/sqrt(20) = 0.00112 -> clamped to min_coeff 0.01 -> b -= 0.001*sign(g)
    # c = [0, 0]: ||c|| = 0 -> ratio 1 -> c -= 0.1*sign(g)
    a, b, c = params_([3.0, 4.0], [0.003, 0.004], [0.0, 0.0])
    for p in (a, b, c):
        p.grad = torch.tensor([1.0, -2.0])
    opt = Lamb([a, b, c], lr=0.1, eps=0.0)
    opt.step()
    torch.testing.assert_close(a.detach(), torch.tensor([2.8881966, 4.1118034]), atol=1e-6, rtol=0)
    torch.testing.assert_close(b.detach(), torch.tensor([0.002, 0.005]), atol=1e-6, rtol=0)
    torch.testing.assert_close(c.detach(), torch.tensor([-0.1, 0.1]), atol=1e-6, rtol=0)
    assert opt.get_lamb_coeffs() == pytest.approx([1.118034, 0.01, 1.0], rel=1e-5)


def test_lamb_weight_decay_inside_update():
    # wd 0.5: u = sqrt(10)*sign(g) + 0.5*[3, 4] = [4.6622777, -1.1622777], ||u|| = 4.8049685,
    # ratio = 5/4.8049685 = 1.0405895, p -= sqrt(0.001)*1.0405895*u = [2.8465815, 4.0382463]
    (p,) = params_([3.0, 4.0])
    p.grad = torch.tensor([1.0, -2.0])
    Lamb([p], lr=0.1, eps=0.0, weight_decay=0.5).step()
    torch.testing.assert_close(p.detach(), torch.tensor([2.8465815, 4.0382463]), atol=1e-6, rtol=0)


def _lamb_reference(p, grads, lr, b1, b2, eps, wd):
    """Plain-Python FusedLamb (eps outside sqrt, bias correction folded into the step size)."""
    p, m, v = list(p), [0.0] * len(p), [0.0] * len(p)
    for t, g in enumerate(grads, start=1):
        m = [b1 * mi + (1 - b1) * gi for mi, gi in zip(m, g)]
        v = [b2 * vi + (1 - b2) * gi * gi for vi, gi in zip(v, g)]
        u = [mi / (math.sqrt(vi) + eps) + wd * pi for mi, vi, pi in zip(m, v, p)]
        wn, un = math.sqrt(sum(x * x for x in p)), math.sqrt(sum(x * x for x in u))
        r = min(max(wn / un, 0.01), 10.0) if wn and un else 1.0
        s = lr * math.sqrt(1 - b2**t) / (1 - b1**t)
        p = [pi - s * r * ui for pi, ui in zip(p, u)]
    return p


def test_lamb_three_steps_match_reference():
    grads = [[0.3, -0.1, 0.2], [0.1, 0.4, -0.3], [-0.2, 0.2, 0.1]]
    (p,) = params_([0.5, -1.0, 2.0])
    opt = Lamb([p], lr=0.05, betas=(0.8, 0.9), eps=1e-6, weight_decay=0.01)
    for g in grads:
        p.grad = torch.tensor(g)
        opt.step()
    expected = _lamb_reference([0.5, -1.0, 2.0], grads, 0.05, 0.8, 0.9, 1e-6, 0.01)
    torch.testing.assert_close(p.detach(), torch.tensor(expected), atol=1e-6, rtol=0)


# ---------------------------------------------------------------- Lion


def test_lion_two_steps_hand_computed():
    # lr 0.1, betas (0.9, 0.99), wd 0.1.
    # step 1 (m = 0): c = 0.1 g -> sign [1, -1, 0]; p = p*0.99 - 0.1*sign = [0.89, -0.89, 0.495]; m = 0.01 g
    # step 2: c = 0.9 m + 0.1 g2 = [-0.0055, -0.0118, 0.03] -> sign [-1, -1, 1];
    #         p = [0.8811, -0.8811, 0.49005] - 0.1*sign = [0.9811, -0.7811, 0.39005]
    #         m = 0.99 m + 0.01 g2 = [0.00395, -0.00298, 0.003]
    (p,) = params_([1.0, -1.0, 0.5])
    opt = Lion([p], lr=0.1, betas=(0.9, 0.99), weight_decay=0.1)
    p.grad = torch.tensor([0.5, -0.2, 0.0])
    opt.step()
    torch.testing.assert_close(p.detach(), torch.tensor([0.89, -0.89, 0.495]), atol=1e-6, rtol=0)
    p.grad = torch.tensor([-0.1, -0.1, 0.3])
    opt.step()
    torch.testing.assert_close(p.detach(), torch.tensor([0.9811, -0.7811, 0.39005]), atol=1e-6, rtol=0)
    torch.testing.assert_close(opt.state[p]["exp_avg"], torch.tensor([0.00395, -0.00298, 0.003]), atol=1e-7, rtol=0)


def test_lion_defaults_are_the_papers():
    d = Lion(params_([1.0])).defaults
    assert (d["lr"], d["betas"], d["weight_decay"]) == (1e-4, (0.9, 0.99), 0.0)


# ---------------------------------------------------------------- state dict round trip


@pytest.mark.parametrize("make", [lambda ps: Lamb(ps, lr=0.01, weight_decay=0.1), lambda ps: Lion(ps, lr=0.01)])
def test_state_dict_round_trip(make):
    torch.manual_seed(0)
    init = [torch.randn(3, 4), torch.randn(5)]
    grads = [[torch.randn(3, 4), torch.randn(5)] for _ in range(3)]
    pa = [torch.nn.Parameter(t.clone()) for t in init]
    oa = make(pa)
    for g in grads[:2]:
        for p, gi in zip(pa, g):
            p.grad = gi
        oa.step()
    buf = io.BytesIO()
    torch.save(oa.state_dict(), buf)
    buf.seek(0)
    pb = [torch.nn.Parameter(p.detach().clone()) for p in pa]
    ob = make(pb)
    ob.load_state_dict(torch.load(buf))
    for ps, o in ((pa, oa), (pb, ob)):
        for p, gi in zip(ps, grads[2]):
            p.grad = gi
        o.step()
    for a, b in zip(pa, pb):
        torch.testing.assert_close(a, b, atol=0, rtol=0)


# ---------------------------------------------------------------- rebuild_optimizer


def test_rebuild_keeps_class_defaults_and_per_group_hyper_parameters():
    a, b = params_([1.0], [2.0])
    old = torch.optim.AdamW(
        [{"params": [a], "lr": 0.1, "weight_decay": 0.01}, {"params": [b], "lr": 0.2, "weight_decay": 0.0,
                                                           "betas": (0.8, 0.9)}],
        eps=1e-6,
    )
    x, y = params_([3.0], [4.0])
    new = rebuild_optimizer(old, [{"params": [x], "group_index": 1}, {"params": [y], "group_index": 0}])
    assert type(new) is torch.optim.AdamW and new.defaults == old.defaults
    g0, g1 = new.param_groups
    assert (g0["lr"], g0["weight_decay"], g0["betas"]) == (0.2, 0.0, (0.8, 0.9))
    assert (g1["lr"], g1["weight_decay"], g1["eps"]) == (0.1, 0.01, 1e-6)
    assert g0["params"][0] is x and g1["params"][0] is y and len(new.state) == 0


def test_rebuild_our_optimizers_and_a_custom_one():
    (a,) = params_([1.0])
    lamb = Lamb([{"params": [a], "lr": 0.3}], lr=0.1, max_coeff=3.0)
    (x,) = params_([2.0])
    new = rebuild_optimizer(lamb, [{"params": [x]}])
    assert type(new) is Lamb and new.param_groups[0]["lr"] == 0.3 and new.defaults["max_coeff"] == 3.0

    class Custom(torch.optim.SGD):  # constructor that does not mirror its defaults
        def __init__(self, params, scale):
            super().__init__(params, lr=0.1 * scale)
            self.scale = scale

    c = Custom([a], scale=2.0)
    new = rebuild_optimizer(c, [{"params": [x], "weight_decay": 0.5}])
    assert type(new) is Custom and new.scale == 2.0
    assert new.param_groups[0]["lr"] == pytest.approx(0.2) and new.param_groups[0]["weight_decay"] == 0.5
    x.grad = torch.ones(1)
    new.step()


@pytest.mark.parametrize("type_,key,value", [
    ("AdamW", "betas", [0.9]), ("Adam", "betas", 0.9), ("Adam", "betas", [0.9, 0.99, 0.5]),
    ("Lion", "betas", [0.9]), ("Lamb", "betas", [0.9, "x"]), ("Rprop", "etas", [0.5]),
    ("Rprop", "step_sizes", [1e-6]),
])
def test_list_valued_hyperparameters_of_the_wrong_length_name_the_key(type_, key, value):
    """``betas: [0.9]`` raised a bare IndexError from the optimizer's constructor (issue 16, item 6)."""
    with pytest.raises(ConfigError, match=rf"optimizer\.params\.{key} of '{type_}' must be a list of 2 numbers"):
        build_optimizer(cfg(type_, **{key: value}), params_(1.0, 2.0))


def test_list_valued_hyperparameters_of_the_right_length_pass():
    opt = build_optimizer(cfg("AdamW", betas=[0.8, 0.95]), params_(1.0))
    assert opt.param_groups[0]["betas"] == (0.8, 0.95)
    build_optimizer(cfg("Rprop", etas=[0.4, 1.3], step_sizes=[1e-6, 50]), params_(1.0))


# ---------------------------------------------------------------- hyper-parameter values (issue 21)


@pytest.mark.parametrize("type_,params,message", [
    # a value of the wrong kind: torch's constructor said "'<=' not supported between ..." and no key
    ("AdamW", {"lr": "fast"}, "optimizer.params.lr must be a number, got 'fast'"),
    ("Adam", {"eps": "tiny"}, "optimizer.params.eps must be a number, got 'tiny'"),
    ("AdamW", {"weight_decay": None}, "optimizer.params.weight_decay must be a number, got None"),
    ("SGD", {"lr": 0.1, "momentum": "0.9"}, "optimizer.params.momentum must be a number, got '0.9'"),
    ("Lion", {"lr": float("nan")}, "optimizer.params.lr must be a number, got nan"),
    ("AdamW", {"lr": True}, "optimizer.params.lr must be a number, got True"),
    ("AdamW", {"amsgrad": "yes"}, "optimizer.params.amsgrad of 'AdamW' must be true or false, got 'yes'"),
    ("Adam", {"torch_adam": "false"}, "optimizer.params.torch_adam of 'Adam' must be true or false"),
    ("AdamW", {"betas": [0.9, 1.0]}, r"optimizer.params.betas must be 2 numbers in [0, 1), got [0.9, 1.0]"),
    ("Lamb", {"betas": [-0.1, 0.9]}, "optimizer.params.betas must be 2 numbers in [0, 1)"),
    ("AdamW", {"lr": "auto"}, 'optimizer.params.lr is "auto"'),
    # torch's own range checks (ValueError from the constructor), re-raised naming the key
    ("AdamW", {"lr": -1e-3}, "optimizer.params.lr=-0.001 rejected by AdamW: Invalid learning rate: -0.001"),
    ("Adam", {"eps": -1.0}, "optimizer.params.eps=-1.0 rejected by Adam (AdamW): Invalid epsilon value"),
    ("SGD", {"lr": 0.1, "momentum": -0.5}, "optimizer.params.momentum=-0.5 rejected by SGD: Invalid momentum"),
    ("SGD", {"lr": 0.1, "nesterov": True}, "optimizer.params.nesterov=True rejected by SGD: Nesterov momentum"),
    ("AdamW", {"weight_decay": -0.1}, "optimizer.params.weight_decay=-0.1 rejected by AdamW"),
    ("Rprop", {"etas": [2.0, 1.0]}, r"optimizer.params.etas=[2.0, 1.0] rejected by Rprop: Invalid eta values"),
    ("Lion", {"lr": -1.0}, "optimizer.params.lr=-1.0 rejected by Lion: Lion: invalid lr -1.0"),
    ("Lamb", {"min_coeff": 5.0, "max_coeff": 1.0},
     "optimizer.params.min_coeff=5.0, optimizer.params.max_coeff=1.0 rejected by Lamb"),
])
def test_bad_hyperparameter_values_are_config_errors_naming_the_key(type_, params, message):
    with pytest.raises(ConfigError) as e:
        build_optimizer(cfg(type_, **params), params_(1.0, 2.0))
    assert str(e.value).startswith(message), str(e.value)
    assert "\n" not in str(e.value) and "not supported between" not in str(e.value)


def test_numbers_of_any_kind_pass():
    opt = build_optimizer(cfg("AdamW", lr=1, weight_decay=0, eps=0, betas=[0, 0.5]), params_(1.0))
    assert (opt.defaults["lr"], opt.defaults["weight_decay"], opt.defaults["betas"]) == (1, 0, (0.0, 0.5))
    assert all(type(b) is float for b in opt.defaults["betas"])  # torch wants "both floats or both Tensors"
    opt = build_optimizer(cfg("SGD", lr=torch.tensor(0.01), momentum=0.9, nesterov=True), params_(1.0))
    assert float(opt.defaults["lr"]) == pytest.approx(0.01)
    build_optimizer(cfg("Adafactor", eps=[None, 1e-3]), params_(1.0))  # a tuple default with a None in it


def test_bad_lr_through_initialize_names_the_key():
    """The newcomer's case end to end: the config's optimizer block through ``shardspeed.initialize``."""
    import shardspeed

    model = torch.nn.Linear(2, 2)
    config = {"train_batch_size": 1, "optimizer": {"type": "AdamW", "params": {"lr": "fast"}}}
    with pytest.raises(ConfigError, match=r"^optimizer\.params\.lr must be a number, got 'fast'$"):
        shardspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
