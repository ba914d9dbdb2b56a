"""NVMe swap faults (issue 27): corrupted swap data is refused at the next read, and dead attempts' swap
folders are removed by the next engine of the same job.

- Store level (no process group): a byte flip, a NaN fill, a finite overwrite and a truncation of one
  tile of an optimizer state file, and of a region of the stage-3 parameter file, each raise a
  ``ShardspeedError`` naming the file at the next read (the training stream, checkpoint reads, and a
  partial write that must read the block it patches); clean reads and partial writes never do.
- End to end (2 ranks, ``shardspeed.initialize``, offload_optimizer and offload_param nvme at stage 3):
  rank 1's optimizer file is overwritten with NaN between steps; rank 1 raises the corruption error at
  the next step and rank 0 fails with a ``DistributedError`` at its next collective, within the timeout.
- Swap folders: a rank killed with SIGKILL (and a folder of a dead pid) of one job are removed by the
  job's next stores, another job's folder is left alone, and one line says what was removed.
"""
from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from distributed import run_distributed
from models import make_batches, make_model, micro_batch

from shardspeed.errors import DistributedError, ShardspeedError
from shardspeed.offload.param_file import FilePlacement, NvmeParamFile
from shardspeed.offload.store import SUM_BLOCK, NvmeStateStore, block_sums, swap_job_id
from shardspeed.offload.tiles import plan_tiles

ROOT = Path(__file__).resolve().parent.parent
KINDS = ("flip", "nan", "finite", "truncate")


def _tiles():
    # unit 0: 5000 elements, unit 1: 7501 (its last tile odd: 1501); tiles of at most 3000 elements (12000
    # bytes: three 4 KiB blocks, the last one partial), so a tile spans blocks and the pool (2 buffers) is
    # smaller than the state
    return plan_tiles([[(0, 5000, 0)], [(0, 7501, 0)]], 3000, [0, 1])


def _store(root: Path, rank: int = 0, verify=None) -> NvmeStateStore:
    tiles = _tiles()
    st = NvmeStateStore(str(root), tiles, 2, False, rank, verify=verify)
    g = torch.Generator().manual_seed(rank)
    for t in tiles:
        st.initialize(t, torch.randn(t.numel, generator=g))
    for t, s in st.stream(tiles):  # one step's worth of writes: moments no longer zero
        s.master.mul_(0.5)
        s.exp_avg.copy_(s.master * 0.1)
        s.exp_avg_sq.copy_(s.master.square())
        st.release(t, s)
    st.flush()
    return st


def _corrupt(path: str, at: int, kind: str) -> None:
    """Change the file at byte ``at`` (4-byte aligned) the way a fault would."""
    if kind == "truncate":
        os.truncate(path, at)
        return
    with open(path, "r+b") as f:
        f.seek(at)
        old = bytearray(f.read(256))
        if kind == "flip":
            new = bytes([old[0] ^ 0x10]) + bytes(old[1:])
        elif kind == "nan":
            new = torch.full((64,), float("nan")).numpy().tobytes()
        else:  # finite: plausible values, 0.1% off
            vals = torch.frombuffer(old, dtype=torch.float32)
            new = (vals * 1.001 + 1e-3).numpy().tobytes()
            assert torch.isfinite(vals * 1.001 + 1e-3).all()
        f.seek(at)
        f.write(new)


def _expect(kind: str, path: str) -> str:
    """The error a read of corrupted data gives: a checksum mismatch, or a short read at the cut."""
    if kind == "truncate":
        return f"short read at byte .* of {path}"
    return f"NVMe swap corrupted: {path}, .*checksum expected 0x[0-9a-f]{{16}}, found 0x[0-9a-f]{{16}}"


@pytest.mark.parametrize("name", ["master", "exp_avg_sq"])
@pytest.mark.parametrize("kind", KINDS)
def test_corrupted_optimizer_tile_is_refused_at_the_next_read(tmp_path, kind, name):
    st = _store(tmp_path / "nvme")
    tiles = st.tiles
    bad = tiles[3]  # unit 1's second tile
    path = os.path.join(st.dir, f"{name}.f32")
    at = st.file_offset(bad) + SUM_BLOCK + 100  # in the tile's second block
    _corrupt(path, at, kind)
    stepped = []
    with pytest.raises(ShardspeedError, match=_expect(kind, path)) as e:
        for t, s in st.stream(tiles):
            stepped.append(t.index)
            st.release(t, s)
    st.flush()
    st.abandon()
    assert stepped == [0, 1, 2], "the tiles before the bad one step; the bad one is never handed out"
    if kind != "truncate":
        msg = str(e.value)
        assert f"tile {bad.index} ({name} of elements [{bad.lo}, {bad.hi}) of unit {bad.unit}" in msg, msg
        first = st.file_offset(bad) + SUM_BLOCK
        assert f"bytes [{first}, {first + SUM_BLOCK})" in msg, msg
        assert "Restart from the last checkpoint" in msg
    # the checkpoint reads see it too: the whole tile, and a range whose block holds the bad byte
    with pytest.raises(ShardspeedError, match=_expect(kind, path)):
        st.read_tile(bad)
    lo = bad.lo + (SUM_BLOCK + 200) // 4
    with pytest.raises(ShardspeedError, match=_expect(kind, path)):
        st.read_state(bad, name, lo, lo + 10)
    if kind != "truncate":  # a range in another block of the same tile is still good
        assert st.read_state(bad, name, bad.lo, bad.lo + 100).shape == (100,)
    st.close()
    assert not os.path.exists(st.dir)


