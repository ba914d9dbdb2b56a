"""Activation checkpointing (issue 12): shardspeed.checkpointing and the activation_checkpointing block.

- Parity: checkpointed training equals non-checkpointed training with dropout on (fp32, 1e-6) at ZeRO
  stages 0-3, with the full and selective policies, with cpu_checkpointing, and with partition_activations
  (+ contiguous buffers) over a model group of 2 whose ranks hold replicas; with dropout off it equals a
  one-process plain-torch reference (1e-5). Stage 3 is checked with the blocks' hooks outside the checkpoint
  (our wrapper) and inside it (a model calling checkpoint(block, x)): after every step no unit is left
  gathered.
- Memory: saved-activation bytes per layer of shardspeed.models.GPT, counted with saved-tensor hooks
  (unique storages, parameters excluded), against Korthikanti et al. 2022 in fp32: without recompute
  (66 + 9·a·s/h)·s·b·h bytes (Korthikanti's 16·sbh + 2·a·s²·b values at 4 bytes, 2·sbh + a·s²·b one-byte
  masks), 64·s·b·h with fused attention and no dropout (no a·s² term, no masks); with full recompute 4·s·b·h
  (the block input: Korthikanti's 2·sbh in 16 bits). The reduction must reach the predicted factor.
"""
from __future__ import annotations

import copy
import functools
import logging

import pytest
import torch
import torch.nn as nn
from distributed import run_distributed

import shardspeed.checkpointing as ck
from shardspeed.checkpointing.memory import activation_bytes_per_layer
from shardspeed.config import load_config
from shardspeed.errors import ConfigError
from shardspeed.models.gpt import GPT, GPTConfig
from shardspeed.plan import checkpointing_plan

BASE = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.01}}}


@pytest.fixture(autouse=True)
def _default_settings():
    ck.apply(ck.CheckpointSettings())
    yield
    ck.apply(ck.CheckpointSettings())


def _gpt(dropout: float, n_layer: int = 3, seq: int = 16, seed: int = 0) -> GPT:
    torch.manual_seed(seed)
    return GPT(GPTConfig(vocab_size=64, block_size=seq, n_layer=n_layer, n_head=4, n_embd=32, dropout=dropout))


def _grads(model: nn.Module, x, y, seed: int = 5):
    torch.manual_seed(seed)
    loss = model(x, y)
    loss.backward()
    return float(loss.detach()), {n: p.grad.clone() for n, p in model.named_parameters()}


# ---- pure parts ----------------------------------------------------------------------------------------

def test_partition_span():
    assert ck.partition_span(10, 4, 0) == (0, 3, 3)
    assert ck.partition_span(10, 4, 3) == (9, 1, 3)
    assert ck.partition_span(2, 4, 3) == (2, 0, 1)
    for numel in (1, 7, 64):
        spans = [ck.partition_span(numel, 3, r) for r in range(3)]
        assert sum(length for _, length, _ in spans) == numel
        assert all(s + length <= numel for s, length, _ in spans)


def test_settings_and_config_block():
    cfg = load_config(dict(BASE, activation_checkpointing={"partition_activations": True, "cpu_checkpointing": True,
                                                            "number_checkpoints": 4, "profile": True,
                                                            "contiguous_memory_optimization": True,
                                                            "synchronize_checkpoint_boundary": True,
                                                            "policy": "selective"}))
    st = ck.CheckpointSettings.from_config(cfg.activation_checkpointing)
    assert (st.partition_activations, st.cpu_checkpointing, st.contiguous_memory_optimization, st.number_checkpoints,
            st.synchronize, st.profile, st.policy) == (True, True, True, 4, True, True, "selective")
    # the engine's path: the plan's activation checkpointing gives the same settings
    assert ck.CheckpointSettings.from_plan(checkpointing_plan(cfg)) == st
    for block, words in [({"contiguous_memory_optimization": True}, "needs partition_activations"),
                         ({"contiguous_memory_optimization": True, "partition_activations": True},
                          "needs number_checkpoints"),
                         ({"policy": "some"}, "policy"), ({"number_checkpoints": 0}, "number_checkpoints")]:
        with pytest.raises(ConfigError, match=words):
            load_config(dict(BASE, activation_checkpointing=block))
    with pytest.raises(ConfigError, match="needs number_checkpoints"):
        ck.configure(None, partition_activations=True, contiguous_checkpointing=True)


