"""A stage-3 ZeroRoot alone (no engine): units from ``build_stage3_units`` over a model of 4 blocks + a head
+ a root parameter, hooked as the builder does, on 1 and 2 ranks.

Units: blocks 0-3 (72 elements each), the head (36), the root's own ``scale`` (4); prefetch bucket 100
elements (one block ahead), no persistent units.
- during forward only the running unit, the root and at most one prefetched block are gathered; after a
  forward with grad enabled every non-root unit is SHARDED (placeholders in ``.data``) although autograd
  holds the graph; after a no-grad forward the root is released too;
- backward re-gathers and gives this rank's chunk of the rank-averaged gradients of an unsharded copy
  (fp32, 1e-6); after backward every unit is released;
- two forwards then two backwards (F0 F1 B0 B1) give the gradients of sequential F0 B0 F1 B1 (1e-6);
- ``set_reshard_after_forward(False)`` keeps every unit gathered across forwards and backwards until
  ``after_step()``, gathering each once per step; ``True`` restores per-use gathering;
- ``gather_count``: with per-use gathering, 2 gathers (forward, backward) per non-root unit per
  micro-batch, 1 for the root (kept from its forward to its backward).
"""
from __future__ import annotations

import copy

import torch
from distributed import one_and_two_rank_fixtures
from torch import nn

TOL = {"rtol": 1e-6, "atol": 1e-6}
N_BLOCKS = 4
HEAD, ROOT = 4, 5  # unit indices (blocks are 0-3)


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(8, 8), nn.Tanh()) for _ in range(N_BLOCKS))
        self.head = nn.Linear(8, 4)
        self.scale = nn.Parameter(torch.linspace(0.5, 1.5, 4))

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return self.head(x) * self.scale


def _data(rank, k):
    g = torch.Generator().manual_seed(10 * k + rank)
    return torch.randn(3, 8, generator=g), torch.randn(3, 4, generator=g)


def _loss(out, y):
    return ((out - y) ** 2).mean()