def test_clean_reads_and_writes_never_trip_the_check(tmp_path):
    st = _store(tmp_path / "nvme")
    tiles = st.tiles
    ref = {t.index: st.read_tile(t) for t in tiles}
    g = torch.Generator().manual_seed(5)
    for t in tiles[::2]:  # checkpoint load and GatheredParameters: whole-tile and master-only writes
        new = [torch.randn(t.numel, generator=g) for _ in range(3)]
        st.write_tile(t, type(ref[t.index])(*new))
        ref[t.index] = type(ref[t.index])(*new)
    st.write_master(tiles[1], torch.full((tiles[1].numel,), 2.0))
    ref[1] = ref[1]._replace(master=torch.full((tiles[1].numel,), 2.0))
    for _ in range(2):
        for t, s in st.stream(tiles):
            assert torch.equal(s.master, ref[t.index].master) and torch.equal(s.exp_avg_sq, ref[t.index].exp_avg_sq)
            st.release(t, s)
        st.flush()
    for t in tiles:  # ranges at every alignment, across block edges (element 1024 starts a tile's 2nd block)
        assert t.numel > 1025
        for lo, hi in ((t.lo, t.hi), (t.lo + 1, t.lo + 2), (t.lo + 1023, t.lo + 1025), (t.hi - 3, t.hi),
                       (t.lo, t.lo)):
            got = st.read_state(t, "exp_avg", lo, hi)
            assert torch.equal(got, ref[t.index].exp_avg[lo - t.lo : hi - t.lo])
            assert got.untyped_storage().nbytes() == (hi - lo) * 4, "a copy of the range, not of its blocks"
    st.close()


def test_verify_off_reads_corruption_unchecked(tmp_path):
    """The benchmark's switch: without verification the same corruption goes through (as before)."""
    st = _store(tmp_path / "nvme", verify=False)
    _corrupt(os.path.join(st.dir, "master.f32"), 400, "nan")
    assert torch.isnan(st.read_tile(st.tiles[0]).master).any()
    st.close()


