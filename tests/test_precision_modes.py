"""Issue 40's precision keys against DeepSpeed 0.19.8 (tests/precision_ds_worker.py under torchrun at world 2 and 4,
once with DeepSpeed and once with shardspeed's ``deepspeed`` package, side by side): ``torch_autocast`` (bf16,
fp32 parameters) and bf16 master weights with bf16 optimizer states at ZeRO 1-3 give DeepSpeed's losses over 12
steps (2 micro-batches, clipping) within bf16 tolerance, optimizer states of the same dtype and bytes (bf16 states:
half of fp32's), and the same ``comm_dtype`` tags. fp16 master weights offloaded (DeepSpeed's CPU accelerator runs
no fp16: ours only, in the same world-2 group) against tests/precision_reference.py's plain-torch reference, with
a static and a dynamic loss scale. In one process: the refusals DeepSpeed makes, by name; the ``data_types``
casts; ``torch_autocast`` at stage 0 against plain torch.autocast + AdamW; fp16 masters bit for bit against the
reference at world 1."""
from __future__ import annotations

import functools
import json
import os

import pytest
import torch

import shardspeed
from shardspeed.errors import ConfigError
from shardspeed.estimate.states import estimate_model_state_memory, model_states
from shardspeed.plan import decide
from shardspeed.precision.casting import cast_module, keep_in_fp32_pattern
from tests.distributed import free_port, run_pair_workers
from tests.precision_reference import DynamicScale, Fp16Run, batch, fp16_masters_reference, model

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "precision_ds_worker.py")
# bf16_masters_f32_off: bf16 masters offloaded with fp32 moments (DeepSpeedCPUAdam's default), 20 steps, world 2 only
CASES = [f"{mode}_z{stage}" for mode in ("autocast", "bf16_masters", "bf16_masters_off", "bf16_masters_f32_off")
         for stage in (1, 2, 3)]
# world 4: the bf16-state cases; the cost is the 8 processes starting (~75 CPU-seconds for 6 cases or for 2)
CASES4 = [c for c in CASES if "_f32_" not in c]
# fp16 masters offloaded (fp32 moments), 20 steps, world 2, shardspeed only (the worker's real side skips them):
# a static loss scale at ZeRO 1-3, and a dynamic one that starts too high (overflows, skips, halves) at ZeRO 2
FP16_CASES = [f"fp16_masters_off_z{stage}" for stage in (1, 2, 3)] + ["fp16_dyn_off_z2"]




def one_rank_env(monkeypatch) -> None:
    """The environment of a one-process job (a fresh port)."""
    for k, v in {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "RANK": "0", "WORLD_SIZE": "1",
                 "LOCAL_RANK": "0"}.items():
        monkeypatch.setenv(k, v)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    pytest.importorskip("deepspeed")
    return _load(run_pair_workers(WORKER, tmp_path_factory, args=[",".join(CASES + FP16_CASES)]))


def _load(out: dict) -> dict:
    loaded = {}
    for name, folder in out.items():
        with open(os.path.join(folder, "result.json")) as f:
            loaded[name] = json.load(f)
    return loaded


@pytest.fixture(scope="module")
def runs4(tmp_path_factory):
    """The same worker at world 4, real DeepSpeed and ours side by side."""
    pytest.importorskip("deepspeed")
    return _load(run_pair_workers(WORKER, tmp_path_factory, world=4, args=[",".join(CASES4)]))


def _assert_matches_deepspeed(real: dict, ours: dict, case: str) -> None:
    assert len(ours["losses"]) == len(real["losses"]) == (20 if "_f32_" in case else 12)
    diffs = [abs(a - b) for a, b in zip(ours["losses"], real["losses"])]
    assert max(diffs) < 1e-3, (case, diffs)  # bf16 rounding; observed ~2e-4
    assert ours["losses"][-3:] != ours["losses"][:3]  # it trained
    assert ours["state_dtypes"] == real["state_dtypes"]
    assert ours["state_bytes"] == real["state_bytes"]
    assert ours["param_dtype"] == real["param_dtype"]
    assert ours["comm_dtype"] == real["comm_dtype"]