def _run():
    import torch.distributed as dist

    from shardspeed.comm.collectives import Collectives, CommsLogger
    from shardspeed.mesh.topology import Topology
    from shardspeed.plan import decide
    from shardspeed.zero.owned_unit import ReducePolicy
    from shardspeed.zero.stage3_units import build_stage3_units
    from shardspeed.zero.unit import UnitState

    rank, world = dist.get_rank(), dist.get_world_size()
    comm = Collectives(Topology.data_parallel(), CommsLogger())
    torch.manual_seed(0)
    model = Net()
    ref = copy.deepcopy(model)
    name_of = {id(p): n for n, p in model.named_parameters()}
    sharding = decide({"train_batch_size": world, "zero_optimization": {
        "stage": 3, "stage3_prefetch_bucket_size": 100, "stage3_param_persistence_threshold": 0}}, world).sharding
    policy = ReducePolicy.for_stage(3, overlap=True, accum_dtype=torch.float32, comm_dtype=torch.float32)
    manager = reducer = build_stage3_units(model, sharding, comm, rank, policy)
    units = manager.units
    out = {"rank": rank, "world": world, "unit_names": [[name_of[id(p)] for p in u.params] for u in units],
           "unit_numel": [u.numel for u in units]}

    def live():
        return sorted(u.index for u in units if u.state is UnitState.GATHERED or u.gathering)

    log = {"fwd": None, "bwd": None}

    def recorder(kind):
        def hook(*_):
            if log[kind] is not None:
                log[kind].append(live())
        return hook

    for b in model.blocks:  # registered after the manager's hooks: they see the units it gathered
        b.register_forward_pre_hook(recorder("fwd"))
    model.head.register_forward_pre_hook(recorder("fwd"))

    def watch_ready(o):  # record what is gathered when autograd is done with a unit (before it is released)
        arrived = o.arrived

        def wrapped(pi, track_release):
            done = arrived(pi, track_release)
            if done and log["bwd"] is not None:
                log["bwd"].append((o.index, live()))
            return done
        o.arrived = wrapped

    for o in manager.owned:
        watch_ready(o)

    def shards():
        return [reducer.grad_shard(i).clone() for i in range(len(units))]

    def expected(ks):
        ref.zero_grad(set_to_none=True)
        for r in range(world):
            for k in ks:
                x, y = _data(r, k)
                (_loss(ref(x), y) / world).backward()
        grads = {n: p.grad for n, p in ref.named_parameters()}
        outs = []
        for u in units:
            flat = torch.zeros(u.layout.padded_numel)
            for i, p in enumerate(u.params):
                u.param_view(flat, i).copy_(grads[name_of[id(p)]].reshape(-1))
            lo, hi = u.layout.chunk_range(rank)
            outs.append(flat[lo:hi].clone())
        return outs

    def states():
        return [u.state.value for u in units]

    def step_end():
        reducer.zero_grads()
        manager.after_step()

    # ---- step 1: sequential, traces recorded -----------------------------------------------------------
    s = out["seq1"] = {"fwd_live": [], "after_fwd": [], "after_bwd": [], "bwd_live": []}
    manager.gather_count = 0
    for k in (0, 1):
        log["fwd"], log["bwd"] = [], []
        x, y = _data(rank, k)
        loss = _loss(model(x), y)
        s["fwd_live"].append(log["fwd"])
        s["after_fwd"].append(states())
        s.setdefault("placeholders_after_fwd", [p.data.numel() for u in units[:ROOT] for p in u.params])
        loss.backward()
        s["bwd_live"].append(log["bwd"])
        s["after_bwd"].append(states())
    log["fwd"] = log["bwd"] = None
    s["gather_count"] = manager.gather_count
    s["grads"], s["exp"] = shards(), expected([0, 1])
    step_end()
    s["after_step"] = states()

    # ---- step 2: interleaved F0 F1 B0 B1, traces in use (prefetch) -----------------------------------------
    s = out["inter"] = {}
    manager.gather_count = 0
    log["fwd"] = []
    (x0, y0), (x1, y1) = _data(rank, 0), _data(rank, 1)
    l0 = _loss(model(x0), y0)
    s["fwd_live"] = log["fwd"]
    log["fwd"] = None
    s["after_f0"] = states()
    l1 = _loss(model(x1), y1)
    s["after_f1"] = states()
    l0.backward()
    s["after_b0"] = states()
    l1.backward()
    s["after_b1"] = states()
    s["gather_count"] = manager.gather_count
    s["grads"] = shards()
    step_end()

    # ---- step 3: sequential again (traced): gather counts per step --------------------------------------
    s = out["seq3"] = {}
    manager.gather_count = 0
    for k in (0, 1):
        x, y = _data(rank, k)
        _loss(model(x), y).backward()
    s["gather_count"] = manager.gather_count
    s["grads"] = shards()
    step_end()

    # ---- step 4: reshard_after_forward=False keeps units gathered until the step ----------------------
    s = out["keep"] = {"after_fwd": [], "after_bwd": []}
    manager.set_reshard_after_forward(False)
    manager.gather_count = 0
    for k in (0, 1):
        x, y = _data(rank, k)
        loss = _loss(model(x), y)
        s["after_fwd"].append(states())
        loss.backward()
        s["after_bwd"].append(states())
    s["gather_count"] = manager.gather_count
    s["grads"] = shards()
    step_end()
    s["after_step"] = states()
    manager.set_reshard_after_forward(True)
    s["restored_after_true"] = states()

    # ---- step 5: per-use gathering restored; a no-grad forward releases everything ---------------------
    s = out["restored"] = {}
    manager.gather_count = 0
    x, y = _data(rank, 0)
    loss = _loss(model(x), y)
    s["after_fwd"] = states()
    loss.backward()
    s["after_bwd"] = states()
    s["gather_count"] = manager.gather_count
    s["grads"] = shards()
    s["exp"] = expected([0])
    step_end()
    with torch.no_grad():
        model(x)
    s["after_nograd_fwd"] = states()
    manager.close()
    return out


world1, world2, ranks = one_and_two_rank_fixtures(_run)  # fixtures: a 1-rank run, a 2-rank run, each of them


SH, GA = "sharded", "gathered"


def _close(got, exp, what):
    assert len(got) == len(exp) == ROOT + 1
    for i, (g, e) in enumerate(zip(got, exp)):
        torch.testing.assert_close(g, e, **TOL, msg=lambda m, i=i: f"{what} unit {i}: {m}")


