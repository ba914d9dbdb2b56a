"""Shard placements (device, host, file) alone, with no process group, and a 1-rank stage-3 unit gathered and
released under each."""
import os

import pytest
import torch
from distributed import run_distributed

from shardspeed.offload.param_file import FilePlacement, NvmeParamFile
from shardspeed.zero.placement import DevicePlacement, HostPlacement
from shardspeed.zero.unit import FlatParamUnit, ShardedParamUnit

CPU = torch.device("cpu")


def _placement(kind: str, tmp_path):
    if kind == "device":
        return DevicePlacement()
    if kind == "host":
        return HostPlacement(pin_memory=True)  # pinned only where CUDA exists
    return FilePlacement(NvmeParamFile(str(tmp_path), rank=0))


@pytest.mark.parametrize("kind", ["device", "host", "file"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_placement_alone(kind, dtype, tmp_path):
    shard = torch.randn(3001).to(dtype)
    p = _placement(kind, tmp_path)
    p.hold(shard, CPU)
    assert p.where == kind and p.on_device == (kind == "device") and p.in_file == (kind == "file")
    got = p.read()
    assert got.dtype == dtype and got.device == CPU and torch.equal(got, shard)
    # storage: the device placement keeps the tensor it was given; host copies it; the file keeps nothing
    assert p.aliases(shard) == (kind == "device")
    assert p.aliases(p.read()) == (kind != "file")
    assert p.bytes_held() == (0 if kind == "file" else shard.numel() * shard.element_size())
    assert (p.resident() is None) == (kind == "file")
    if kind == "file":
        nbytes = shard.numel() * shard.element_size()
        assert os.path.getsize(p.file.path) == -(-nbytes // 4096) * 4096 == p.file.nbytes  # one aligned region
        p.read().zero_()  # a fresh copy: the file is unchanged
        assert torch.equal(p.read(), shard)
    # write: cast to the shard's dtype, at an offset
    expect = shard.clone()
    p.write(torch.arange(10, dtype=torch.float64), lo=100)
    expect[100:110] = torch.arange(10).to(dtype)
    assert torch.equal(p.read(), expect)
    # the gather source: on the device, equal to the shard; a copy unless the shard is on the device
    src = p.to_device_for_gather()
    assert src.device == CPU and torch.equal(src, expect)
    assert p.aliases(src) == (kind == "device")
    p.close()
    if kind == "file":
        assert not os.path.exists(p.file.dir)


def test_file_placements_share_one_file(tmp_path):
    pf = NvmeParamFile(str(tmp_path), rank=3)
    a, b = FilePlacement(pf), FilePlacement(pf)
    a.hold(torch.ones(5, dtype=torch.float16), CPU)
    b.hold(torch.full((2000,), 2.0), CPU)
    assert (a.offset, b.offset, pf.nbytes) == (0, 4096, 3 * 4096)
    b.write(torch.zeros(3), lo=1997)
    assert torch.equal(a.read(), torch.ones(5, dtype=torch.float16))
    assert b.read()[:1997].eq(2).all() and b.read()[1997:].eq(0).all()
    with pytest.raises(ValueError, match="outside its shard"):
        a.write(torch.ones(2), lo=4)
    pf.close()


def test_stage0_2_unit_shard_is_a_view_of_full():
    p = torch.nn.Parameter(torch.randn(10))
    u = FlatParamUnit([p], world=2, rank=1)
    assert isinstance(u.placement, DevicePlacement) and u.placement.aliases(u.full)
    assert u.placement.bytes_held() == u.shard.numel() * 4
    u.write_shard(torch.zeros(5))
    assert p.detach()[5:].eq(0).all()  # the parameter views full, which the shard views


def _gather_release(tmp_dir):
    from shardspeed.comm.collectives import Collectives, CommsLogger
    from shardspeed.mesh.topology import Topology

    comm = Collectives(Topology.data_parallel(), CommsLogger())
    out = {}
    for kind in ("device", "host", "file"):
        torch.manual_seed(0)
        params = [torch.nn.Parameter(torch.randn(7, 3)), torch.nn.Parameter(torch.randn(5))]
        orig = [p.detach().clone() for p in params]
        placement = _placement(kind, tmp_dir)
        u = ShardedParamUnit(params, world=1, rank=0, placement=placement)
        assert u.placement is placement
        r = {"sharded_empty": all(p.numel() == 0 for p in params)}
        u.gather(comm)
        r["gathered_equal"] = all(torch.equal(p.detach(), o) for p, o in zip(params, orig))
        u.release()
        r["released_empty"] = all(p.numel() == 0 for p in params)
        u.write_shard(torch.full((5,), 7.0), lo=21)  # the second parameter
        u.gather(comm)
        r["write_seen"] = bool(torch.equal(params[1].detach(), torch.full((5,), 7.0))
                               and torch.equal(params[0].detach(), orig[0]))
        u.release()
        u.gather(comm)  # gathering again re-reads the same shard
        r["regather_equal"] = bool(torch.equal(params[1].detach(), torch.full((5,), 7.0)))
        u.release()
        r["bytes"] = u.placement.bytes_held()
        u.placement.close()
        out[kind] = r
    return out


def test_unit_gathered_and_released_under_each_placement(tmp_path):
    (got,) = run_distributed(_gather_release, 1, str(tmp_path))
    for kind, r in got.items():
        assert r["sharded_empty"] and r["gathered_equal"] and r["released_empty"], (kind, r)
        assert r["write_seen"] and r["regather_equal"], (kind, r)
        assert r["bytes"] == (0 if kind == "file" else 26 * 4), (kind, r)
