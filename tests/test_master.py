"""MasterWeights alone (no engine): units + a ZeroRoot fed by plain backwards, on 1 and 2 ranks.

Each rank feeds its own known data; the reference is an unsharded copy of the model in the same process
whose gradient is the rank-average (the mean of every rank's loss), stepped by the plain torch optimizer.
- AdamW (weight decay) over two steps equals ``torch.optim.AdamW`` on the full parameters (fp32, 1e-6);
- the returned global gradient norm is the true norm over all ranks' chunks (1e-6 relative), with the loss
  scale divided out;
- clipping: SGD after clipping equals ``clip_grad_norm_`` + SGD (coefficient clip / (norm + 1e-6)); a clip
  above the norm changes nothing;
- overflow (check_overflow=True, an inf in rank 0's gradient only): every rank reports overflow, masters and
  parameters are unchanged (exact);
- frozen parameters (a frozen weight inside a trained unit, and a wholly frozen unit) are untouched (exact);
- bf16 units with fp32 masters: the master steps in fp32 (1e-6) and the unit holds exactly its bf16 cast.
"""
from __future__ import annotations

import copy
import math

import pytest
import torch
from distributed import one_and_two_rank_fixtures
from torch import nn

TOL = {"rtol": 1e-6, "atol": 1e-6}
LR = 0.05


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 3), nn.Tanh(), nn.Linear(3, 2))


def _unit_params(model):
    return [[model[0].weight, model[0].bias], [model[2].weight, model[2].bias], [model[4].weight, model[4].bias]]


def _data(rank, k, dtype=torch.float32):
    g = torch.Generator().manual_seed(100 * k + rank)
    return torch.randn(4, 5, generator=g).to(dtype), torch.randn(4, 2, generator=g).to(dtype)


def _loss(model, x, y):
    return ((model(x) - y) ** 2).mean()


def _flat_units(model):
    return [torch.cat([p.detach().float().reshape(-1) for p in ps]) for ps in _unit_params(model)]