@pytest.mark.parametrize("case", CASES)
def test_losses_states_and_tags_match_deepspeed(runs, case):
    _assert_matches_deepspeed(runs["real"][case], runs["ours"][case], case)


@pytest.mark.parametrize("case", CASES4)
def test_world4_losses_states_and_tags_match_deepspeed(runs4, case):
    real, ours = runs4["real"][case], runs4["ours"][case]
    _assert_matches_deepspeed(real, ours, case)
    state_b = 2 if case.startswith("bf16") else 4
    assert ours["state_bytes"] == [5896 // 4 * 2 * state_b] * 4  # two Adam moments, a quarter each


def test_bf16_optimizer_states_are_half_the_bytes(runs):
    ours = runs["ours"]
    for stage in (1, 2, 3):
        fp32, bf16 = ours[f"autocast_z{stage}"], ours[f"bf16_masters_z{stage}"]
        assert fp32["state_dtypes"] == ["torch.float32"] and bf16["state_dtypes"] == ["torch.bfloat16"]
        # 5896 parameters, two Adam moments, sharded over 2 ranks
        assert fp32["state_bytes"] == [5896 // 2 * 2 * 4] * 2 and bf16["state_bytes"] == [5896 // 2 * 2 * 2] * 2
        # the estimator prices the same bytes (bf16 masters are the bf16 parameters themselves: no copy)
        assert estimate_model_state_memory(5896, 2, stage, "fp32").optimizer_device == fp32["state_bytes"][0]
        assert estimate_model_state_memory(5896, 2, stage, "bf16", bf16_masters=True).optimizer_device \
            == bf16["state_bytes"][0]
        # offloaded (DeepSpeed: DeepSpeedCPUAdam with bf16 moments): the same bf16 moments, in host memory
        off = ours[f"bf16_masters_off_z{stage}"]
        assert off["state_dtypes"] == ["torch.bfloat16"] and off["state_bytes"] == bf16["state_bytes"]
        est = estimate_model_state_memory(5896, 2, stage, "bf16", offload_optimizer=True, bf16_masters=True)
        assert est.optimizer_device == 0 and est.optimizer_host == 5896 // 2 * (2 * 2 + 2)  # bf16 master + m, v
        # offloaded without bf16_optimizer_states: bf16 host masters, fp32 moments (the fp32 run's bytes)
        f32 = ours[f"bf16_masters_f32_off_z{stage}"]
        assert f32["state_dtypes"] == ["torch.float32"] and f32["state_bytes"] == fp32["state_bytes"]
        est = estimate_model_state_memory(5896, 2, stage, "bf16", offload_optimizer=True, bf16_masters=True,
                                          bf16_states=False)
        assert est.optimizer_device == 0 and est.optimizer_host == 5896 // 2 * (2 + 2 * 4)  # bf16 master + m, v
        assert est.params_device == (5896 // 2 if stage == 3 else 5896) * 2
    assert ours["autocast_z1"]["comm_dtype"] == ["torch.bfloat16", "None"]
    # the Linear layers' gradients go on the wire in bf16; the LayerNorm's in fp32 (a unit of its own at
    # stages 1-2; at stage 3 the units are modules, so each Linear reduces in bf16 and the LayerNorm in fp32)
    for stage in (1, 2, 3):
        wires = ours[f"autocast_z{stage}"]["wire_dtypes"]
        assert "torch.bfloat16" in wires and "None" in wires, (stage, wires)
    assert set(ours["bf16_masters_z1"]["wire_dtypes"]) == {"None"}


@functools.cache  # ZeRO 2 and 3 share theirs: same arithmetic
def _fp16_reference(case: str) -> Fp16Run:
    """The worker's fp16 case (precision_ds_worker.FP16: AdamW 3e-3, weight decay 0.01, clipping 0.05, 2
    micro-batches of 4 per rank, world 2, 20 steps) trained by the plain-torch reference."""
    scale = DynamicScale(2.0 ** 20, window=4) if "_dyn_" in case else DynamicScale(1024.0, window=10 ** 9)
    return fp16_masters_reference(20, 2, 2, 3e-3, 0.01, 0.05, scale, reduce_every_micro_step=not case.endswith("z1"))


def _fp16_reference_of(case: str) -> Fp16Run:
    return _fp16_reference(case.replace("_z3", "_z2"))


@pytest.mark.parametrize("case", FP16_CASES)
def test_fp16_masters_offloaded_match_the_plain_torch_reference(runs, case):
    """fp16 masters on the host, fp32 moments, fp16 gradients unscaled and clipped (every step: the norm is above
    0.05) and rounded to fp16, each element stepped in fp32 and rounded once: the reference's losses within 1e-4
    over 20 steps (observed 7e-5) and its final parameters within one fp16 ulp at 1 (observed: 80% bit-equal, the
    rest a rounding apart; from step 2 a few LayerNorm-bias elements first round differently, a cause not yet
    pinned down: not the Adam kernel, checked on recorded tiles, nor gloo's fp16 sum); the scale and the skipped steps
    exactly; Adam's moments fp32 on the host (the fp32 run's bytes), as DeepSpeedCPUAdam keeps them."""
    ours, ref = runs["ours"][case], _fp16_reference_of(case)
    assert "real" not in runs or case not in runs["real"]  # DeepSpeed's CPU accelerator has no fp16
    assert len(ours["losses"]) == 20 and ours["losses"][-3:] != ours["losses"][:3]
    diffs = [abs(a - b) for a, b in zip(ours["losses"], ref.losses)]
    assert max(diffs) < 1e-4, (case, diffs)
    got, want = torch.tensor(ours["params"]), torch.tensor(ref.params)
    assert (got - want).abs().max() <= 2 ** -10, case  # one fp16 ulp at 1
    assert (got == want).float().mean() > 0.7, case
    assert ours["scales"] == ref.scales and ours["skipped"] == ref.skipped
    assert ours["param_dtype"] == "torch.float16" and ours["state_dtypes"] == ["torch.float32"]
    assert ours["state_bytes"] == [5896 // 2 * 2 * 4] * 2  # two fp32 moments of each rank's half
    stage = int(case[-1])
    est = estimate_model_state_memory(5896, 2, stage, "fp16", offload_optimizer=True, fp16_masters=True)
    assert est.optimizer_device == 0 and est.optimizer_host == 5896 // 2 * (2 + 2 * 4)  # fp16 master + fp32 m, v
    assert est.params_device == (5896 // 2 if stage == 3 else 5896) * 2


def test_fp16_dynamic_scale_overflows_skips_and_halves_as_deepspeed(runs):
    """The dynamic case starts at 2**20: the first steps overflow and are skipped, the scale staying once
    (DeepSpeed's hysteresis 2) and then halving; it doubles after 4 clean steps (loss_scale_window) and overflows
    again, as DeepSpeed's DynamicLossScaler.update_scale does (the reference restates it)."""
    ours = runs["ours"]["fp16_dyn_off_z2"]
    k = 2.0 ** 18
    assert ours["scales"][:10] == [4 * k, 4 * k, 2 * k, k, k, k, k, k, 2 * k, 2 * k]
    assert ours["skipped"][:10] == [True, True, True] + [False] * 5 + [True, True]
    assert sum(ours["skipped"]) == 7 and ours["scales"][10] == k


def test_fp16_masters_bit_identical_to_the_reference_at_world_1(monkeypatch):
    """One rank, ZeRO 2 offloaded, two micro-batches, no clipping (the clip factor would hang on the norm's
    order of summation, which differs): every parameter after 6 steps is the reference's bit for bit."""
    one_rank_env(monkeypatch)
    cfg = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2, "gradient_clipping": 0.0,
           "steps_per_print": 1000, "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}},
           "optimizer": {"type": "AdamW", "params": {"lr": 3e-3, "weight_decay": 0.01}},
           "fp16": {"enabled": True, "fp16_master_weights_and_grads": True, "loss_scale": 1024}}
    engine, *_ = shardspeed.initialize(model=model(), config=cfg)
    try:
        gen = torch.Generator().manual_seed(100)
        for _ in range(6 * 2):
            x, y = batch(gen)
            engine.backward((engine(x.half()).float() - y).pow(2).mean())
            engine.step()
        assert engine.fp16_master_weights_and_gradients()
        got = torch.cat([p.detach().reshape(-1) for p in engine.module.parameters()]).float()
    finally:
        engine.destroy()
    ref = fp16_masters_reference(6, 2, 1, 3e-3, 0.01, 0.0, DynamicScale(1024.0, window=10 ** 9), True)
    assert torch.equal(got, torch.tensor(ref.params))


def _cfg(**extra) -> dict:
    return dict({"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 1}}, **extra)


@pytest.mark.parametrize("extra, fragment", [
    ({"bf16": {"enabled": True, "bf16_master_weights_and_grads": True}},
     "bf16.bf16_master_weights_and_grads without bf16.bf16_optimizer_states and without "
     "zero_optimization.offload_optimizer: DeepSpeed refuses it too"),
    ({"bf16": {"enabled": True, "bf16_optimizer_states": True}},
     "bf16.bf16_optimizer_states requires bf16.bf16_master_weights_and_grads"),
    ({"bf16": {"enabled": True, "bf16_master_weights_and_grads": True, "bf16_optimizer_states": True},
      "zero_optimization": {"stage": 0}}, "bf16.bf16_master_weights_and_grads is only supported with ZeRO stage 1"),
    # fp16 masters are the fp16 weights' own copy: they need fp16 training
    ({"fp16": {"enabled": False, "fp16_master_weights_and_grads": True},
      "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}},
     "fp16.fp16_master_weights_and_grads needs fp16.enabled true"),
    # DeepSpeed refuses this one too (stage_1_and_2.py / stage3.py: _enforce_cpu_offload)
    ({"fp16": {"enabled": True, "fp16_master_weights_and_grads": True}},
     "fp16.fp16_master_weights_and_grads without zero_optimization.offload_optimizer: DeepSpeed refuses it too"),
    ({"fp16": {"enabled": True, "fp16_master_weights_and_grads": True}, "zero_optimization": {"stage": 0}},
     "fp16.fp16_master_weights_and_grads is only supported with ZeRO stage 1, 2 or 3"),
    ({"data_types": {"param_dtype": "bf16"}}, "data_types.param_dtype 'bf16' conflicts with the training dtype"),
    ({"torch_autocast": {"enabled": True}, "zero_optimization": {"stage": 3, "zero_quantized_weights": True}},
     "torch_autocast.enabled with zero_optimization.zero_quantized_weights"),
])
def test_refused_as_deepspeed_refuses(extra, fragment):
    with pytest.raises(ConfigError) as e:
        decide(_cfg(**extra), 1)
    assert fragment in str(e.value)


def test_plan_of_each_mode():
    p = decide(_cfg(bf16={"enabled": True, "bf16_master_weights_and_grads": True, "bf16_optimizer_states": True},
                    data_types={"param_dtype": "bfloat16"}), 1).precision
    assert (p.compute, p.master, p.states, p.autocast) == (torch.bfloat16, torch.bfloat16, torch.bfloat16, None)
    off = {"stage": 2, "offload_optimizer": {"device": "cpu"}}
    f = decide(_cfg(bf16={"enabled": True, "bf16_master_weights_and_grads": True}, zero_optimization=off), 1).precision
    assert (f.compute, f.master, f.states) == (torch.bfloat16, torch.bfloat16, torch.float32)  # DeepSpeedCPUAdam's
    h = decide(_cfg(bf16={"enabled": True, "bf16_master_weights_and_grads": True}, zero_optimization=off,
                    optimizer={"type": "AdamW", "params": {"fp32_optimizer_states": False}}), 1).precision
    assert (h.master, h.states) == (torch.bfloat16, torch.bfloat16)  # DeepSpeedCPUAdam(fp32_optimizer_states=False)
    # the estimator prices the NVMe state files in their dtypes: bf16 master + fp32 or bf16 moments
    for states, per in ((False, 2 + 8), (True, 2 + 4)):
        nvme = {"stage": 3, "offload_optimizer": {"device": "nvme", "nvme_path": "/tmp"}}
        plan = decide(_cfg(bf16={"enabled": True, "bf16_master_weights_and_grads": True,
                                 "bf16_optimizer_states": states}, zero_optimization=nvme), 2)
        est = model_states(plan, 5896)
        assert est.nvme == 5896 // 2 * per and est.optimizer_host == est.optimizer_device == 0
    assert decide(_cfg(bf16={"enabled": True}), 1).precision.states == torch.float32
    # fp16 masters offloaded: DeepSpeedCPUAdam's fp32 moments, or fp16 ones with fp32_optimizer_states false
    h16 = {"enabled": True, "fp16_master_weights_and_grads": True}
    g = decide(_cfg(fp16=h16, zero_optimization=off), 1).precision
    assert (g.compute, g.master, g.states) == (torch.float16, torch.float16, torch.float32)
    g = decide(_cfg(fp16=h16, zero_optimization=off,
                    optimizer={"type": "AdamW", "params": {"fp32_optimizer_states": False}}), 1).precision
    assert (g.master, g.states) == (torch.float16, torch.float16)
    nvme = {"stage": 3, "offload_optimizer": {"device": "nvme", "nvme_path": "/tmp"}}
    est = model_states(decide(_cfg(fp16=h16, zero_optimization=nvme), 2), 5896)
    assert est.nvme == 5896 // 2 * (2 + 8) and est.optimizer_host == 0  # state files: fp16 master, fp32 m, v
    a = decide(_cfg(torch_autocast={"enabled": True, "dtype": "fp16",
                                    "lower_precision_safe_modules": ["torch.nn.Linear"]}), 1).precision
    assert (a.compute, a.master, a.autocast.dtype, a.autocast.safe_modules) == (
        torch.float32, torch.float32, torch.float16, ("torch.nn.Linear",))
    assert a.loss_scale.dynamic and a.loss_scale.window == 2000 and a.loss_scale.hysteresis == 1  # GradScaler's


class _Rotary(torch.nn.Module):
    _keep_in_fp32_modules_strict = ["inv_freq"]

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)
        self.register_buffer("inv_freq", torch.rand(4))
        self.register_buffer("mask", torch.rand(4))


def test_data_types_cast_parameters_not_buffers_unless_asked():
    m = _Rotary()
    cast_module(m, torch.bfloat16, None, "auto")
    assert m.lin.weight.dtype == torch.bfloat16 and m.mask.dtype == m.inv_freq.dtype == torch.float32
    m = _Rotary()
    assert cast_module(m, torch.bfloat16, torch.bfloat16, "auto") == 1
    assert m.mask.dtype == torch.bfloat16 and m.inv_freq.dtype == torch.float32  # kept by the model's own list
    m = _Rotary()
    cast_module(m, torch.bfloat16, torch.bfloat16, [])
    assert m.inv_freq.dtype == torch.bfloat16
    assert keep_in_fp32_pattern(_Rotary(), ["lin*"], torch.float32) is None  # fp32 training keeps nothing
    assert keep_in_fp32_pattern(_Rotary(), ["m*sk"], torch.float16).search("mask")


def _net():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.LayerNorm(32), torch.nn.GELU(), torch.nn.Linear(32, 4))


def test_torch_autocast_stage0_equals_plain_torch_autocast(monkeypatch):
    one_rank_env(monkeypatch)
    cfg = {"train_micro_batch_size_per_gpu": 4, "gradient_clipping": 0.0, "zero_optimization": {"stage": 0},
           "torch_autocast": {"enabled": True, "dtype": "bf16"},
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.0, "torch_adam": True}}}
    engine, *_ = shardspeed.initialize(model=_net(), config=cfg)
    ref = _net()
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.0)
    gen = torch.Generator().manual_seed(3)
    try:
        for _ in range(6):
            x = torch.randn(4, 8, generator=gen)
            y = torch.cos(x[:, :4])
            loss = (engine(x).float() - y).pow(2).mean()
            engine.backward(loss)
            engine.step()
            with torch.autocast("cpu", dtype=torch.bfloat16):
                out = ref(x)
            ref_loss = (out.float() - y).pow(2).mean()
            ref_loss.backward()
            opt.step()
            opt.zero_grad()
            assert abs(float(loss.detach()) - float(ref_loss.detach())) < 1e-5
        assert next(engine.module.parameters()).dtype == torch.float32
        for p, q in zip(engine.module.parameters(), ref.parameters()):
            torch.testing.assert_close(p.detach(), q.detach(), rtol=1e-5, atol=1e-6)
    finally:
        engine.destroy()


def _states(engine) -> list:
    master = engine.master_weights
    if master.is_tiled:  # offloaded: the master and Adam's moments of each host tile
        return [t for tile in master.host_tiles for t in master.tile_state(tile)]
    inner = getattr(engine.optimizer, "optimizer", engine.optimizer)
    return [v for st in inner.state.values() for k, v in sorted(st.items()) if k != "step" and v.dim() > 0]


@pytest.mark.parametrize("mode", ["device", "offload", "offload_f32", "fp16_offload"])
def test_bf16_master_checkpoint_loads_into_fp32_masters_and_back(monkeypatch, tmp_path, caplog, mode):
    """Saved with bf16 masters, loaded by an engine with fp32 masters (and back): the weights and Adam's moments
    convert, one log line names the conversion, and training goes on; on the device, offloaded to the CPU
    (stage 2: masters and moments in the offload store, bf16 with bf16 masters), and offloaded without
    bf16_optimizer_states (bf16 masters, fp32 moments: the moments load unchanged both ways). ``fp16_offload``:
    the same with fp16 masters (fp32 moments) against an fp16 run with fp32 masters."""
    one_rank_env(monkeypatch)
    zero = {"stage": 2, "offload_optimizer": {"device": "cpu"}} if mode != "device" else {"stage": 1}
    base = {"train_micro_batch_size_per_gpu": 4, "zero_optimization": zero,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}}}
    low = dict(base, bf16={"enabled": True, "bf16_master_weights_and_grads": True,
                           "bf16_optimizer_states": mode != "offload_f32"})
    full = dict(base, bf16={"enabled": True})
    half = torch.bfloat16
    if mode == "fp16_offload":
        half = torch.float16
        low = dict(base, fp16={"enabled": True, "fp16_master_weights_and_grads": True, "loss_scale": 256})
        full = dict(base, fp16={"enabled": True, "loss_scale": 256})
    name = str(half).replace("torch.", "")
    gen = torch.Generator().manual_seed(5)
    moments = torch.float32 if mode in ("offload_f32", "fp16_offload") else torch.bfloat16

    def train(engine, steps):
        for _ in range(steps):
            x = torch.randn(4, 8, generator=gen)
            out = engine(x.half() if half == torch.float16 else x)
            engine.backward((out.float() - torch.cos(x[:, :4])).pow(2).mean())
            engine.step()

    a, *_ = shardspeed.initialize(model=_net(), config=low)
    b = None
    try:
        train(a, 3)
        a.save_checkpoint(str(tmp_path), tag="low")
        saved = [t.clone() for t in _states(a)]
        if mode == "device":
            assert {t.dtype for t in saved} == {torch.bfloat16}
        else:  # per host tile: master, exp_avg, exp_avg_sq
            assert [t.dtype for t in saved[:3]] == [half, moments, moments]
        # a restart in the same mode: every state back bit for bit, in its own dtype
        c, *_ = shardspeed.initialize(model=_net(), config=low)
        try:
            c.load_checkpoint(str(tmp_path), tag="low")
            assert all(t.dtype == s.dtype and torch.equal(t, s) for t, s in zip(_states(c), saved))
        finally:
            c.destroy()
        b, *_ = shardspeed.initialize(model=_net(), config=full)
        with caplog.at_level("INFO", logger="shardspeed"):
            b.load_checkpoint(str(tmp_path), tag="low")
        if moments == torch.float32:
            assert (f"checkpoint master weights are {name}, this engine's are float32: converting them {name} -> "
                    "float32 as they load (optimizer states: float32, this engine's float32)") in caplog.text
        else:
            assert "checkpoint master weights and optimizer states are bfloat16, this engine's are float32" \
                in caplog.text
        assert [t.dtype for t in _states(b)] == [torch.float32] * len(saved)
        assert all(torch.equal(t, s.float()) for t, s in zip(_states(b), saved))
        for p, q in zip(a.module.parameters(), b.module.parameters()):
            assert torch.equal(p, q)
        train(b, 1)
        b.save_checkpoint(str(tmp_path), tag="full")
        moved = [t.clone() for t in _states(b)]
        caplog.clear()
        with caplog.at_level("INFO", logger="shardspeed"):
            a.load_checkpoint(str(tmp_path), tag="full")
        assert f"are float32, this engine's are {name}: converting them float32 -> {name}" in caplog.text
        assert all(torch.equal(t, s.to(t.dtype)) for t, s in zip(_states(a), moved))
        assert [t.dtype for t in _states(a)] == [s.dtype for s in saved]
        for p, q in zip(a.module.parameters(), b.module.parameters()):
            assert torch.equal(p, q)  # 16-bit parameters: the fp32 masters rounded, as b's own
        train(a, 1)
    finally:
        a.destroy()
        if b is not None:
            b.destroy()


