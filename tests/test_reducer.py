"""A stage 0-2 ZeroRoot (gradient reduction) alone (no engine): FlatParamUnits over a small model, a Collectives, a policy per stage.

One worker function runs every case on a group (world 2, and world 1) and returns what it observed plus
the expected values it computed in-process: each rank feeds known per-rank data, so the expected
reduced gradient is the average of the plain gradients of every rank's data, computed on an unsharded
copy of the model in the same process. fp32 throughout; tolerance 1e-6 (the reduction sums two fp32
numbers and divides by 2, the same arithmetic as the expected value, so in practice it is exact).

Cases, per policy (stage 0 all-reduce over whole-buffer units, 1 reduce-scatter at the boundary, 2 and 3
reduce-scatter every micro-step):
- ``basic``: one backward, sync on: ``grad_shard(i)`` is this rank's chunk of the rank-average;
- ``nosync``: a backward with the sync policy False, then a boundary backward: stages 0-1 send nothing in
  the first (no collectives in the CommsLogger) and reduce the accumulated sum once in the second;
- ``twice``: two reducing backwards before the step: the sum of both, each unit reduced once per backward,
  and ``reduce_pending()`` afterwards sends nothing more;
- ``assign``: ``.grad`` assigned by hand (no hook fires) is taken in by ``reduce_pending()``;
- ``multi``: ``torch.autograd.backward`` on two outputs;
- ``zero``: after ``zero_grads`` the next backward holds only its own gradients, and ``reduce_pending``
  with nothing arrived raises ShardspeedError (also on a fresh reducer);
- ``held_bytes`` before/after a backward; ``launch_log`` unit order (compared across ranks).
"""
from __future__ import annotations

import copy

import pytest
import torch
from distributed import one_and_two_rank_fixtures
from torch import nn

TOL = {"rtol": 1e-6, "atol": 1e-6}
# (name, stage, overlap): the stage picks ReducePolicy.for_stage; "3" is stage 3's policy over flat units
# "s3c": stage 3's reducer as the builder makes it, small units coalesced into one reduce-scatter
POLICIES = [("s0", 0, False), ("s1", 1, True), ("s1sync", 1, False), ("s2", 2, True), ("s3", 3, True),
            ("s3c", 3, True)]
COALESCED = {"s3c"}
COALESCE_NUMEL = 40  # the units are 42, 24 and 8 elements (padded at world 2): the two smaller go together
REDUCE_OPS = ("all_reduce", "reduce_scatter")


def _model() -> nn.Module:
    torch.manual_seed(0)  # same initial weights on every rank
    # odd sizes: units need padding at world 2, and parameters straddle the chunk boundary
    return nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 3), nn.Tanh(), nn.Linear(3, 2))


def _data(rank: int, k: int, n: int = 4):
    g = torch.Generator().manual_seed(1000 * k + rank)
    return torch.randn(n, 5, generator=g), torch.randn(n, 2, generator=g)


def _loss(model, x, y):
    return ((model(x) - y) ** 2).mean()


def _unit_params(model):
    """Three units: each Linear's weight and bias."""
    return [[model[0].weight, model[0].bias], [model[2].weight, model[2].bias], [model[4].weight, model[4].bias]]


def _plain_grads(ref: nn.Module, batches) -> list:
    """Gradients (per parameter, in _unit_params order) of the sum of the losses of ``batches``."""
    ref.zero_grad(set_to_none=True)
    for x, y in batches:
        _loss(ref, x, y).backward()
    return [[p.grad.detach().clone() for p in ps] for ps in _unit_params(ref)]


def _expected(ref, units, world, per_rank_batches, rank):
    """This rank's chunk of the rank-averaged gradients, per unit; ``per_rank_batches(r)`` lists rank r's."""
    total = None
    for r in range(world):
        g = _plain_grads(ref, per_rank_batches(r))
        total = g if total is None else [[a + b for a, b in zip(ta, tb)] for ta, tb in zip(total, g)]
    out = []
    for u, grads in zip(units, total):
        flat = torch.zeros(u.layout.padded_numel)
        for i, gp in enumerate(grads):
            u.param_view(flat, i).copy_(gp.reshape(-1) / world)
        lo, hi = u.layout.chunk_range(u.rank)
        out.append(flat[lo:hi].clone())
    return out


def _counts(comm):
    s = comm.log.summary()
    return {op: int(s[op]["count"]) for op in REDUCE_OPS if op in s}


def _shards(reducer, n):
    return [None if reducer.grad_shard(i) is None else reducer.grad_shard(i).detach().clone() for i in range(n)]


