"""Offload pieces without a process group: tiles, the NVMe store (bounded pool, streaming, errors), the
host Adam kernel against torch's AdamW."""
from __future__ import annotations

import os

import pytest
import torch

from shardspeed.errors import ConfigError
from shardspeed.offload import CPUAdam, NvmeStateStore, adam_step, check_nvme_path
from shardspeed.offload.cpu_adam import AdamHyper
from shardspeed.offload.tiles import plan_tiles, runs_of, split_by_ratio


# ---- tiles ---------------------------------------------------------------------------------------
def test_runs_merge_contiguous_pieces_of_one_group():
    assert runs_of([(0, 5, 0), (5, 3, 0), (8, 2, 1), (10, 4, 0)]) == [(0, 8, 0), (8, 10, 1), (10, 14, 0)]
    assert runs_of([(4, 0, 0)]) == []


def test_tiles_cover_pieces_within_size_and_offsets_are_dense():
    pieces = [[(0, 10, 0), (10, 5, 1)], [(0, 7, 0)]]  # unit 0 has padding after 15
    tiles = plan_tiles(pieces, 4, [0, 1])
    assert [(t.unit, t.lo, t.hi, t.group) for t in tiles] == [
        (0, 0, 4, 0), (0, 4, 8, 0), (0, 8, 10, 0), (0, 10, 14, 1), (0, 14, 15, 1),
        (1, 0, 4, 0), (1, 4, 7, 0)]
    assert [t.offset for t in tiles] == [0, 4, 8, 10, 14, 15, 19]
    assert [t.index for t in tiles] == list(range(7))


def test_ratio_keeps_the_tail_units_on_device():
    assert split_by_ratio([10, 10, 10, 10], 1.0) == ([0, 1, 2, 3], [])
    assert split_by_ratio([10, 10, 10, 10], 0.5) == ([0, 1], [2, 3])
    assert split_by_ratio([10, 10, 10, 10], 0.0) == ([], [0, 1, 2, 3])


# ---- NVMe store --------------------------------------------------------------------------------------
def _tiles(n_tiles: int, size: int):
    return plan_tiles([[(0, n_tiles * size, 0)]], size, [0])


def test_nvme_store_streams_many_tiles_through_a_small_pool(tmp_path):
    tiles = _tiles(20, 1000)
    store = NvmeStateStore(str(tmp_path), tiles, buffer_count=3, pin_memory=True, rank=0)
    assert store.buffer_bytes == 3 * 3 * 1024 * 4  # buffer_count × (master, m, v) × tile × fp32, whole 4 KiB rows
    for t in tiles:
        store.initialize(t, torch.full((t.numel,), float(t.index)))
    for step in range(3):  # each step: read, modify, write back; the next step sees the writes
        seen = []
        for t, st in store.stream(tiles):
            assert torch.all(st.master == t.index + step) and torch.all(st.exp_avg == step)
            st.master.add_(1)
            st.exp_avg.add_(1)
            seen.append(t.index)
            store.release(t, st)
        store.flush()
        assert seen == list(range(20))
    assert torch.all(store.read_tile(tiles[7]).master == 10)
    d = store.dir
    assert sorted(os.listdir(d)) == ["exp_avg.f32", "exp_avg_sq.f32", "master.f32", "owner.lock"]
    assert os.path.getsize(os.path.join(d, "master.f32")) == 20 * 1024 * 4  # each tile's region: whole 4 KiB blocks
    store.close()
    assert not os.path.exists(d)


def test_nvme_store_recovers_buffers_when_the_consumer_stops_early(tmp_path):
    tiles = _tiles(10, 100)
    store = NvmeStateStore(str(tmp_path), tiles, buffer_count=2, pin_memory=False, rank=0)
    for t in tiles:
        store.initialize(t, torch.zeros(t.numel))
    with pytest.raises(RuntimeError):
        for t, st in store.stream(tiles):
            if t.index == 3:
                raise RuntimeError("step failed")
            store.release(t, st)
    store.abandon()
    store.flush()
    assert store._free.qsize() == 2  # the pool is whole again
    assert len([1 for _ in store.stream(tiles[:1])]) == 1
    store.close()