@pytest.mark.parametrize("half, bf16_states", [("bf16", True), ("bf16", False), ("fp16", False)])
def test_bf16_masters_on_nvme_train_as_on_the_cpu(monkeypatch, tmp_path, half, bf16_states):
    """bf16 masters offloaded to NVMe (stage 3, small tiles: several per unit): the state files hold a bf16 master
    and bf16 or fp32 moments (their sizes say so), training is bit-identical to the same mode with device cpu
    (which matches DeepSpeed's losses: test_losses_states_and_tags_match_deepspeed), and a checkpoint of the
    NVMe run loads into the CPU run with every state equal. fp16 masters (fp32 moments) likewise, against the cpu
    mode that matches the plain-torch reference."""
    one_rank_env(monkeypatch)
    moments = torch.bfloat16 if bf16_states else torch.float32
    dtype = torch.bfloat16 if half == "bf16" else torch.float16
    master = {"bf16": {"enabled": True, "bf16_master_weights_and_grads": True, "bf16_optimizer_states": bf16_states},
              "fp16": {"enabled": True, "fp16_master_weights_and_grads": True, "loss_scale": 256}}[half]

    def cfg(device):
        off = {"device": device, "nvme_path": str(tmp_path / "swap")} if device == "nvme" else {"device": device}
        return {"train_micro_batch_size_per_gpu": 4, "gradient_clipping": 0.5, "steps_per_print": 1000,
                "zero_optimization": {"stage": 3, "sub_group_size": 100, "offload_optimizer": off},
                "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.01}}, half: master}

    engines, losses = [], {}
    try:
        for device in ("cpu", "nvme"):
            e, *_ = shardspeed.initialize(model=_net(), config=cfg(device))
            engines.append(e)
            gen = torch.Generator().manual_seed(7)
            losses[device] = []
            for _ in range(6):
                x = torch.randn(4, 8, generator=gen)
                loss = (e(x.to(dtype)).float() - torch.cos(x[:, :4])).pow(2).mean()
                e.backward(loss)
                e.step()
                losses[device].append(float(loss.detach()))
        cpu, nvme = engines
        assert losses["cpu"] == losses["nvme"] and losses["nvme"][-1] != losses["nvme"][0]
        for p, q in zip(cpu.module.parameters(), nvme.module.parameters()):
            assert torch.equal(p, q)
        store = nvme.master_weights.host_store
        assert len(store.tiles) > 4 and store.dtypes == (dtype, moments, moments)
        n = sum(t.numel for t in store.tiles)
        sizes = {f: os.path.getsize(os.path.join(store.dir, f)) for f in os.listdir(store.dir) if f != "owner.lock"}
        suffix, mine = ("bf16" if bf16_states else "f32"), {"bf16": "master.bf16", "fp16": "master.f16"}[half]
        assert set(sizes) == {mine, f"exp_avg.{suffix}", f"exp_avg_sq.{suffix}"}
        assert n * 2 <= sizes[mine] <= n * 2 + len(store.tiles) * 4096  # 16-bit, 4 KiB-aligned per tile
        assert sizes[f"exp_avg.{suffix}"] >= n * moments.itemsize
        for a, b in zip(_states(cpu), _states(nvme)):
            assert a.dtype == b.dtype and torch.equal(a, b)
        nvme.save_checkpoint(str(tmp_path / "ckpt"), tag="nvme")
        before = [t.clone() for t in _states(nvme)]
        cpu.load_checkpoint(str(tmp_path / "ckpt"), tag="nvme")
        assert all(torch.equal(a, b) for a, b in zip(_states(cpu), before))
    finally:
        for e in engines:
            e.destroy()


def test_fp32_moments_beside_bf16_masters_need_adam(monkeypatch):
    """Offloaded bf16 masters with fp32 moments are stepped by the Adam kernel only (DeepSpeed: DeepSpeedCPUAdam
    only); another optimizer is refused with one line naming the key to set."""
    one_rank_env(monkeypatch)
    cfg = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "SGD", "params": {"lr": 1e-2}},
           "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}},
           "bf16": {"enabled": True, "bf16_master_weights_and_grads": True}}
    with pytest.raises(ConfigError, match="torch.bfloat16 master weights with torch.float32 optimizer states "
                                          "offloaded need Adam or AdamW .* the optimizer is SGD"):
        shardspeed.initialize(model=_net(), config=cfg)