def _run():
    import torch.distributed as dist

    from shardspeed.comm.collectives import Collectives, CommsLogger
    from shardspeed.errors import ShardspeedError
    from shardspeed.mesh.topology import Topology
    from shardspeed.zero.owned_unit import ReducePolicy
    from shardspeed.zero.root import ZeroRoot
    from shardspeed.zero.unit import FlatParamUnit

    rank, world = dist.get_rank(), dist.get_world_size()
    comm = Collectives(Topology.data_parallel(), CommsLogger())
    results = {}

    def build(stage, overlap, coalesce=False):
        model = _model()
        ref = copy.deepcopy(model)
        uw, ur = (1, 0) if stage == 0 else (world, rank)  # stage 0 units are not sharded (as the builder does)
        units = [FlatParamUnit(ps, world=uw, rank=ur, index=i) for i, ps in enumerate(_unit_params(model))]
        policy = ReducePolicy.for_stage(stage, overlap=overlap, accum_dtype=torch.float32, comm_dtype=torch.float32)
        # "s3c" as the builder makes stage 3's: bounded in elements (one largest unit alive), small units coalesced
        reducer = ZeroRoot(units, comm, policy, max_buckets=None if coalesce else {2: 3, 3: 1}.get(stage),
                                  coalesce_numel=COALESCE_NUMEL if coalesce else 0,
                                  max_alive_numel=max(u.layout.padded_numel for u in units) if coalesce else 0)
        return model, ref, units, reducer

    for name, stage, overlap in POLICIES:
        res = results[name] = {"policy_op": None}
        sync = {"on": True}

        # ---- basic -------------------------------------------------------------------------------
        model, ref, units, reducer = build(stage, overlap, name in COALESCED)
        res["policy_op"] = reducer.policy.op.value
        res["every_micro_step"] = reducer.policy.every_micro_step
        res["held_before"] = reducer.held_bytes()
        res["layout"] = [(u.layout.padded_numel, u.layout.chunk_size) for u in units]
        comm.log.reset()
        x, y = _data(rank, 0)
        _loss(model, x, y).backward()
        res["basic"] = _shards(reducer, len(units))
        res["basic_exp"] = _expected(ref, units, world, lambda r: [_data(r, 0)], rank)
        res["basic_counts"] = _counts(comm)
        res["param_grads_after"] = [p.grad is None for p in model.parameters()]
        res["held_after"] = reducer.held_bytes()
        res["launch_log"] = [ui for ui, _ in reducer.launch_log]
        # the next backward (order learned from the first) launches in the same order on every rank
        reducer.zero_grads()
        res["held_after_zero"] = reducer.held_bytes()
        res["shard_after_zero"] = _shards(reducer, len(units))
        comm.log.reset()
        x, y = _data(rank, 5)
        _loss(model, x, y).backward()
        res["zero_next"] = _shards(reducer, len(units))
        res["zero_next_exp"] = _expected(ref, units, world, lambda r: [_data(r, 5)], rank)
        res["launch_log2"] = [ui for ui, _ in reducer.launch_log]
        reducer.zero_grads()
        try:
            reducer.reduce_pending()
            res["pending_after_zero"] = None
        except ShardspeedError as exc:
            res["pending_after_zero"] = str(exc)
        reducer.close()

        # ---- nosync: a non-boundary backward then a boundary one ------------------------------------
        model, ref, units, reducer = build(stage, overlap, name in COALESCED)
        try:
            reducer.reduce_pending()  # fresh reducer, nothing arrived
            res["pending_fresh"] = None
        except ShardspeedError as exc:
            res["pending_fresh"] = str(exc)
        reducer.set_sync_policy(lambda sync=sync: sync["on"])
        comm.log.reset()
        sync["on"] = False
        _loss(model, *_data(rank, 1)).backward()
        res["nosync_counts_1"] = _counts(comm)
        res["nosync_shard_1"] = _shards(reducer, len(units))
        comm.log.reset()
        sync["on"] = True
        _loss(model, *_data(rank, 2)).backward()
        res["nosync_counts_2"] = _counts(comm)
        comm.log.reset()
        reducer.reduce_pending()  # at the boundary: nothing left to reduce
        res["nosync_counts_pending"] = _counts(comm)
        res["nosync"] = _shards(reducer, len(units))
        res["nosync_exp"] = _expected(ref, units, world, lambda r: [_data(r, 1), _data(r, 2)], rank)
        reducer.close()

        # ---- twice: two reducing backwards before one step --------------------------------------------
        model, ref, units, reducer = build(stage, overlap, name in COALESCED)
        comm.log.reset()
        _loss(model, *_data(rank, 3)).backward()
        res["twice_counts_1"] = _counts(comm)
        comm.log.reset()
        _loss(model, *_data(rank, 4)).backward()
        res["twice_counts_2"] = _counts(comm)
        comm.log.reset()
        reducer.reduce_pending()
        res["twice_counts_pending"] = _counts(comm)
        res["twice"] = _shards(reducer, len(units))
        res["twice_exp"] = _expected(ref, units, world, lambda r: [_data(r, 3), _data(r, 4)], rank)
        reducer.close()

        # ---- assign: .grad written by hand; no hook fires ----------------------------------------------
        model, ref, units, reducer = build(stage, overlap, name in COALESCED)
        params = [p for ps in _unit_params(model) for p in ps]
        grads = torch.autograd.grad(_loss(model, *_data(rank, 6)), params)
        for p, g in zip(params, grads):
            p.grad = g
        comm.log.reset()
        res["assign_before_pending"] = _shards(reducer, len(units))
        reducer.reduce_pending()
        res["assign_counts"] = _counts(comm)
        res["assign"] = _shards(reducer, len(units))
        res["assign_exp"] = _expected(ref, units, world, lambda r: [_data(r, 6)], rank)
        res["assign_grads_taken"] = [p.grad is None for p in params]
        reducer.close()

        # ---- multi: torch.autograd.backward on two outputs ----------------------------------------------
        model, ref, units, reducer = build(stage, overlap, name in COALESCED)
        x, y = _data(rank, 7)
        comm.log.reset()
        torch.autograd.backward([_loss(model, x[:2], y[:2]), _loss(model, x[2:], y[2:])])
        res["multi_counts"] = _counts(comm)
        res["multi"] = _shards(reducer, len(units))
        res["multi_exp"] = _expected(
            ref, units, world, lambda r: [(_data(r, 7)[0][:2], _data(r, 7)[1][:2]),
                                          (_data(r, 7)[0][2:], _data(r, 7)[1][2:])], rank)
        reducer.close()
    return results