def _run():
    import torch.distributed as dist

    from shardspeed.comm.collectives import Collectives, CommsLogger
    from shardspeed.mesh.topology import Topology
    from shardspeed.zero.master import MasterWeights
    from shardspeed.zero.owned_unit import ReducePolicy
    from shardspeed.zero.root import ZeroRoot
    from shardspeed.zero.unit import FlatParamUnit

    rank, world = dist.get_rank(), dist.get_world_size()
    comm = Collectives(Topology.data_parallel(), CommsLogger())

    def build(make_opt, *, dtype=torch.float32, check_overflow=False, freeze=False):
        model = _model()
        if freeze:
            model[0].weight.requires_grad_(False)
            model[4].requires_grad_(False)
        model.to(dtype)
        ref = copy.deepcopy(model).float()
        units = [FlatParamUnit(ps, world=world, rank=rank, index=i) for i, ps in enumerate(_unit_params(model))]
        policy = ReducePolicy.for_stage(2, overlap=False, accum_dtype=torch.float32, comm_dtype=torch.float32)
        reducer = ZeroRoot(units, comm, policy, max_buckets=3)
        group_of = {id(p): 0 for p in model.parameters() if p.requires_grad}
        master = MasterWeights(units, reducer, comm, group_of, make_opt, sharded=True, gather_after_step=True,
                               check_overflow=check_overflow)
        return model, ref, units, reducer, master

    def ref_grads(ref, k, scale=1.0):
        """Rank-averaged gradients on the reference (its .grad), for micro-batch k of every rank."""
        ref.zero_grad(set_to_none=True)
        loss = sum(_loss(ref, *_data(r, k)) for r in range(world)) * (scale / world)
        loss.backward()

    def fulls(units):
        return [u.full[: u.numel].detach().float().clone() for u in units]

    out = {"rank": rank, "world": world}

    # ---- AdamW over two steps -----------------------------------------------------------------------
    model, ref, units, reducer, master = build(lambda groups: torch.optim.AdamW(groups, lr=LR, weight_decay=0.1))
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=LR, weight_decay=0.1)
    a = out["adamw"] = {"got": [], "exp": [], "norm": [], "norm_exp": [], "overflow": []}
    for k in range(2):
        _loss(model, *_data(rank, k)).backward()
        res = master.step(loss_scale=1.0, clip=0.0)
        reducer.zero_grads()
        ref_grads(ref, k)
        a["norm_exp"].append(float(torch.cat([p.grad.reshape(-1) for p in ref.parameters()]).norm()))
        ref_opt.step()
        a["got"].append(fulls(units))
        a["exp"].append(_flat_units(ref))
        a["norm"].append(res.grad_norm)
        a["overflow"].append(res.overflow)
    a["aliases"] = [m.data_ptr() == u.shard.data_ptr() for m, u in zip(master.masters, units)]
    reducer.close()

    # ---- clipping (SGD), with a loss scale ------------------------------------------------------------
    c = out["clip"] = {}
    for name, clip in (("tight", 0.05), ("loose", 1e6)):
        model, ref, units, reducer, master = build(lambda groups: torch.optim.SGD(groups, lr=LR))
        (_loss(model, *_data(rank, 3)) * 8.0).backward()
        res = master.step(loss_scale=8.0, clip=clip)
        reducer.close()
        ref_grads(ref, 3)
        norm = float(torch.nn.utils.clip_grad_norm_(ref.parameters(), clip))
        torch.optim.SGD(ref.parameters(), lr=LR).step()
        c[name] = {"got": fulls(units), "exp": _flat_units(ref), "norm": res.grad_norm, "norm_exp": norm,
                   "clip": clip}

    # ---- overflow: an inf in rank 0's gradient only ----------------------------------------------------
    model, ref, units, reducer, master = build(lambda groups: torch.optim.AdamW(groups, lr=LR),
                                               check_overflow=True)
    before_full = fulls(units)
    before_master = [m.clone() for m in master.masters]
    _loss(model, *_data(rank, 4)).backward()
    if rank == 0:
        reducer.grad_shard(1)[0] = float("inf")
    res = master.step(loss_scale=1.0, clip=1.0)
    out["overflow"] = {
        "overflow": res.overflow, "norm_finite": math.isfinite(res.grad_norm),
        "full_same": all(torch.equal(a_, b_) for a_, b_ in zip(before_full, fulls(units))),
        "master_same": all(torch.equal(a_, b_) for a_, b_ in zip(before_master, master.masters)),
        "opt_state_empty": len(master.optimizer.state) == 0,
    }
    reducer.close()

    # ---- frozen parameters -------------------------------------------------------------------------
    model, ref, units, reducer, master = build(lambda groups: torch.optim.AdamW(groups, lr=LR, weight_decay=0.1),
                                               freeze=True)
    frozen_before = {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}
    _loss(model, *_data(rank, 5)).backward()
    master.step(loss_scale=1.0, clip=0.0)
    ref_grads(ref, 5)
    torch.optim.AdamW([p for p in ref.parameters() if p.requires_grad], lr=LR, weight_decay=0.1).step()
    out["frozen"] = {
        "frozen_after": {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad},
        "frozen_before": frozen_before,
        "trained": {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad},
        "trained_exp": {n: p.detach().clone() for n, p in ref.named_parameters() if p.requires_grad},
        "master_none": [m is None for m in master.masters],
    }
    reducer.close()

    # ---- bf16 units, fp32 masters ------------------------------------------------------------------
    model, ref, units, reducer, master = build(lambda groups: torch.optim.SGD(groups, lr=LR), dtype=torch.bfloat16)
    init = [m.clone() for m in master.masters]
    _loss(model, *_data(rank, 6, torch.bfloat16)).backward()
    master.step(loss_scale=1.0, clip=0.0)
    out["bf16"] = {
        "master_dtype": [m.dtype for m in master.masters],
        "unit_dtype": [u.full.dtype for u in units],
        "aliases": [m.data_ptr() == u.shard.data_ptr() for m, u in zip(master.masters, units)],
        "master": [m.clone() for m in master.masters],
        "init": init,
        "shard": [u.shard.clone() for u in units],
        "layout": [(u.layout.padded_numel, *u.layout.chunk_range(rank)) for u in units],
    }
    reducer.close()
    return out


def _bf16_grads(world):
    """Per unit, the full padded fp32 mean over ranks of the bf16 model's gradients (initial weights)."""
    model = _model().to(torch.bfloat16)
    total = None
    for r in range(world):
        model.zero_grad(set_to_none=True)
        _loss(model, *_data(r, 6, torch.bfloat16)).backward()
        g = [torch.cat([p.grad.float().reshape(-1) for p in ps]) for ps in _unit_params(model)]
        total = g if total is None else [a + b for a, b in zip(total, g)]
    return [t / world for t in total]


world1, world2, ranks = one_and_two_rank_fixtures(_run)  # fixtures: a 1-rank run, a 2-rank run, each of them


def test_adamw_step_equals_torch_adamw_on_full_params(ranks):
    for r in ranks:
        a = r["adamw"]
        assert a["overflow"] == [False, False]
        assert all(a["aliases"]), "fp32 units on the device: the master is the shard itself"
        for step, (got, exp) in enumerate(zip(a["got"], a["exp"])):
            for ui, (g, e) in enumerate(zip(got, exp)):
                torch.testing.assert_close(g, e, **TOL, msg=lambda m, s=step, u=ui: f"step {s} unit {u}: {m}")


