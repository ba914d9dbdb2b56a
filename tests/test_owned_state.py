"""Owned state (issue 22): the parameter tags go through shardspeed.zero.tags; the process-wide state of
DeepSpeed's module-level APIs is the current engine's (``shardspeed.mesh.current.CURRENT``: its topology,
its activation checkpointing, the meshes the engines alive share); two engines with different meshes live
in one process and each trains as it does alone.
"""
from __future__ import annotations

import pytest
import torch
from distributed import run_distributed
from tp_models import lm_loss, make_tp_model, tp_batches, tp_config, tp_reference

from shardspeed.errors import ShardspeedError

#: the two engines of one process at world 4: pure data parallelism (data 4), and data 2 × model 2
#: (tensor_parallel.autotp_size 2); both ZeRO stage 3, so two roots hold units side by side
ENGINES = {"dp": 1, "tp": 2}


# ---- no process group -----------------------------------------------------------------------------
def test_tags_set_read_clear():
    from shardspeed.zero import tags

    p = torch.nn.Parameter(torch.zeros(3))
    assert tags.init_shard_of(p) is None and not tags.in_stage3_unit(p) and not tags.is_sharded(p)
    from types import SimpleNamespace
    info = SimpleNamespace(shape=(3,))
    tags.tag_init_shard(p, info)  # type: ignore[arg-type]
    assert tags.init_shard_of(p) is info and p._shardspeed_init is info and tags.is_sharded(p)  # the name stays
    assert (p.ds_shape, p.ds_numel, p.ds_status) == (torch.Size([3]), 3, tags.ZeroParamStatus.NOT_AVAILABLE)
    tags.clear_init_shard(p)
    tags.clear_init_shard(p)  # nothing left: a no-op
    assert not hasattr(p, "_shardspeed_init") and not tags.is_sharded(p)
    tags.mark_stage3([p], tags.ZeroParamStatus.NOT_AVAILABLE)  # a unit took it: DeepSpeed's attributes only
    assert tags.in_stage3_unit(p) and tags.is_sharded(p) and p.ds_active_sub_modules == set()
    assert not any(k.startswith("_shardspeed") for k in vars(p))  # nothing on the tensor points at its unit
    from shardspeed.zero.init import init_shard_of

    assert init_shard_of is tags.init_shard_of  # zero.init's name for it is the same function


def test_current_topology_is_the_current_engines():
    import shardspeed.utils.groups as groups
    from shardspeed.mesh.current import CURRENT, EngineScope
    from shardspeed.mesh.topology import Topology

    a = Topology(shard_group=None, shard_rank=0, device=torch.device("cpu"))
    b = Topology(shard_group=None, shard_rank=1, device=torch.device("cpu"), data_size=2)
    with CURRENT.using(EngineScope(None)):  # as with no engine alive
        with pytest.raises(ShardspeedError, match="no engine yet"):
            groups.get_data_parallel_rank()
        with CURRENT.using(EngineScope(a)):
            assert groups.current_topology() is a and groups.get_data_parallel_world_size() == 1
            with groups.using(b):
                assert groups.get_data_parallel_rank() == 1 and CURRENT.scope().topology is b
            assert groups.current_topology() is a


def test_checkpointing_state_is_one_object():
    import shardspeed.checkpointing as ck

    assert ck.get_cuda_rng_tracker() is ck.current().tracker
    before = (ck.settings(), ck.is_configured())
    own = ck.ActivationCheckpointing()
    own.configure(None, num_checkpoints=3, partition_activations=True)
    assert own.configured and own.settings.number_checkpoints == 3 and own.settings.partition_activations
    assert (ck.settings(), ck.is_configured()) == before  # the current configuration is untouched
    with torch.random.fork_rng(devices=[]):  # seeding reseeds the default generator too
        own.seed(7)
    assert "model-parallel-rng" in own.tracker.get_states()
    assert own.tracker is not ck.get_cuda_rng_tracker()
    nxt = own.successor()  # a later engine's: the same tracker, the settings and group carried over
    assert nxt.tracker is own.tracker and nxt.settings == own.settings and nxt.configured


