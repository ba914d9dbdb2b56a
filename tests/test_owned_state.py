"""Owned state (issue 22): the parameter tags go through shardspeed.zero.tags; the process-wide state of
DeepSpeed's module-level APIs is the current engine's (``shardspeed.mesh.current.CURRENT``: its topology,
its activation checkpointing, the meshes the engines alive share). Two engines with different meshes in one
process, each training as it does alone: tests/test_two_engines.py.
"""
from __future__ import annotations

import pytest
import torch

from shardspeed.errors import ShardspeedError


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
    q = torch.nn.Parameter(torch.zeros(2, 3))
    tags.mark_stage3([q], [q.shape], tags.ZeroParamStatus.NOT_AVAILABLE)  # a unit took it: DeepSpeed's attributes
    assert tags.in_stage3_unit(q) and tags.is_sharded(q) and q.ds_active_sub_modules == set()
    assert (q.ds_shape, q.ds_numel, q.ds_id) == (torch.Size([2, 3]), 6, id(q))
    q.data = torch.empty(0)  # a placeholder: DeepSpeed's attributes keep the whole shape
    assert q.ds_shape == torch.Size([2, 3])
    assert not any(k.startswith("_shardspeed") for k in vars(q))  # nothing on the tensor points at its unit
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