def test_ranks_agree_after_step(world2):
    for x, y in zip(world2[0]["adamw"]["got"][-1], world2[1]["adamw"]["got"][-1]):
        assert torch.equal(x, y)


def test_global_grad_norm_is_the_norm_over_all_chunks(ranks):
    for r in ranks:
        a = r["adamw"]
        for got, exp in zip(a["norm"], a["norm_exp"]):
            assert got == pytest.approx(exp, rel=1e-6)
        # the loss scale is divided out of the norm
        c = r["clip"]["tight"]
        assert c["norm"] == pytest.approx(c["norm_exp"], rel=1e-6)


def test_clipping_coefficient(ranks):
    for r in ranks:
        for name in ("tight", "loose"):
            c = r["clip"][name]
            if name == "tight":
                assert c["norm_exp"] > c["clip"], "the tight case must actually clip"
            for ui, (g, e) in enumerate(zip(c["got"], c["exp"])):
                torch.testing.assert_close(g, e, **TOL, msg=lambda m, w=name, u=ui: f"{w} unit {u}: {m}")


def test_overflow_skips_step_on_every_rank(ranks):
    for r in ranks:
        o = r["overflow"]
        assert o["overflow"] is True, f"rank {r['rank']} did not see rank 0's inf"
        assert not o["norm_finite"]
        assert o["full_same"] and o["master_same"]
        assert o["opt_state_empty"]


def test_frozen_params_untouched(ranks):
    for r in ranks:
        f = r["frozen"]
        assert set(f["frozen_after"]) == {"0.weight", "4.weight", "4.bias"}
        for n, p in f["frozen_before"].items():
            assert torch.equal(f["frozen_after"][n], p), n
        # a unit with nothing trainable in this rank's chunk has no master: the frozen unit 2 everywhere, and
        # unit 0 (35 frozen weight + 7 bias elements) on rank 0 of 2, whose 21-element chunk is all weight
        assert f["master_none"] == [r["world"] == 2 and r["rank"] == 0, False, True]
        for n, p in f["trained_exp"].items():
            torch.testing.assert_close(f["trained"][n], p, **TOL, msg=lambda m, w=n: f"{w}: {m}")


def test_bf16_units_with_fp32_masters_write_back(ranks):
    for r in ranks:
        b = r["bf16"]
        assert b["master_dtype"] == [torch.float32] * 3
        assert b["unit_dtype"] == [torch.bfloat16] * 3
        assert not any(b["aliases"])
        grads = _bf16_grads(r["world"])
        for ui, (padded, lo, hi) in enumerate(b["layout"]):
            g = torch.zeros(padded)
            g[: grads[ui].numel()] = grads[ui]
            exp = b["init"][ui] - LR * g[lo:hi]
            torch.testing.assert_close(b["master"][ui], exp, **TOL, msg=lambda m, u=ui: f"unit {u}: {m}")
            assert torch.equal(b["shard"][ui], b["master"][ui].to(torch.bfloat16)), f"unit {ui}: write-back"
            assert not torch.equal(b["master"][ui], b["init"][ui])


def test_clip_factor_is_rounded_as_deepspeeds():
    """DeepSpeed computes the clip factor in fp32 tensors: ZeRO 0 (``clip_grad_norm_``) clip / (norm + 1e-6),
    ZeRO 1-3 (``unscale_and_clip_grads``) 1 / ((norm + 1e-6) / clip). 1.2384441 (a gradient norm of the MLP
    of test_ds_resume) is a norm where the same factor in double rounds to another fp32 value."""
    from shardspeed.zero.master import clip_factor

    for norm in (1.2384440898895264, 1.5281740427017212, 0.3, 7.0):
        for clip in (1.0, 0.5):
            n = torch.tensor([norm], dtype=torch.float32)
            stage0 = torch.min(torch.tensor([1.0]), torch.tensor([clip]) / (n + 1e-6))
            stage12 = 1.0 / torch.clamp(((n / 1.0) + 1e-6) / clip, min=1.0)
            assert clip_factor(norm, clip, False) == float(stage0), (norm, clip)
            assert clip_factor(norm, clip, True) == float(stage12), (norm, clip)
    double = min(1.0, 1.0 / (1.2384440898895264 + 1e-6))
    assert float(torch.tensor(double, dtype=torch.float32)) != clip_factor(1.2384440898895264, 1.0, False)