def test_configure_reads_config_then_keywords():
    ck.configure(None, deepspeed_config=dict(BASE, activation_checkpointing={"profile": True, "cpu_checkpointing": True}),
                 checkpoint_in_cpu=False, num_checkpoints=3)
    assert ck.is_configured()
    st = ck.settings()
    assert st.profile and not st.cpu_checkpointing and st.number_checkpoints == 3 and st.policy == "full"
    with pytest.raises(ConfigError, match="get_tensor_model_parallel_group"):
        ck.configure(object())
    ck.partition_activations_in_checkpoint(True)
    ck.set_num_layers(5)
    assert ck.settings().partition_activations and ck.settings().number_checkpoints == 5 and ck.settings().profile


def test_signatures_match_deepspeed():
    """The public functions take DeepSpeed 0.19.8's parameters (read from its source, not imported)."""
    import ast
    import importlib.util
    import pathlib

    spec = importlib.util.find_spec("deepspeed")
    if spec is None or spec.origin is None:
        pytest.skip("deepspeed is not installed")
    src = pathlib.Path(spec.origin).parent / "runtime" / "activation_checkpointing" / "checkpointing.py"
    theirs = {f.name: [a.arg for a in f.args.args] + ([f.args.vararg.arg] if f.args.vararg else [])
              for f in ast.parse(src.read_text()).body if isinstance(f, ast.FunctionDef)}
    import inspect

    for name in ("checkpoint", "configure", "is_configured", "reset", "get_cuda_rng_tracker",
                 "model_parallel_cuda_manual_seed", "model_parallel_reconfigure_tp_seed", "non_reentrant_checkpoint",
                 "partition_activations_in_checkpoint", "set_num_layers"):
        ours = [p.name for p in inspect.signature(getattr(ck, name)).parameters.values()
                if p.kind is not inspect.Parameter.VAR_KEYWORD]
        assert ours == theirs[name], name
    cls = next(c for c in ast.parse(src.read_text()).body
               if isinstance(c, ast.ClassDef) and c.name == "CudaRNGStatesTracker")
    methods = {f.name for f in cls.body if isinstance(f, ast.FunctionDef)}
    assert methods and methods <= set(dir(ck.CudaRNGStatesTracker))


# ---- single process: exact replay -------------------------------------------------------------------------

@pytest.mark.parametrize("policy", ["full", "selective"])
def test_gpt_blocks_replay_dropout_exactly(policy):
    ref = _gpt(0.1)
    x, y = torch.randint(0, 64, (2, 16)), torch.randint(0, 64, (2, 16))
    loss0, g0 = _grads(ref, x, y)
    model = copy.deepcopy(ref)
    model.zero_grad(set_to_none=True)
    assert len(ck.checkpoint_blocks(model, policy=policy)) == 3
    assert set(model.state_dict()) == set(ref.state_dict())  # names unchanged
    loss1, g1 = _grads(model, x, y)
    assert loss1 == loss0
    for n in g0:
        torch.testing.assert_close(g1[n], g0[n], rtol=0, atol=1e-7, msg=n)
    twin = copy.deepcopy(model)  # the copy's blocks run their own forwards
    assert twin.blocks[0].forward.block is twin.blocks[0] and twin.blocks[0].forward.fn.policy == policy
    assert ck.uncheckpoint_blocks(model) == 3 and "forward" not in vars(model.blocks[0])