def test_block_sums_do_not_depend_on_alignment():
    x = torch.randn(10_001)
    b = x.view(torch.uint8)
    ref = block_sums(b[4:].clone())
    assert torch.equal(block_sums(b[4:]), ref)  # a view at a 4-byte offset: same sums
    assert ref.numel() == -(-(40_000) // SUM_BLOCK)
    y = x.clone()
    y.view(torch.uint8)[4 + 5000] ^= 1
    assert not torch.equal(block_sums(y.view(torch.uint8)[4:]), ref)


def test_checksums_computed_during_io_equal_block_sums(tmp_path):
    """Summed chunk by chunk as the bytes pass (several chunks, a partial last block, an unaligned buffer),
    through O_DIRECT, the bounce buffer or the page cache: the same sums as one pass over the data."""
    from shardspeed.offload.store import _IO_CHUNK, SwapFile
    from shardspeed.utils.direct_io import aligned_empty

    n = 2 * _IO_CHUNK + 3 * SUM_BLOCK
    aligned = aligned_empty(n + SUM_BLOCK)
    aligned.copy_(torch.randint(0, 256, (n + SUM_BLOCK,), dtype=torch.uint8))
    cases = [(aligned[:n], True), (aligned[: n - 100], True), (aligned[4 : n - 96], True),  # direct; padded tail
             (aligned[4 : n - 96], False)]  # unaligned, no padding allowed: the page cache
    for direct in (True, False):
        f = SwapFile(str(tmp_path / f"f{direct}"))
        if not direct:
            os.close(f.direct_fd)
            f.direct_fd = None
        assert (f.direct_fd is not None) == direct, "tmp_path's file system should take O_DIRECT"
        try:
            for data, pad in cases:
                written = f.write(data, 0, checksum=True, pad=pad)
                back = torch.zeros_like(aligned) if pad else torch.zeros_like(data)
                read = f.read(back[: data.numel()], 0, checksum=True)
                assert torch.equal(back[: data.numel()], data)
                assert torch.equal(written, block_sums(data)) and torch.equal(read, written)
        finally:
            f.close()


# ---- the stage-3 parameter file ------------------------------------------------------------------------
def _param_file(root: Path):
    pf = NvmeParamFile(str(root), 0)
    g = torch.Generator().manual_seed(1)
    shards = [torch.randn(n, generator=g).to(torch.bfloat16) for n in (10_001, 3)]
    places = []
    for s in shards:
        p = FilePlacement(pf)
        p.hold(s, torch.device("cpu"))
        places.append(p)
    # writes of parts at unaligned element offsets (the offloaded step writes tile by tile)
    part = torch.randn(3001, generator=g)
    places[0].write(part, 1999)
    shards[0][1999:5000] = part.to(torch.bfloat16)
    places[0].write(shards[0][:7], 0)
    pf.flush()  # the queued writes are in the file (a test that corrupts it must not race them)
    return pf, places, shards


def test_param_file_partial_writes_keep_checksums(tmp_path):
    pf, places, shards = _param_file(tmp_path / "nvme")
    for p, s in zip(places, shards):
        assert torch.equal(p.read(), s)
    pf.close()
    assert not os.path.exists(pf.dir)


@pytest.mark.parametrize("kind", KINDS)
def test_corrupted_param_shard_is_refused_at_the_next_read(tmp_path, kind):
    pf, places, shards = _param_file(tmp_path / "nvme")
    at = places[0].offset + 2 * SUM_BLOCK + 8  # third block of the first region
    _corrupt(pf.path, at, kind)
    with pytest.raises(ShardspeedError, match=_expect(kind, pf.path)) as e:
        places[0].read()
    if kind != "truncate":
        assert "the parameter shard region at byte 0 (20002 bytes)" in str(e.value)
        # a partial write into the bad block reads it first: refused, not laundered into a new checksum
        with pytest.raises(ShardspeedError, match=_expect(kind, pf.path)):
            places[0].write(torch.zeros(2), (2 * SUM_BLOCK + 100) // 2)  # queued: the error comes at the flush
            pf.flush()
        with pytest.raises(ShardspeedError, match=_expect(kind, pf.path)):  # and at every read of the region
            places[0].read()
        # the other region is untouched and reads fine
        assert torch.equal(places[1].read(), shards[1])
    pf.close()


# ---- end to end: 2 ranks, one rank's swap file corrupted mid-run -------------------------------------------
def _e2e_config(nvme: str) -> dict:
    return {
        "train_micro_batch_size_per_gpu": 2,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
        "zero_optimization": {"stage": 3, "reduce_bucket_size": 300, "sub_group_size": 200,
                              "stage3_param_persistence_threshold": 0,
                              "offload_param": {"device": "nvme", "nvme_path": nvme},
                              "offload_optimizer": {"device": "nvme", "nvme_path": nvme, "buffer_count": 2}},
    }


def _train_with_corruption(nvme: str, bad_rank: int, bad_step: int):
    import torch.distributed as dist

    import shardspeed

    rank, world = dist.get_rank(), dist.get_world_size()
    engine, *_ = shardspeed.initialize(model=make_model("mlp"), config=_e2e_config(nvme))
    store = engine.master_weights.host_store
    for step, batch in enumerate(make_batches("mlp", 6, 2 * world)):
        if step == bad_step and rank == bad_rank:  # between steps: NaN over the start of tile 0's master
            with open(os.path.join(store.dir, "master.f32"), "r+b") as f:
                f.write(torch.full((16,), float("nan")).numpy().tobytes())
        x, y = micro_batch(batch, rank, world, 0, 1)
        t0 = time.monotonic()
        try:
            engine.backward(engine(x, y))
            engine.step()
        except ShardspeedError as e:
            # return (and so exit, which closes this rank's connections): what a script that does not catch
            # the error does
            return {"rank": rank, "type": type(e).__name__, "error": str(e), "step": step,
                    "seconds": time.monotonic() - t0, "dir": store.dir}
    return {"rank": rank, "type": None, "error": None}


def test_corrupted_swap_on_one_rank_stops_every_rank(tmp_path):
    timeout = 15
    t0 = time.monotonic()
    res = run_distributed(_train_with_corruption, 2, str(tmp_path / "nvme"), 1, 2, final_barrier=False,
                          timeout=90, collective_timeout=timeout)
    wall = time.monotonic() - t0
    bad, other = res[1], res[0]
    assert bad["type"] == "ShardspeedError" and bad["step"] == 2, bad
    assert bad["error"].startswith(f"NVMe swap corrupted: {bad['dir']}/master.f32, tile 0 "), bad["error"]
    assert other["error"] is not None, "the healthy rank must not go on alone"
    assert other["type"] == DistributedError.__name__ or other["error"].startswith("NVMe swap corrupted"), other
    assert other["step"] in (2, 3) and other["seconds"] < timeout + 10, other
    assert wall < 60, wall


# ---- swap folders of dead attempts -------------------------------------------------------------------------
_CHILD = """
import os, sys, time, torch
from shardspeed.offload.store import NvmeStateStore
from shardspeed.offload.param_file import NvmeParamFile, FilePlacement
from shardspeed.offload.tiles import plan_tiles
root, rank = sys.argv[1], int(sys.argv[2])
tiles = plan_tiles([[(0, 5000, 0)]], 3000, [0])
st = NvmeStateStore(root, tiles, 2, False, rank)
pf = NvmeParamFile(root, rank)
FilePlacement(pf).hold(torch.zeros(1000), torch.device("cpu"))
print(st.dir, pf.dir, flush=True)
time.sleep(600)
"""


def _dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def _killed_run(root: Path, rank: int, env: dict) -> list:
    """A process of the job that made its swap folders and was then killed with SIGKILL (no cleanup)."""
    p = subprocess.Popen([sys.executable, "-c", _CHILD, str(root), str(rank)], env=env, stdout=subprocess.PIPE,
                         text=True)
    try:
        dirs = p.stdout.readline().split()  # type: ignore[union-attr]
        assert len(dirs) == 2, "the child did not start"
    finally:
        p.send_signal(signal.SIGKILL)
        p.wait()
    assert all(os.path.isdir(d) for d in dirs)
    return dirs


def test_dead_attempts_swap_folders_are_removed_by_the_next_engine(tmp_path, monkeypatch):
    root = tmp_path / "nvme"
    env = dict(os.environ, TORCHELASTIC_RUN_ID="job-a", TORCHELASTIC_RESTART_COUNT="0",
               PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    killed = _killed_run(root, 0, env)  # attempt 0, rank 0: killed
    job_a = root / "shardspeed-swap-job-a"
    host = Path(killed[0]).parent.name.split("-", 3)[3]
    # attempt 0, rank 1: a process that is gone (its folder made by hand, with a file in it)
    dead1 = job_a / f"rank1-attempt0-pid{_dead_pid()}-{host}" / "optim-x"
    dead1.mkdir(parents=True)
    (dead1 / "master.f32").write_bytes(b"\0" * 5000)
    # another job's folder of a dead process (``shardspeed run`` picks a new job id per launch): reclaimed too
    other = root / "shardspeed-swap-job-b" / f"rank0-attempt0-pid{_dead_pid()}-{host}" / "optim-y"
    other.mkdir(parents=True)
    (other / "master.f32").write_bytes(b"\0" * 100)
    # a live process of this job and rank on another host: not ours to judge
    remote = job_a / "rank0-attempt0-pid1-some-other-host" / "optim-z"
    remote.mkdir(parents=True)

    records: list = []
    handler = logging.Handler(logging.INFO)
    handler.emit = records.append  # type: ignore[method-assign]
    log = logging.getLogger("shardspeed")
    log.addHandler(handler)
    old_level = log.level
    log.setLevel(logging.INFO)
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job-a")
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")  # the restarted attempt
    assert swap_job_id() == "job-a"
    try:
        tiles = plan_tiles([[(0, 5000, 0)]], 3000, [0])
        live = [NvmeStateStore(str(root), tiles, 2, False, r) for r in (0, 1)]
        pf = NvmeParamFile(str(root), 0)  # the same rank again: finds nothing more to remove
    finally:
        log.removeHandler(handler)
        log.setLevel(old_level)
    removed = [r.getMessage() for r in records if "removed" in r.getMessage()]
    assert len(removed) == 1, removed  # one line, by the first new store: every dead owner's folder on this host
    killed_rank_dir = str(Path(killed[0]).parent)
    assert killed_rank_dir in removed[0] and "rank 0" in removed[0], removed
    assert str(dead1) in removed[0] and "(5000 bytes" in removed[0], removed
    assert str(other) in removed[0] and "(100 bytes" in removed[0], removed
    # one folder per live rank of this job (the param file shares rank 0's), plus the other host's
    left = sorted(os.listdir(job_a))
    me = f"pid{os.getpid()}-{host}"
    assert left == sorted([f"rank0-attempt1-{me}", f"rank1-attempt1-{me}", remote.parent.name]), left
    assert sorted(os.listdir(job_a / f"rank0-attempt1-{me}")) == sorted(
        [os.path.basename(live[0].dir), os.path.basename(pf.dir)])
    assert not (root / "shardspeed-swap-job-b").exists(), "a dead process's folder of another job is reclaimed"
    for s in live:
        s.close()
    pf.close()
    assert sorted(os.listdir(job_a)) == [remote.parent.name], "close removes the rank folders it emptied"
