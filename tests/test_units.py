"""FlatParamUnit and ShardedParamUnit alone (no engine), on a 1-rank and a 2-rank group.

- FlatParamUnit: parameters become views of ``full`` holding their original values; ``shard`` is this
  rank's chunk (a view of ``full``); ``param_view``; padding is zero.
- ShardedParamUnit: starts SHARDED with empty placeholders in ``.data``; ``gather`` restores exact values;
  gather/release are idempotent (no second all-gather); ``release`` frees the gathered bytes (a view the
  test kept from the gathered parameters has a 0-byte storage afterwards — checked through the view's
  storage, the only way to see that memory really went); and the key property: forward (autograd saves
  views of the parameters), ``release()``, ``gather()``, backward gives exactly the gradients of the same
  computation without the release (Linear + tanh + Linear).
All comparisons are exact (same fp32 operations on the same values).
"""
from __future__ import annotations

import copy

import torch
from distributed import one_and_two_rank_fixtures
from torch import nn


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 3))  # 42 + 24 = 66 elements


def _flat(params):
    return torch.cat([p.detach().reshape(-1) for p in params])


def _run():
    import torch.distributed as dist

    from shardspeed.comm.collectives import Collectives, CommsLogger
    from shardspeed.mesh.topology import Topology
    from shardspeed.zero.unit import FlatParamUnit, ShardedParamUnit

    rank, world = dist.get_rank(), dist.get_world_size()
    comm = Collectives(Topology.data_parallel(), CommsLogger())
    out = {"rank": rank, "world": world}

    # ---- FlatParamUnit ---------------------------------------------------------------------------------
    model = _model()
    params = list(model.parameters())
    before = [p.detach().clone() for p in params]
    unit = FlatParamUnit(params, world=world, rank=rank, index=0)
    full = unit.full
    lo, hi = unit.layout.chunk_range(rank)
    out["flat"] = {
        "same_objects": all(a is b for a, b in zip(unit.params, params)),
        "values_kept": all(torch.equal(p, b) for p, b in zip(params, before)),
        "views_of_full": all(p.untyped_storage().data_ptr() == full.untyped_storage().data_ptr() for p in params),
        "offsets_ok": all(p.data_ptr() == full[off:].data_ptr() for p, off in zip(params, unit.layout.offsets)),
        "param_view_ok": all(torch.equal(unit.param_view(full, i), p.detach().reshape(-1))
                             for i, p in enumerate(params)),
        "shard_is_chunk": unit.shard.data_ptr() == full[lo:].data_ptr() and unit.shard.numel() == hi - lo,
        "shard_values": unit.shard.clone(),
        "full": full.clone(),
        "padded": unit.layout.padded_numel,
        "numel": unit.numel,
        "state": unit.state.value,
        "requires_grad": [p.requires_grad for p in params],
    }
    full[0] = 123.0  # writes through the buffer show in the parameter
    out["flat"]["write_through"] = float(params[0].detach().reshape(-1)[0]) == 123.0

    # ---- ShardedParamUnit: states, exact gather, idempotence -------------------------------------------
    model = _model()
    ref = copy.deepcopy(model)
    params = list(model.parameters())
    shapes = [p.shape for p in params]
    unit = ShardedParamUnit(params, world=world, rank=rank, index=0)
    s = out["sharded"] = {}
    s["initial_state"] = unit.state.value
    s["initial_full_none"] = unit.full is None
    s["initial_placeholders"] = [p.data.numel() for p in params]
    s["shard"] = unit.shard.clone()
    s["expected_full"] = torch.cat([_flat(ref.parameters()), torch.zeros(unit.layout.padding)])
    comm.log.reset()
    unit.gather(comm)
    s["gathered_state"] = unit.state.value
    s["gathered_exact"] = all(torch.equal(p, r) for p, r in zip(params, ref.parameters()))
    s["gathered_shapes"] = [tuple(p.shape) for p in params] == [tuple(x) for x in shapes]
    unit.gather(comm)  # idempotent: no second all-gather
    s["gathers_after_two"] = int(comm.log.summary()["all_gather"]["count"])
    kept = params[0].data  # a view of the gathered storage (what autograd would save)
    kept_full = unit.full
    s["kept_bytes_gathered"] = kept.untyped_storage().nbytes()
    unit.release()
    s["released_state"] = unit.state.value
    s["released_full_none"] = unit.full is None
    s["released_placeholders"] = [p.data.numel() for p in params]
    # private-ish but the point of the design: the kept views' storage is truly freed (0 bytes)
    s["kept_bytes_released"] = kept.untyped_storage().nbytes()
    s["kept_full_bytes_released"] = kept_full.untyped_storage().nbytes()
    unit.release()  # idempotent
    s["released_twice_state"] = unit.state.value
    unit.gather(comm)
    s["regathered_exact"] = all(torch.equal(p, r) for p, r in zip(params, ref.parameters()))
    s["kept_refilled"] = torch.equal(kept, ref[0].weight.detach())  # the same storage, filled again
    s["gathers_total"] = int(comm.log.summary()["all_gather"]["count"])
    unit.release()

    # ---- the key property: release between forward and backward ---------------------------------------
    g = torch.Generator().manual_seed(7 + rank)
    x, y = torch.randn(4, 5, generator=g), torch.randn(4, 3, generator=g)
    ((ref(x) - y) ** 2).mean().backward()
    unit.gather(comm)
    loss = ((model(x) - y) ** 2).mean()
    saved = model[0].weight.data  # a view of the gathered buffer, as autograd's saved tensors are
    unit.release()
    k = out["key"] = {}
    k["saved_bytes_after_release"] = saved.untyped_storage().nbytes()
    k["state_after_release"] = unit.state.value
    unit.gather(comm)
    loss.backward()
    unit.release()
    k["grads"] = [p.grad.clone() for p in params]
    k["ref_grads"] = [p.grad.clone() for p in ref.parameters()]
    k["loss_equal"] = torch.equal(loss.detach(), ((ref(x) - y) ** 2).mean().detach())
    return out