def test_selective_policy_recomputes_no_matmul():
    """In backward, full recompute reruns every block's matmuls; the selective policy reruns none of them
    (their outputs were kept) but still the elementwise ops (GELU)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = {}

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            name = func.overloadpacket.__name__
            self.ops[name] = self.ops.get(name, 0) + 1
            return func(*args, **(kwargs or {}))

    x, y = torch.randint(0, 64, (2, 16)), torch.randint(0, 64, (2, 16))
    counts = {}
    for policy in (None, "full", "selective"):
        model = _gpt(0.0)
        if policy:
            ck.checkpoint_blocks(model, policy=policy)
        loss = model(x, y)
        with Count() as c:
            loss.backward()
        counts[policy] = c.ops
    mm = {k: sum(v for op, v in ops.items() if op in ("mm", "addmm", "bmm")) for k, ops in counts.items()}
    # c_attn, attention's c_proj, c_fc; torch's early stop ends the recompute before the MLP's c_proj, whose
    # output backward does not need
    assert mm["full"] == mm[None] + 3 * 3
    assert mm["selective"] == mm[None]
    assert counts["selective"].get("gelu", 0) == counts["full"].get("gelu", 0) == 3
    assert counts[None].get("gelu", 0) == 0


def test_checkpoint_kwargs_tracker_profile_and_cpu(caplog):
    """Tensor keyword arguments are differentiated; dropout inside a tracker fork replays; profile and
    synchronize time and log each call; cpu_checkpointing on a CPU device says once that it has nothing to do."""
    ck.configure(None, profile=True, synchronize=True, checkpoint_in_cpu=True)
    ck.model_parallel_cuda_manual_seed(1234)
    lin = nn.Linear(8, 8)

    def fn(a, scale=None):
        with ck.get_cuda_rng_tracker().fork():
            h = torch.nn.functional.dropout(lin(a), 0.5)
        return h * scale

    a, s = torch.randn(4, 8, requires_grad=True), torch.randn(4, 8, requires_grad=True)
    results = []
    for use_ckpt in (False, True):
        states = ck.get_cuda_rng_tracker().get_states()
        a.grad = s.grad = None
        lin.zero_grad()
        with caplog.at_level(logging.INFO, logger="shardspeed.checkpointing"):
            out = ck.checkpoint(fn, a, scale=s) if use_ckpt else fn(a, scale=s)
            out.square().sum().backward()
        results.append((out.detach(), a.grad.clone(), s.grad.clone(), lin.weight.grad.clone()))
        ck.get_cuda_rng_tracker().set_states(states)
    for u, v in zip(*results):
        torch.testing.assert_close(u, v, rtol=0, atol=0)
    totals = ck.profile_totals()
    assert totals["calls"] == 1 and totals["forward_s"] > 0 and totals["backward_s"] > 0
    assert "checkpoint forward" in caplog.text and "checkpoint backward" in caplog.text
    assert caplog.text.count("nothing is copied") == 1


def test_contiguous_buffers_need_enough_slots():
    from shardspeed.checkpointing.saved import ContiguousBuffers

    buffers = ContiguousBuffers(2)
    for _ in range(2):
        buffers.begin_checkpoint()
        buffers.store(torch.ones(5))
    assert buffers.allocated_bytes() == 2 * 5 * 4
    with pytest.raises(ConfigError, match="number_checkpoints=2"):
        buffers.begin_checkpoint()
        buffers.store(torch.ones(5))
    buffers.release()
    assert buffers.allocated_bytes() == 0


def test_find_blocks_errors_on_a_model_without_blocks():
    with pytest.raises(ConfigError, match="block_types"):
        ck.checkpoint_blocks(nn.Linear(4, 4))
    seq = nn.Sequential(nn.Linear(4, 4), nn.ModuleList([nn.Linear(4, 4) for _ in range(3)]))
    assert len(ck.find_blocks(seq)) == 3


# ---- memory: saved activations against Korthikanti ---------------------------------------------------------

def _saved_bytes(model: GPT, x, y) -> int:
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen = {}

    def pack(t):
        st = t.untyped_storage()
        if st.data_ptr() not in params and st.nbytes():
            seen[st.data_ptr()] = st.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(x, y)
    return sum(seen.values())


@pytest.mark.parametrize("dropout", [0.0, 0.1])
def test_saved_activations_fall_by_the_predicted_factor(dropout):
    s, b, h, a = 256, 2, 32, 4  # _gpt: n_embd 32, 4 heads
    per_layer = {}
    for ckpt in (False, True):
        total = {}
        for n_layer in (2, 4):  # the difference removes embeddings, the head and the loss
            model = _gpt(dropout, n_layer=n_layer, seq=s)
            if ckpt:
                ck.checkpoint_blocks(model, policy="full")
            x, y = torch.randint(0, 64, (b, s)), torch.randint(0, 64, (b, s))
            total[n_layer] = _saved_bytes(model, x, y)
        per_layer[ckpt] = (total[4] - total[2]) / 2
    sbh = s * b * h
    formula = functools.partial(activation_bytes_per_layer, s, b, h, a, value_bytes=4, dropout=dropout > 0,
                                fused_attention=dropout == 0)  # torch's CPU flash attention takes no dropout
    assert per_layer[True] == formula(recompute="full") == 4 * sbh  # Korthikanti's 2sbh in 16 bits
    predicted = formula(recompute="none")
    assert predicted == (64 * sbh if dropout == 0 else (66 + 9 * a * s / h) * sbh)
    if dropout == 0.0:  # fused attention
        assert abs(per_layer[False] - predicted) / predicted < 0.02, per_layer[False] / sbh
    else:  # math attention keeps more than the paper counts (its pre-softmax scores too)
        assert per_layer[False] >= predicted, per_layer[False] / sbh
    factor = per_layer[False] / per_layer[True]
    assert factor >= 0.98 * predicted / formula(recompute="full"), (factor, predicted / (4 * sbh))


# ---- distributed parity --------------------------------------------------------------------------------

STEPS = 3


class CallsCheckpoint(GPT):
    """A GPT whose forward calls shardspeed.checkpointing.checkpoint(block, x) itself: the blocks' module hooks
    (ZeRO-3's gathers) run inside the checkpoint and again in the recompute."""

    def forward(self, idx, targets):
        x = self.drop(self.wte(idx) + self.wpe(torch.arange(idx.shape[1])))
        for block in self.blocks:
            x = ck.checkpoint(block, x)
        logits = self.lm_head(self.ln_f(x))
        return torch.nn.functional.cross_entropy(logits.view(-1, logits.size(-1)), targets.reshape(-1))


def _calls_checkpoint(dropout: float) -> CallsCheckpoint:
    config = _gpt(dropout).config
    torch.manual_seed(0)
    return CallsCheckpoint(config)


def _batches(world_data: int, seq: int = 16):
    g = torch.Generator().manual_seed(3)
    return [(torch.randint(0, 64, (2 * world_data, seq), generator=g),
             torch.randint(0, 64, (2 * world_data, seq), generator=g)) for _ in range(STEPS)]


def _train(config: dict, model: nn.Module, enable=None) -> dict:
    import torch.distributed as dist

    import shardspeed
    from shardspeed.zero.unit import UnitState

    engine, *_ = shardspeed.initialize(model=model, config=config)
    if enable is not None:
        engine.enable_activation_checkpointing(policy=enable)
    dp, rank = engine.dp_world_size, engine.mpu.get_data_parallel_rank()
    torch.manual_seed(100 + rank)  # the same dropout stream with and without checkpointing
    losses, left_gathered = [], 0
    for x, y in _batches(dp):
        loss = engine(x[2 * rank: 2 * rank + 2], y[2 * rank: 2 * rank + 2])
        engine.backward(loss)
        engine.step()
        total = loss.detach().clone()
        dist.all_reduce(total)
        losses.append(float(total) / dist.get_world_size())
        manager = engine.param_manager
        if manager is not None:
            left_gathered += sum(u.state is not UnitState.SHARDED for u in manager.units)
    from models import gathered_params

    manager = engine.param_manager
    return {"losses": losses, "params": gathered_params(engine), "gathered_after_step": left_gathered,
            "comms": engine.comms_summary(), "gathers": manager.gather_count if manager is not None else None}


def _config(stage: int, **ac) -> dict:
    return dict(BASE, gradient_clipping=0.5, zero_optimization={"stage": stage, "stage3_param_persistence_threshold": 0,
                                                                "reduce_bucket_size": 2000},
                activation_checkpointing=ac)


def _data_parallel_cases() -> dict:
    out = {}
    for stage in (0, 1, 2, 3):
        out[f"plain-{stage}"] = _train(_config(stage), _gpt(0.1))
        out[f"ckpt-{stage}"] = _train(_config(stage, enabled=True), _gpt(0.1))
    out["selective-3"] = _train(_config(3, enabled=True, policy="selective"), _gpt(0.1))
    out["cpu-2"] = _train(_config(2, enabled=True, cpu_checkpointing=True), _gpt(0.1))
    out["inside-3"] = _train(_config(3), _calls_checkpoint(0.1))
    out["nodrop-ckpt-3"] = _train(_config(3), _gpt(0.0), enable="full")
    offload = _config(3, enabled=True)
    offload["zero_optimization"]["offload_param"] = {"device": "cpu"}
    out["offload-param-3"] = _train(offload, _gpt(0.1))
    out["bf16-plain-2"] = _train(dict(_config(2), bf16={"enabled": True}), _gpt(0.1))
    out["bf16-ckpt-2"] = _train(dict(_config(2, enabled=True, policy="selective"), bf16={"enabled": True}), _gpt(0.1))
    return out


def _close(a: dict, b: dict, tol: float, what: str) -> None:
    torch.testing.assert_close(torch.tensor(a["losses"]), torch.tensor(b["losses"]), rtol=tol, atol=tol,
                               msg=lambda m: f"{what} losses: {m}")
    for n, p in b["params"].items():
        torch.testing.assert_close(a["params"][n], p, rtol=tol, atol=tol, msg=lambda m, n=n: f"{what} {n}: {m}")


def _reference_nodrop(world: int) -> dict:
    model = _gpt(0.0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01, foreach=False)
    losses = []
    for x, y in _batches(world):
        loss = model(x, y)
        losses.append(float(loss.detach()))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        opt.step()
        opt.zero_grad()
    return {"losses": losses, "params": {n: p.detach().clone() for n, p in model.named_parameters()}}


def test_checkpointed_training_equals_plain_at_every_stage():
    res = run_distributed(_data_parallel_cases, 2, timeout=240)[0]
    for stage in (0, 1, 2, 3):
        _close(res[f"ckpt-{stage}"], res[f"plain-{stage}"], 1e-6, f"stage {stage}")
    _close(res["selective-3"], res["plain-3"], 1e-6, "selective, stage 3")
    _close(res["cpu-2"], res["plain-2"], 1e-6, "cpu_checkpointing, stage 2")
    _close(res["inside-3"], res["plain-3"], 1e-6, "checkpoint(block, x) inside the model, stage 3")
    _close(res["offload-param-3"], res["plain-3"], 1e-6, "offload_param cpu, stage 3")
    _close(res["nodrop-ckpt-3"], _reference_nodrop(2), 1e-5, "no dropout, stage 3 vs one-process torch")
    _close(res["bf16-ckpt-2"], res["bf16-plain-2"], 1e-6, "bf16, selective, stage 2")  # the same ops replayed
    for name in ("ckpt-3", "selective-3", "inside-3"):  # the recompute gathers nothing more
        assert res[name]["gathers"] == res["plain-3"]["gathers"], (name, res[name]["gathers"], res["plain-3"]["gathers"])
    for name, r in res.items():
        assert r["gathered_after_step"] == 0, f"{name}: stage-3 units left gathered after a step"


def _tensor_parallel_cases() -> dict:
    out = {}
    tp = {"tensor_parallel": {"autotp_size": 2}}
    out["plain"] = _train(dict(_config(0), **tp), _gpt(0.1, n_layer=2))
    out["partition"] = _train(dict(_config(0, enabled=True, partition_activations=True), **tp), _gpt(0.1, n_layer=2))
    out["partition-cpu-contiguous"] = _train(
        dict(_config(0, enabled=True, partition_activations=True, cpu_checkpointing=True,
                     contiguous_memory_optimization=True, number_checkpoints=2), **tp), _gpt(0.1, n_layer=2))
    out["partition-3"] = _train(dict(_config(3, enabled=True, partition_activations=True), **tp), _gpt(0.1, n_layer=2))
    out["plain-3"] = _train(dict(_config(3), **tp), _gpt(0.1, n_layer=2))
    return out


def test_partitioned_activations_over_a_model_group_of_two():
    """World 2 as data 1 × model 2 (the GPT split over the model dimension, dropout on): each rank keeps half of
    every saved block input and all-gathers it for the recompute (one all-gather per block per step more than
    without partitioning); the recompute replays the tensor-parallel dropout stream exactly."""
    res = run_distributed(_tensor_parallel_cases, 2, timeout=240)[0]
    def gathers(name: str) -> int:
        return res[name]["comms"].get("all_gather", {}).get("count", 0)

    for name in ("partition", "partition-cpu-contiguous"):
        _close(res[name], res["plain"], 1e-6, name)
        assert gathers(name) - gathers("plain") == 2 * STEPS, (res[name]["comms"], res["plain"]["comms"])
    _close(res["partition-3"], res["plain-3"], 1e-6, "partition, stage 3")


def _hf_gpt2(mode: str):
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=2, n_head=4, resid_pdrop=0.1,
                                       embd_pdrop=0.1, attn_pdrop=0.1))
    if mode.startswith("user"):  # the user switched it on with torch's checkpoint before initialize
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": mode == "user-reentrant"})
    return model