def test_nvme_path_errors_are_clear(tmp_path, monkeypatch):
    f = tmp_path / "afile"
    f.write_text("x")
    with pytest.raises(ConfigError, match="not a directory|cannot be created"):
        check_nvme_path(str(f), 10)
    if os.getuid() != 0:  # root may write anywhere
        ro = tmp_path / "ro"
        ro.mkdir(mode=0o500)
        with pytest.raises(ConfigError, match="not writable"):
            check_nvme_path(str(ro), 10)
    import shutil
    from collections import namedtuple

    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda p: usage(100, 90, 10))
    with pytest.raises(ConfigError, match="GiB free"):
        NvmeStateStore(str(tmp_path), _tiles(2, 100), buffer_count=2, pin_memory=False, rank=0)
    with pytest.raises(ConfigError, match="buffer_count"):
        NvmeStateStore(str(tmp_path), _tiles(2, 100), buffer_count=0, pin_memory=False, rank=0)
    # offload_param nvme: the same checks, naming the parameter shards (made as each unit reserves its region)
    from shardspeed.offload.param_file import FilePlacement, NvmeParamFile
    from shardspeed.zero.unit import ShardedParamUnit

    pf = NvmeParamFile(str(tmp_path), rank=0)
    with pytest.raises(ConfigError, match="GiB free; this rank needs .* for the parameter shards"):
        ShardedParamUnit([torch.nn.Parameter(torch.randn(3000))], world=2, rank=0, placement=FilePlacement(pf))
    pf.close()
    monkeypatch.undo()
    with pytest.raises(ConfigError, match="not a directory|cannot be created"):
        NvmeParamFile(str(f), rank=0)


def test_param_file_holds_the_shard(tmp_path):
    """offload_param nvme: the shard lives only in the file; reads are copies, write_shard stores."""
    from shardspeed.offload.param_file import FilePlacement, NvmeParamFile
    from shardspeed.zero.unit import ShardedParamUnit

    params = [torch.nn.Parameter(torch.randn(n, dtype=torch.bfloat16)) for n in (5, 3001)]
    before = [ShardedParamUnit([torch.nn.Parameter(p.detach().clone())], world=2, rank=1).shard for p in params]
    pf = NvmeParamFile(str(tmp_path), rank=1)
    units = [ShardedParamUnit([p], world=2, rank=1, index=i, placement=FilePlacement(pf))
             for i, p in enumerate(params)]
    assert os.path.getsize(pf.path) == 2 * 4096 and [u.placement.offset for u in units] == [0, 4096]
    for u, b in zip(units, before):
        assert u.placement.resident() is None and not u.placement.on_device and torch.equal(u.shard, b)
        u.shard.zero_()  # a copy: the file is unchanged
        assert torch.equal(u.shard, b)
    units[1].write_shard(torch.ones(10), lo=7)
    b = before[1].clone()
    b[7:17] = 1
    assert torch.equal(units[1].shard, b) and torch.equal(units[0].shard, before[0])
    assert torch.equal(units[1].shard_on_device(), b)
    with pytest.raises(ValueError, match="outside its shard"):
        units[0].write_shard(torch.ones(4), lo=1)
    units[0].placement.close()  # the file is shared: closing deletes it for every unit
    assert not os.path.exists(pf.dir)


def test_param_file_read_ahead_gives_the_bytes_as_of_the_gather(tmp_path):
    """A read started ahead (in the background) is what the next gather gets; a write in between replaces
    it; a corrupt region fails at the gather that uses the read-ahead, with the same error as a plain read."""
    from shardspeed.offload.param_file import FilePlacement, NvmeParamFile
    from shardspeed.zero.unit import ShardedParamUnit

    pf = NvmeParamFile(str(tmp_path), rank=0)
    p = torch.nn.Parameter(torch.randn(6000))
    want = p.detach()[:3000].clone()
    u = ShardedParamUnit([p], world=2, rank=0, placement=FilePlacement(pf))
    u.placement.read_ahead()
    assert torch.equal(u.shard_on_device(), want)
    u.placement.read_ahead()
    u.write_shard(torch.ones(5), lo=2)  # queued behind the read in flight, which is dropped
    want[2:7] = 1
    assert torch.equal(u.shard_on_device(), want) and torch.equal(u.shard, want)
    with open(pf.path, "r+b") as f:  # a byte flip on disk
        f.seek(100)
        byte = f.read(1)
        f.seek(100)
        f.write(bytes([byte[0] ^ 0x10]))
    u.placement.read_ahead()
    with pytest.raises(Exception, match="NVMe swap corrupted"):
        u.shard_on_device()
    pf.close()