def test_torch_autocast_with_a_pipeline_module_is_refused_by_name(monkeypatch):
    from shardspeed.pipe import PipelineModule
    from tests.pipe_models import mlp_specs

    one_rank_env(monkeypatch)
    model = PipelineModule(layers=mlp_specs(), num_stages=1, loss_fn=torch.nn.MSELoss())
    cfg = {"train_micro_batch_size_per_gpu": 2, "torch_autocast": {"enabled": True},
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}}
    with pytest.raises(ConfigError, match="torch_autocast with a PipelineModule is not implemented yet"):
        shardspeed.initialize(model=model, config=cfg)


def test_engine_getters_of_the_precision_modes(monkeypatch):
    one_rank_env(monkeypatch)
    cfg = {"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 2}, "torch_autocast": {"enabled": True},
           "bf16": {"enabled": True, "bf16_master_weights_and_grads": True, "bf16_optimizer_states": True},
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}}
    engine, *_ = shardspeed.initialize(model=_net(), config=cfg)
    try:
        assert engine.torch_autocast_enabled() and engine.torch_autocast_dtype() == torch.bfloat16  # CPU's default
        assert engine.bf16_master_weights_and_gradients() and engine.bf16_optimizer_states()
        assert not engine.fp16_master_weights_and_gradients()
    finally:
        engine.destroy()
    cfg = dict(cfg, bf16={"enabled": True, "bf16_master_weights_and_grads": True},
               zero_optimization={"stage": 2, "offload_optimizer": {"device": "cpu"}})
    engine, *_ = shardspeed.initialize(model=_net(), config=cfg)
    try:  # offloaded without bf16_optimizer_states: bf16 masters, fp32 moments
        assert engine.bf16_master_weights_and_gradients() and not engine.bf16_optimizer_states()
    finally:
        engine.destroy()
