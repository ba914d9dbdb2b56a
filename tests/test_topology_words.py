"""Topology: one MESH_DIMS, one word per group, composite sizes derived from the dimensions' (issue 38).

Pure: no process group (a Topology of None groups on the CPU), plus the house count of MESH_DIMS definitions.
"""
import importlib.util
from pathlib import Path

import torch

from shardspeed.mesh.topology import BASE_DIMS, MESH_DIMS, Topology, mesh_dims
from shardspeed.plan import MeshPlan

ROOT = Path(__file__).resolve().parents[1]
CPU = torch.device("cpu")


def _topology(**sizes) -> Topology:
    return Topology(shard_group=None, shard_rank=0, device=CPU, **sizes)


def test_composite_sizes_are_the_dimensions_products():
    t = _topology(data_size=2, expert_size=2, sequence_size=3, pipe_size=2, model_size=2, pipe_model_size=4)
    assert (t.shard_size, t.expert_shard_size, t.batch_world) == (12, 6, 4)  # d·e·s, d·s, d·e
    assert t.mesh_shape == (2, 12, 2) and t.dims == BASE_DIMS  # no device mesh: the base dimensions
    plain = _topology(data_size=4)
    assert (plain.shard_size, plain.expert_shard_size, plain.batch_world) == (4, 4, 4)


def test_group_words_in_messages():
    # the world (None) is the shard group; it is "data" while it is the data dimension alone
    assert _topology(data_size=2).dim_of(None) == "data"
    assert _topology(data_size=2, sequence_size=2).dim_of(None) == "shard"
    assert _topology(data_size=2, expert_size=2).dim_of(None) == "shard"
    assert _topology(data_size=2).dim_of(object()) is None


def test_one_mesh_dims_and_the_plan_uses_it():
    from shardspeed.plan import MESH_DIMS as plan_dims

    assert plan_dims is MESH_DIMS == ("pipe", "data", "expert", "sequence", "model")
    assert mesh_dims({}) == BASE_DIMS == ("pipe", "data", "model")
    assert mesh_dims({"sequence": 2}) == ("pipe", "data", "sequence", "model")
    assert mesh_dims({"expert": 1}, ("expert",)) == ("pipe", "data", "expert", "model")
    plan = MeshPlan(data=2, expert=2, sequence=2)
    assert plan.dims == mesh_dims(plan.sizes) == MESH_DIMS


def test_house_counts_mesh_dims_definitions(tmp_path, monkeypatch):
    spec = importlib.util.spec_from_file_location("house_counts", ROOT / "tools" / "house_counts.py")
    house = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(house)
    assert house.mesh_dims_definitions() == []  # the code base: one definition
    pkg = tmp_path / "shardspeed"
    (pkg / "plan").mkdir(parents=True)
    (pkg / "mesh.py").write_text('MESH_DIMS = ("pipe", "data")\n\ndef f():\n    MESH_DIMS = 1\n')
    (pkg / "plan" / "types.py").write_text('from typing import Tuple\nMESH_DIMS: Tuple[str, ...] = ("data",)\n')
    monkeypatch.setattr(house, "ROOT", tmp_path)
    monkeypatch.setattr(house, "PKG", pkg)
    assert house.mesh_dims_definitions() == ["shardspeed/plan/types.py:2"]  # a second one; a local is not