# ---- the kernel ------------------------------------------------------------------------------------
@pytest.mark.parametrize("decoupled", [True, False])
@pytest.mark.parametrize("threads", [1, 3])
def test_adam_step_equals_torch_adamw(decoupled, threads):
    torch.manual_seed(0)
    n = (1 << 20) + 17  # big enough for the threaded split, odd for the vector tail
    p = torch.randn(n)
    ref = torch.nn.Parameter(p.clone())
    cls = torch.optim.AdamW if decoupled else torch.optim.Adam
    opt = cls([ref], lr=1e-2, betas=(0.8, 0.99), eps=1e-6, weight_decay=0.1, fused=True)
    m, v, step = torch.zeros(n), torch.zeros(n), torch.zeros(())
    h = AdamHyper(1e-2, 0.8, 0.99, 1e-6, 0.1, decoupled)
    for _ in range(3):
        g = torch.randn(n)
        ref.grad = g.clone()
        opt.step()
        step += 1
        adam_step(p, g, m, v, step, h, threads=threads)
    assert torch.equal(p, ref.detach())


def test_cpu_adam_is_a_drop_in_optimizer():
    torch.manual_seed(0)
    a = torch.nn.Parameter(torch.randn(100, 10))
    b = torch.nn.Parameter(a.detach().clone())
    oa = CPUAdam([a], lr=1e-2, weight_decay=0.01)
    ob = torch.optim.AdamW([b], lr=1e-2, weight_decay=0.01, fused=True)
    for _ in range(3):
        g = torch.randn(100, 10)
        a.grad, b.grad = g.clone(), g.clone()
        oa.step()
        ob.step()
    assert torch.equal(a, b)
    with pytest.raises(ConfigError):
        CPUAdam([a], amsgrad=True)


@pytest.mark.parametrize("decoupled", [True, False])
def test_bf16_master_with_fp32_moments_steps_in_fp32_and_rounds_once(monkeypatch, decoupled):
    """A bf16 master tile with fp32 moments (DeepSpeedCPUAdam's default beside bf16 masters): each step reads the
    master and gradient up to fp32, steps there and rounds the master once; in chunks (here 1000 elements, so a
    tile of 2500 takes three) exactly as in one piece, and the moments stay fp32."""
    from shardspeed.offload import cpu_adam

    monkeypatch.setattr(cpu_adam, "MIXED_CHUNK", 1000)
    gen = torch.Generator().manual_seed(11)
    n = 2500
    p = torch.randn(n, generator=gen).bfloat16()
    start = p.clone()
    m, v = torch.zeros(n), torch.zeros(n)
    ref_p, ref_m, ref_v = p.clone(), m.clone(), v.clone()
    h = AdamHyper(lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.1, decoupled=decoupled)
    fused = torch._fused_adamw_ if decoupled else torch._fused_adam_
    for k in range(1, 4):
        g = torch.randn(n, generator=gen).bfloat16()
        adam_step(p, g, m, v, torch.tensor(float(k)), h)
        p32 = ref_p.float()
        fused([p32], [g.float()], [ref_m], [ref_v], [], [torch.tensor(float(k))], lr=h.lr, beta1=h.beta1,
              beta2=h.beta2, weight_decay=h.weight_decay, eps=h.eps, amsgrad=False, maximize=False)
        ref_p = p32.bfloat16()
        assert p.dtype == torch.bfloat16 and m.dtype == v.dtype == torch.float32
        assert torch.equal(p, ref_p) and torch.equal(m, ref_m) and torch.equal(v, ref_v)
    assert (p != start).float().mean() > 0.5  # three steps of lr 1e-2 move most bf16 elements