# ---- world 4: two engines with different meshes in one process --------------------------------------
def _build(name: str):
    import shardspeed

    engine, *_ = shardspeed.initialize(model=make_tp_model("gpt"), config=tp_config(ENGINES[name], 3))
    return engine


def _step(engine, x, y) -> float:
    """One step of the global batch ``(x, y)``, each data rank its part; the global mean loss."""
    import torch.distributed as dist

    dp, r = engine.dp_world_size, engine.mpu.get_data_parallel_rank()
    n = x.shape[0] // dp
    loss = lm_loss("gpt", engine, x[r * n:(r + 1) * n], y[r * n:(r + 1) * n])
    engine.backward(loss)
    engine.step()
    total = loss.detach().float().clone()
    dist.all_reduce(total)  # the tensor-parallel ranks hold equal losses: the world mean is the data mean
    return float(total) / dist.get_world_size()


def _alone(name: str):
    engine = _build(name)
    return [_step(engine, x, y) for x, y in tp_batches()]


def _together():
    import shardspeed.utils.groups as groups
    from shardspeed.mesh.topology import Topology, TopologyRegistry
    from shardspeed.zero.live_roots import unit_of

    engines = {name: _build(name) for name in ENGINES}  # both built before either trains
    losses: dict = {name: [] for name in engines}
    for x, y in tp_batches():  # interleaved: a step of one, then a step of the other
        for name, engine in engines.items():
            losses[name].append(_step(engine, x, y))
    dp, tp = engines["dp"], engines["tp"]
    out = {"losses": losses, "shapes": {n: e.mpu.topology.mesh_shape for n, e in engines.items()},
           "dp_sizes": {n: e.dp_world_size for n, e in engines.items()}}
    # each engine's parameters are tagged with its own manager
    out["own_manager"] = all(unit_of(p)[1] is e.param_manager
                             for e in engines.values() for p in e.module.parameters())
    # DeepSpeed's module-level groups answer for the latest engine, or the one selected
    out["groups_latest"] = groups.get_data_parallel_world_size(), groups.get_tensor_model_parallel_world_size()
    with groups.using(dp.mpu.topology):
        out["groups_using_dp"] = groups.get_data_parallel_world_size(), groups.get_tensor_model_parallel_world_size()
    out["groups_after"] = groups.get_data_parallel_world_size()
    # the same mesh again: the same Topology (no new groups); a registry of one's own builds its own
    out["mesh_reused"] = Topology.from_mesh(pipe=1, model=2) is tp.mpu.topology
    own = Topology.from_mesh(pipe=1, model=2, registry=TopologyRegistry())
    out["own_registry"] = own is not tp.mpu.topology and own.mesh_shape == (1, 2, 2)
    return out


@pytest.fixture(scope="module")
def runs():
    together = run_distributed(_together, 4, timeout=300)
    alone = {name: run_distributed(_alone, 4, name, timeout=300) for name in ENGINES}
    return together, alone


def test_two_engines_with_different_meshes_in_one_process(runs):
    together, alone = runs
    ref = tp_reference("gpt")["losses"]
    for r, res in enumerate(together):
        assert res["shapes"] == {"dp": (1, 4, 1), "tp": (1, 2, 2)} and res["dp_sizes"] == {"dp": 4, "tp": 2}
        for name in ENGINES:
            # exactly the losses of the engine trained alone in its own process, and the reference's
            assert res["losses"][name] == alone[name][r], (r, name, res["losses"][name], alone[name][r])
            torch.testing.assert_close(torch.tensor(res["losses"][name]), torch.tensor(ref), rtol=1e-5, atol=0,
                                       msg=lambda m, r=r, name=name: f"rank {r} engine {name}: {m}")
        assert res["own_manager"]
        assert res["groups_latest"] == (2, 2) and res["groups_using_dp"] == (4, 1) and res["groups_after"] == 2
        assert res["mesh_reused"] and res["own_registry"]