world1, world2, ranks = one_and_two_rank_fixtures(_run)  # fixtures: a 1-rank run, a 2-rank run, each of them


NAMES = [p[0] for p in POLICIES]
STAGE = {p[0]: p[1] for p in POLICIES}


def _close(got, exp):
    assert len(got) == len(exp)
    for i, (g, e) in enumerate(zip(got, exp)):
        assert g is not None, f"unit {i}: no reduced gradient"
        torch.testing.assert_close(g, e, **TOL, msg=lambda m, i=i: f"unit {i}: {m}")


def _n_units(res, name=""):
    """Collectives one reducing backward issues: one per unit, or with coalescing ("s3c") one per unit of at
    least the threshold plus one per group of the smaller ones (in launch order), a group sent once it
    reaches the threshold, or at the end of the backward."""
    if name not in COALESCED:
        return len(res["layout"])
    sizes = [padded for padded, _ in res["layout"]]
    small, n, pending = res.get("coalesce_numel", COALESCE_NUMEL), 0, 0
    for ui in res["launch_log"]:
        if sizes[ui] < small:
            pending += sizes[ui]
            if pending >= small:
                n, pending = n + 1, 0
        else:
            n += 1
    return n + (1 if pending else 0)


def _expected_op(name):
    return "all_reduce" if STAGE[name] == 0 else "reduce_scatter"


def test_policy_for_stage():
    from shardspeed.zero.owned_unit import ReduceOp, ReducePolicy

    kw = {"overlap": False, "accum_dtype": torch.float32, "comm_dtype": torch.float32}
    assert ReducePolicy.for_stage(0, **kw).op is ReduceOp.ALL_REDUCE
    assert not ReducePolicy.for_stage(0, **kw).every_micro_step
    assert ReducePolicy.for_stage(1, **kw).op is ReduceOp.REDUCE_SCATTER
    assert not ReducePolicy.for_stage(1, **kw).every_micro_step
    assert ReducePolicy.for_stage(2, **kw).every_micro_step
    assert ReducePolicy.for_stage(2, reduce_scatter=False, **kw).op is ReduceOp.ALL_REDUCE
    assert ReducePolicy.for_stage(3, reduce_scatter=False, **kw).op is ReduceOp.REDUCE_SCATTER
    assert ReducePolicy.for_stage(3, **kw).every_micro_step