world1, world2, ranks = one_and_two_rank_fixtures(_run)  # fixtures: a 1-rank run, a 2-rank run, each of them


def test_flat_unit_params_are_views_of_full_with_their_values(ranks):
    for r in ranks:
        f = r["flat"]
        assert f["same_objects"] and f["values_kept"]
        assert f["views_of_full"] and f["offsets_ok"]
        assert f["param_view_ok"]
        assert f["write_through"]
        assert f["state"] == "gathered"
        assert f["requires_grad"] == [True] * 4


def test_flat_unit_layout_and_padding(ranks):
    for r in ranks:
        f, world = r["flat"], r["world"]
        assert f["numel"] == 66
        assert f["padded"] % world == 0 and 66 <= f["padded"] < 66 + world
        assert torch.count_nonzero(f["full"][66:]) == 0  # padding is zero
        torch.testing.assert_close(f["full"][:66], _flat(_model().parameters()), rtol=0, atol=0)


def test_flat_unit_shard_is_this_ranks_chunk(ranks):
    for r in ranks:
        f, world, rank = r["flat"], r["world"], r["rank"]
        assert f["shard_is_chunk"]
        chunk = f["padded"] // world
        assert torch.equal(f["shard_values"], f["full"][rank * chunk:(rank + 1) * chunk])


def test_flat_unit_shards_of_ranks_concatenate_to_full(world2):
    a, b = world2[0]["flat"], world2[1]["flat"]
    assert torch.equal(torch.cat([a["shard_values"], b["shard_values"]]), a["full"])


def test_sharded_unit_starts_sharded_with_placeholders(ranks):
    for r in ranks:
        s = r["sharded"]
        assert s["initial_state"] == "sharded"
        assert s["initial_full_none"]
        assert s["initial_placeholders"] == [0, 0, 0, 0]
        n = s["expected_full"].numel() // r["world"]
        assert torch.equal(s["shard"], s["expected_full"][r["rank"] * n:(r["rank"] + 1) * n])


def test_sharded_unit_gather_restores_exact_values(ranks):
    for r in ranks:
        s = r["sharded"]
        assert s["gathered_state"] == "gathered"
        assert s["gathered_exact"] and s["gathered_shapes"]
        assert s["regathered_exact"]


def test_gather_and_release_are_idempotent(ranks):
    for r in ranks:
        s = r["sharded"]
        assert s["gathers_after_two"] == 1, "a second gather of a gathered unit all-gathered again"
        assert s["released_twice_state"] == "sharded"
        assert s["gathers_total"] == 2


def test_release_frees_gathered_storage(ranks):
    for r in ranks:
        s = r["sharded"]
        assert s["released_state"] == "sharded" and s["released_full_none"]
        assert s["released_placeholders"] == [0, 0, 0, 0]
        assert s["kept_bytes_gathered"] == s["expected_full"].numel() * 4
        assert s["kept_bytes_released"] == 0
        assert s["kept_full_bytes_released"] == 0
        assert s["kept_refilled"], "the next gather refills the same storage"


def test_release_between_forward_and_backward_gives_the_same_gradients(ranks):
    for r in ranks:
        k = r["key"]
        assert k["saved_bytes_after_release"] == 0, "autograd's saved views still hold the gathered bytes"
        assert k["state_after_release"] == "sharded"
        assert k["loss_equal"]
        for g, e in zip(k["grads"], k["ref_grads"]):
            assert torch.equal(g, e)
