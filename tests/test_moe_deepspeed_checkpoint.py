"""MoE models between DeepSpeed and shardspeed: state dicts, DeepSpeed's MoE checkpoints, and the random draws of
DeepSpeed's call order (DeepSpeed 0.19.8 as the oracle, gloo, ``DS_ACCELERATOR=cpu``; skipped without it).

- ``state_dict()`` of our MoE layers has DeepSpeed's per-expert keys: each side loads the other's (strict).
- A DeepSpeed ZeRO-2 checkpoint of an EP 2 model (world 2, per-layer expert files, expert parameter groups
  partitioned over the expert-data group) loads into our engine: every weight equal to DeepSpeed's, the
  steps after it equal to DeepSpeed's own continuation; at EP 1 every expert by its global id; DeepSpeed's
  EP 1 checkpoint (its expert group over both ranks) continues at our EP 2. A DeepSpeed MoE checkpoint without ZeRO is refused
  in one line, the engine untouched.
- Ours saved at EP 2 and written in DeepSpeed's layout (``export_deepspeed``, ``shardspeed convert``: expert
  groups and per-expert files) loads into DeepSpeed, which continues it as ours does.
- The CIFAR example's shape (a conv net, an MoE layer with an ``nn.Linear`` expert, EP 2, top-1 with random
  token selection, with and without "RSample", data through ``initialize(training_data=...)``): the losses
  equal DeepSpeed's from the first step (the engine's loader draws its iterator's seed from the global RNG
  as torch's DataLoader in DeepSpeed's loader does, so the gate's random draws come from the same stream).
"""
from __future__ import annotations

import os
from typing import Any, Dict, List

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from tests.distributed import run_distributed
from tests.moe_models import MoENet, expert_weights, load_experts

os.environ.setdefault("DS_ACCELERATOR", "cpu")
E, B, T = 4, 2, 8
GATE = dict(k=2, use_rts=False, drop_tokens=False, top2_2nd_expert_sampling=False)


def _config(stage: int) -> Dict[str, Any]:
    return {"train_micro_batch_size_per_gpu": B, "gradient_accumulation_steps": 1,
            "optimizer": {"type": "Adam", "params": {"lr": 0.01, "weight_decay": 0.0, "torch_adam": True}},
            "zero_optimization": {"stage": stage}}


def _batches(n: int) -> List[Any]:
    g = torch.Generator().manual_seed(11)
    return [(torch.randn(2, B, T, 8, generator=g), torch.randn(2, B, T, 8, generator=g)) for _ in range(n)]


def _engine(lib, moe_cls, split, stage: int, seed: int = 0, ep: int = 2):
    import torch.distributed as dist

    torch.manual_seed(seed)
    net = MoENet(moe_cls, E, ep, min_capacity=4, **GATE)
    load_experts(net, expert_weights(E, seed=7 + seed), dist.get_rank() % ep)
    groups = split({"params": list(net.parameters()), "name": "dense"})
    return lib.initialize(model=net, config=_config(stage), model_parameters=groups)[0], net


def _train(engine, batches) -> List[float]:
    import torch.distributed as dist

    out = []
    for xs, ys in batches:
        loss = engine(xs[dist.get_rank()], ys[dist.get_rank()])
        engine.backward(loss)
        engine.step()
        out.append(float(loss))
    return out