def test_units_are_the_blocks_head_and_root(ranks):
    for r in ranks:
        assert r["unit_names"] == [[f"blocks.{i}.0.weight", f"blocks.{i}.0.bias"] for i in range(N_BLOCKS)] + [
            ["head.weight", "head.bias"], ["scale"]]
        assert r["unit_numel"] == [72] * N_BLOCKS + [36, 4]


def test_forward_gathers_only_the_running_unit_and_one_prefetched(ranks):
    for r in ranks:
        # the very first forward: no trace yet, so no prefetch: exactly the running unit (+ the root)
        first, second = r["seq1"]["fwd_live"]
        assert first == [[i, ROOT] for i in range(N_BLOCKS)] + [[HEAD, ROOT]]
        # traced (from the first backward on): the running unit, the root, and the next unit prefetched
        # (72 + 72 > 100 elements: only one)
        expect = [[i, i + 1, ROOT] for i in range(N_BLOCKS)] + [[HEAD, ROOT]]
        assert second == expect
        assert r["inter"]["fwd_live"] == expect


def test_non_root_units_released_after_forward_with_grad(ranks):
    for r in ranks:
        for st in r["seq1"]["after_fwd"]:
            assert st == [SH] * ROOT + [GA]
        assert r["seq1"]["placeholders_after_fwd"] == [0] * 10
        assert r["inter"]["after_f0"] == [SH] * ROOT + [GA]


def test_no_grad_forward_releases_the_root_too(ranks):
    for r in ranks:
        assert r["restored"]["after_nograd_fwd"] == [SH] * (ROOT + 1)


def test_backward_bounded_gathers(ranks):
    for r in ranks:
        for bwd in r["seq1"]["bwd_live"]:
            assert [i for i, _ in bwd] == [ROOT, HEAD, 3, 2, 1, 0]  # gradients complete back to front
            for i, live in bwd:
                assert i in live
                assert len([j for j in live if j != ROOT]) <= 2, (i, live)


def test_backward_releases_everything(ranks):
    for r in ranks:
        for st in r["seq1"]["after_bwd"]:
            assert st == [SH] * (ROOT + 1)
        assert r["seq1"]["after_step"] == [SH] * (ROOT + 1)
        assert r["inter"]["after_b1"] == [SH] * (ROOT + 1)


def test_backward_gives_correct_gradients(ranks):
    for r in ranks:
        _close(r["seq1"]["grads"], r["seq1"]["exp"], "sequential")
        _close(r["seq3"]["grads"], r["seq1"]["exp"], "sequential, traced")
        _close(r["restored"]["grads"], r["restored"]["exp"], "one micro-batch")


def test_interleaved_forward_backward_equals_sequential(ranks):
    for r in ranks:
        _close(r["inter"]["grads"], r["seq1"]["exp"], "F0 F1 B0 B1")
        _close(r["inter"]["grads"], r["seq1"]["grads"], "F0 F1 B0 B1 vs F0 B0 F1 B1")


def test_ranks_hold_different_gradient_chunks(world2):
    a, b = world2[0]["seq1"]["grads"], world2[1]["seq1"]["grads"]
    assert all(not torch.equal(x, y) for x, y in zip(a, b))


def test_reshard_after_forward_false_keeps_units_until_after_step(ranks):
    for r in ranks:
        k = r["keep"]
        for st in k["after_fwd"] + k["after_bwd"]:
            assert st == [GA] * (ROOT + 1)
        assert k["after_step"] == [SH] * (ROOT + 1)
        assert k["restored_after_true"] == [SH] * (ROOT + 1)
        _close(k["grads"], r["seq1"]["exp"], "reshard_after_forward=False")
        assert k["gather_count"] == ROOT + 1, "each unit gathered once per step"


def test_gather_counts(ranks):
    per_micro_batch = 2 * ROOT + 1  # forward + backward per non-root unit, the root once
    for r in ranks:
        assert r["seq1"]["gather_count"] == 2 * per_micro_batch
        assert r["seq3"]["gather_count"] == 2 * per_micro_batch
        assert r["inter"]["gather_count"] == 2 * per_micro_batch
        assert r["restored"]["gather_count"] == per_micro_batch