def _hf_cases() -> dict:
    import warnings

    import torch.distributed as dist

    import shardspeed
    from shardspeed.zero.unit import UnitState

    warnings.filterwarnings("ignore")
    out = {}
    for mode in ("plain", "ours", "user-reentrant", "user-then-ours"):
        cfg = dict(BASE, zero_optimization={"stage": 3, "stage3_param_persistence_threshold": 0},
                   activation_checkpointing={"enabled": mode in ("ours", "user-then-ours"), "policy": "selective"})
        engine, *_ = shardspeed.initialize(model=_hf_gpt2(mode), config=cfg)
        torch.manual_seed(7 + dist.get_rank())
        g = torch.Generator().manual_seed(3)
        losses, left = [], 0
        for _ in range(STEPS):
            x = torch.randint(0, 64, (4, 16), generator=g)[2 * dist.get_rank(): 2 * dist.get_rank() + 2]
            loss = engine(x, labels=x).loss
            engine.backward(loss)
            engine.step()
            losses.append(float(loss.detach()))
            left += sum(u.state is not UnitState.SHARDED for u in engine.param_manager.units)
        layer_fn = engine.module.transformer.h[0].__dict__.get("_gradient_checkpointing_func")
        out[mode] = {"losses": losses, "left": left, "on": engine.module.is_gradient_checkpointing,
                     "ours": type(layer_fn).__name__ == "_PolicyCheckpoint"}
    return out


def test_hugging_face_layers_at_stage_3():
    """A Hugging Face GPT-2 (dropout on) at ZeRO-3: enabled through the model's own switch with our function, or
    switched on by the user with torch's checkpoint (reentrant or not), trains as without checkpointing."""
    pytest.importorskip("transformers")
    res = run_distributed(_hf_cases, 2, timeout=240)[0]
    assert not res["plain"]["on"] and res["ours"]["on"] and res["ours"]["ours"] and res["user-then-ours"]["ours"]
    assert not res["user-reentrant"]["ours"]
    for mode, r in res.items():
        torch.testing.assert_close(torch.tensor(r["losses"]), torch.tensor(res["plain"]["losses"]), rtol=1e-6,
                                   atol=1e-6, msg=lambda m, mode=mode: f"{mode}: {m}")
        assert r["left"] == 0, mode