def _checkpoints(base: str) -> Dict[str, Any]:
    """DeepSpeed trains 2 steps, saves (ZeRO 2, and without ZeRO), goes on 2 steps; ours loads each."""
    import deepspeed
    import torch.distributed as dist
    from deepspeed.moe.layer import MoE as DSMoE
    from deepspeed.moe.utils import split_params_into_different_moe_groups_for_optimizer as ds_split

    import shardspeed
    from shardspeed.errors import CheckpointError
    from shardspeed.moe.layer import MoE
    from shardspeed.moe.utils import split_params_into_different_moe_groups_for_optimizer as split

    if not deepspeed.comm.is_initialized():
        deepspeed.init_distributed(dist_backend="gloo")
    batches = _batches(4)
    out: Dict[str, Any] = {}
    for stage in (2, 0):
        dse, dnet = _engine(deepspeed, DSMoE, ds_split, stage)
        _train(dse, batches[:2])
        dse.save_checkpoint(f"{base}/ds{stage}", tag="t")
        out[f"ds_saved{stage}"] = {k: v.clone() for k, v in dnet.state_dict().items()}
        out[f"ds_cont{stage}"] = _train(dse, batches[2:])
    dse, _ = _engine(deepspeed, DSMoE, ds_split, 2, ep=1)  # EP 1: its expert group spans both ranks
    _train(dse, batches[:2])
    dse.save_checkpoint(f"{base}/ds_ep1", tag="t")
    out["ds_cont_ep1"] = _train(dse, batches[2:])
    dist.barrier()
    engine, net = _engine(shardspeed, MoE, split, 2, seed=1)  # other weights: all of them must come from the file
    before = {k: v.clone() for k, v in net.state_dict().items()}
    try:
        engine.load_checkpoint(f"{base}/ds0", tag="t")
        out["refused"] = None
    except CheckpointError as exc:
        out["refused"] = str(exc)
    out["untouched"] = all(torch.equal(v, before[k]) for k, v in net.state_dict().items())
    ep1, net1 = _engine(shardspeed, MoE, split, 1, seed=1, ep=1)  # resharded: every expert on every rank
    ep1.load_checkpoint(f"{base}/ds2", tag="t")
    out["ep1_loaded"] = {k: v.clone() for k, v in net1.state_dict().items()}
    engine.load_checkpoint(f"{base}/ds_ep1", tag="t")  # into EP 2: each rank its two experts of the four
    out["ours_cont_ep1"] = _train(engine, batches[2:])
    engine.load_checkpoint(f"{base}/ds2", tag="t")
    out["ours_loaded"] = {k: v.clone() for k, v in net.state_dict().items()}
    out["ours_cont"] = _train(engine, batches[2:])
    # the other way: ours saves, `shardspeed convert`'s export writes DeepSpeed's layout, DeepSpeed loads it
    engine.save_checkpoint(f"{base}/ours", tag="o")
    out["ours_saved"] = {k: v.clone() for k, v in net.state_dict().items()}
    if dist.get_rank() == 0:
        from shardspeed.checkpoint.deepspeed_layout.export import export_deepspeed

        export_deepspeed(f"{base}/ours", f"{base}/ours_ds", world=2, stage=2, tag="o")
    dist.barrier()
    more = _batches(6)[4:]
    out["ours_more"] = _train(engine, more)
    dse, dnet = _engine(deepspeed, DSMoE, ds_split, 2, seed=2)
    dse.load_checkpoint(f"{base}/ours_ds", tag="o")
    out["ds_loaded"] = {k: v.clone() for k, v in dnet.state_dict().items()}
    out["ds_more"] = _train(dse, more)
    return out


def _cifar_like(policy, lib_name: str) -> List[float]:
    """DeepSpeedExamples' CIFAR MoE script, reduced: seed, build, initialize with training_data, train."""
    import deepspeed
    import torch.distributed as dist

    import shardspeed

    if lib_name == "ds":
        from deepspeed.moe.layer import MoE
        from deepspeed.moe.utils import split_params_into_different_moe_groups_for_optimizer as split
        lib: Any = deepspeed
    else:
        from shardspeed.moe.layer import MoE
        from shardspeed.moe.utils import split_params_into_different_moe_groups_for_optimizer as split
        lib = shardspeed
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(5)
    data = torch.utils.data.TensorDataset(torch.randn(128, 3, 12, 12, generator=g), torch.randint(0, 10, (128,), generator=g))

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = nn.Conv2d(3, 4, 5)
            self.fc = nn.Linear(4 * 4 * 4, 12)
            self.moe = MoE(hidden_size=12, expert=nn.Linear(12, 12), num_experts=2, ep_size=2, k=1, min_capacity=0,
                           noisy_gate_policy=policy)
            self.head = nn.Linear(12, 10)

        def forward(self, x):
            x = F.max_pool2d(F.relu(self.conv(x)), 2).flatten(1)
            x, _, _ = self.moe(F.relu(self.fc(x)))
            return self.head(x)

    net = Net()
    cfg = {"train_batch_size": 32, "optimizer": {"type": "Adam", "params": {"lr": 0.001, "torch_adam": True}}}
    engine, _, loader, _ = lib.initialize(model=net, config=cfg, training_data=data,
                                          model_parameters=split({"params": list(net.parameters()), "name": "p"}))
    if hasattr(loader, "num_local_io_workers"):  # DeepSpeed's loader: no worker processes in these daemons
        loader.num_local_io_workers = 0
    losses = []
    for step, (x, y) in enumerate(loader):
        loss = F.cross_entropy(engine(x), y)
        engine.backward(loss)
        engine.step()
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        losses.append(float(mean) / 2)
        if step == 2:
            break
    return losses