@pytest.mark.parametrize("name", NAMES)
def test_basic_backward_gives_rank_average_of_this_ranks_chunk(ranks, name):
    for rank_res in ranks:
        res = rank_res[name]
        _close(res["basic"], res["basic_exp"])
        assert res["basic_counts"] == {_expected_op(name): _n_units(res, name)}
        assert all(res["param_grads_after"]), ".grad is dropped once taken into the bucket"


def test_ranks_hold_different_chunks(world2):
    """At stages 1-3 the two ranks hold different halves; at stage 0 both hold the whole average."""
    for name in NAMES:
        a, b = world2[0][name]["basic"], world2[1][name]["basic"]
        if STAGE[name] == 0:
            for x, y in zip(a, b):
                assert torch.equal(x, y)
        else:
            assert any(not torch.equal(x, y) for x, y in zip(a, b)), name


@pytest.mark.parametrize("name", NAMES)
def test_non_boundary_backward_does_not_reduce_and_boundary_reduces_the_sum_once(ranks, name):
    for rank_res in ranks:
        res = rank_res[name]
        n = _n_units(res, name)
        if STAGE[name] >= 2:  # stages 2-3 reduce every micro-step regardless of the sync policy
            assert res["nosync_counts_1"] == {"reduce_scatter": n}
            assert res["nosync_counts_2"] == {"reduce_scatter": n}
        else:
            assert res["nosync_counts_1"] == {}, "a non-boundary backward issued collectives"
            assert res["nosync_shard_1"] == [None] * n
            assert res["nosync_counts_2"] == {_expected_op(name): n}
        assert res["nosync_counts_pending"] == {}, "reduce_pending reduced again what was reduced"
        _close(res["nosync"], res["nosync_exp"])


@pytest.mark.parametrize("name", NAMES)
def test_two_backwards_in_one_boundary_sum_and_reduce_once_each(ranks, name):
    for rank_res in ranks:
        res = rank_res[name]
        n = _n_units(res, name)
        assert res["twice_counts_1"] == {_expected_op(name): n}
        assert res["twice_counts_2"] == {_expected_op(name): n}
        assert res["twice_counts_pending"] == {}
        _close(res["twice"], res["twice_exp"])


@pytest.mark.parametrize("name", NAMES)
def test_grad_assigned_by_hand_is_taken_in_by_reduce_pending(ranks, name):
    for rank_res in ranks:
        res = rank_res[name]
        assert res["assign_before_pending"] == [None] * _n_units(res)
        assert res["assign_counts"] == {_expected_op(name): _n_units(res, name)}
        _close(res["assign"], res["assign_exp"])
        assert all(res["assign_grads_taken"])


@pytest.mark.parametrize("name", NAMES)
def test_autograd_backward_on_two_outputs(ranks, name):
    for rank_res in ranks:
        res = rank_res[name]
        assert res["multi_counts"] == {_expected_op(name): _n_units(res, name)}, "reduced more than once"
        _close(res["multi"], res["multi_exp"])


@pytest.mark.parametrize("name", NAMES)
def test_reduce_pending_with_nothing_arrived_raises(ranks, name):
    for rank_res in ranks:
        res = rank_res[name]
        assert res["pending_fresh"] is not None and "no gradients" in res["pending_fresh"]
        assert res["pending_after_zero"] is not None and "no gradients" in res["pending_after_zero"]


@pytest.mark.parametrize("name", NAMES)
def test_zero_grads_resets(ranks, name):
    for rank_res in ranks:
        res = rank_res[name]
        for s in res["shard_after_zero"]:  # forgotten (None) or zeroed
            assert s is None or torch.count_nonzero(s) == 0
        _close(res["zero_next"], res["zero_next_exp"])  # not added to the previous step's gradients


@pytest.mark.parametrize("name", NAMES)
def test_held_bytes(ranks, name):
    for rank_res in ranks:
        res = rank_res[name]
        assert res["held_before"] == 0
        if res["every_micro_step"]:  # only the chunk-sized results; buckets freed
            expected = sum(chunk * 4 for _, chunk in res["layout"])
        else:  # the full-size bucket that holds the result
            expected = sum(padded * 4 for padded, _ in res["layout"])
        assert res["held_after"] == expected
        assert res["held_after_zero"] <= expected


def test_units_launch_in_the_same_order_on_every_rank(world2):
    for name in NAMES:
        a, b = world2[0][name], world2[1][name]
        n = _n_units(a)
        for key in ("launch_log", "launch_log2"):
            assert sorted(a[key]) == list(range(n)), (name, key, a[key])
            assert a[key] == b[key], (name, key)