def _world2(base: str) -> Dict[str, Any]:
    out = _checkpoints(base)
    for policy in (None, "RSample"):
        for lib in ("ds", "ours"):
            out[f"cifar/{policy}/{lib}"] = _cifar_like(policy, lib)
    return out


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    pytest.importorskip("deepspeed")
    return run_distributed(_world2, 2, str(tmp_path_factory.mktemp("moe_ds")), timeout=500)


def test_state_dict_keys_carry_over_both_ways():
    """One process: DeepSpeed's MoE and ours (EP 2: 2 local experts of 4) have the same keys and shapes, and
    each loads the other's state dict strictly, tensor for tensor; a stacked state dict (ours before) still
    loads; a state dict with a local expert missing is refused with the key named."""
    pytest.importorskip("deepspeed")
    from deepspeed.moe.layer import MoE as DSMoE

    from shardspeed.moe.layer import MoE

    for expert in (lambda: nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 8)), lambda: nn.Linear(8, 8)):
        torch.manual_seed(0)
        ds, ours = DSMoE(8, expert(), num_experts=4, ep_size=2), MoE(8, expert(), num_experts=4, ep_size=2)
        with torch.no_grad():
            for p in ds.parameters():
                p.normal_()
        ds_sd = ds.state_dict()
        ours.load_state_dict(ds_sd)  # strict
        got = ours.state_dict()
        assert list(got) == list(ds_sd)
        assert all(torch.equal(got[k], ds_sd[k]) for k in ds_sd)
        with torch.no_grad():
            for p in ours.parameters():
                p.add_(1.0)
        ds.load_state_dict(ours.state_dict())  # strict
        assert all(torch.equal(a, b) for a, b in zip(ds.state_dict().values(), ours.state_dict().values()))
        stacked = {n: t.detach().clone() for n, t in ours.named_parameters()}
        fresh = MoE(8, expert(), num_experts=4, ep_size=2)
        fresh.load_state_dict(stacked)
        assert all(torch.equal(fresh.state_dict()[k], v) for k, v in ours.state_dict().items())
        partial = dict(ds.state_dict())
        gone = [k for k in partial if ".deepspeed_experts.1." in k][0]
        del partial[gone]
        with pytest.raises(RuntimeError, match=f"missing {gone!r}"):
            fresh.load_state_dict(partial)


def test_deepspeed_moe_checkpoint_loads_and_continues(results):
    for rank, r in enumerate(results):
        saved, loaded = r["ds_saved2"], r["ours_loaded"]
        assert list(loaded) == list(saved), rank
        for k in saved:
            assert torch.equal(loaded[k], saved[k]), (rank, k)  # this rank's experts, exactly
        assert r["ours_cont"] == pytest.approx(r["ds_cont2"], rel=1e-5, abs=1e-6), rank
        assert r["ours_cont_ep1"] == pytest.approx(r["ds_cont_ep1"], rel=1e-5, abs=1e-6), rank
        for k, v in saved.items():  # at EP 1 (ZeRO 1) local expert i of rank r is global expert 2r + i
            i = k.split(".deepspeed_experts.")[1].split(".")[0] if ".deepspeed_experts." in k else None
            key = k if i is None else k.replace(f".deepspeed_experts.{i}.", f".deepspeed_experts.{2 * rank + int(i)}.")
            assert torch.equal(results[0]["ep1_loaded"][key], v), (rank, k)


def test_our_moe_checkpoint_exported_loads_into_deepspeed(results):
    for rank, r in enumerate(results):
        saved, loaded = r["ours_saved"], r["ds_loaded"]
        assert list(loaded) == list(saved), rank
        for k in saved:
            assert torch.equal(loaded[k], saved[k]), (rank, k)
        assert r["ds_more"] == pytest.approx(r["ours_more"], rel=1e-5, abs=1e-6), rank


def test_deepspeed_moe_checkpoint_without_zero_is_refused(results):
    r = results[0]
    assert r["refused"] is not None and "expp_rank_*" in r["refused"] and "ZeRO stage 1 or 2" in r["refused"]
    assert "\n" not in r["refused"]
    assert r["untouched"]


@pytest.mark.parametrize("policy", [None, "RSample"])
def test_cifar_moe_example_equals_deepspeed_from_the_first_step(results, policy):
    """Random token selection (and RSample's Gumbel noise) draw from torch's global RNG, after DeepSpeed's loader
    drew its iterator's seed there: ours draws the same numbers, so the losses agree to fp32 rounding."""
    r = results[0]
    ds, ours = r[f"cifar/{policy}/ds"], r[f"cifar/{policy}/ours"]
    assert len(ds) == len(ours) == 3
    assert ours[0] == pytest.approx(ds[0], rel=0, abs=1e-6)
    assert ours == pytest.approx(ds, rel=0, abs=1e-5)
