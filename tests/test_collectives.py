"""Logged collectives: results, byte accounting, and gloo's all-gather by broadcasts."""
import torch
from distributed import run_distributed


def _cases():
    import torch.distributed as dist

    from shardspeed.comm.collectives import Collectives, CommsLogger
    from shardspeed.mesh.topology import Topology

    rank, world = dist.get_rank(), dist.get_world_size()
    c = Collectives(Topology.data_parallel(), CommsLogger(keep_records=True))
    out = {}
    n = 37
    shard = torch.arange(n, dtype=torch.float32) + 1000 * rank
    full = torch.zeros(world * n)
    c.all_gather(full, shard, async_op=True).wait()
    out["plain"] = full.clone()
    c.gloo_broadcast_bytes = 40  # the 148-byte pieces now go by broadcasts: one logged all-gather
    full.zero_()
    c.all_gather(full, shard, async_op=True).wait()
    out["broadcasts"] = full.clone()
    full.zero_()
    c.all_gather(full, shard)
    out["broadcasts_sync"] = full.clone()
    x = torch.full((8,), float(rank + 1))
    c.all_reduce(x)
    out["all_reduce"] = x
    y = torch.arange(8, dtype=torch.float32)
    c.reduce_scatter(y[rank * 4 : rank * 4 + 4], y)
    out["reduce_scatter"] = y[rank * 4 : rank * 4 + 4].clone()
    out["summary"] = c.log.summary()
    out["records"] = len(c.log.records)
    return out


def test_collectives_and_their_log():
    r0, r1 = run_distributed(_cases, 2)
    expect = torch.cat([torch.arange(37, dtype=torch.float32) + 1000 * k for k in range(2)])
    for r in (r0, r1):
        assert torch.equal(r["plain"], expect) and torch.equal(r["broadcasts"], expect)
        assert torch.equal(r["broadcasts_sync"], expect)
        assert torch.equal(r["all_reduce"], torch.full((8,), 3.0))
        s = r["summary"]
        assert s["all_gather"]["count"] == 3
        assert s["all_gather"]["msg_bytes"] == 3 * 2 * 37 * 4  # by broadcasts or not, the same message
        assert s["all_reduce"]["paper_bytes"] == 2 * 8 * 4  # an all-reduce of Ψ counts 2Ψ
        assert s["reduce_scatter"]["ring_bytes"] == 8 * 4 / 2  # (N-1)/N of the message at N = 2
        assert r["records"] == 5
    assert torch.equal(r0["reduce_scatter"], torch.tensor([0.0, 2.0, 4.0, 6.0]))
    assert torch.equal(r1["reduce_scatter"], torch.tensor([8.0, 10.0, 12.0, 14.0]))


def test_comms_logger_switches_verbose_prof_ops_and_debug(caplog):
    """comms_logger.verbose logs each collective as DeepSpeed prints it; prof_ops limits records and lines
    (the totals still count every collective); debug names the function that issued it."""
    import logging

    from shardspeed.comm.collectives import CommsLogger
    from shardspeed.config import load_config
    from shardspeed.runtime.builder import build_comms_logger

    log = CommsLogger(keep_records=True, verbose=True, ops=["all_gather"], debug=True)

    def issue_gather():
        return log.start("all_gather", torch.zeros(1024), 2)

    with caplog.at_level(logging.INFO, logger="shardspeed.comm.collectives"):
        log.finish(log.start("all_reduce", torch.zeros(256), 2))
        log.finish(issue_gather())
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1 and "comm op: all_gather" in lines[0] and "msg size: 4.00 KB" in lines[0]
    assert "busbw (Gbps)" in lines[0] and lines[0].endswith("caller: test_collectives.issue_gather")
    assert [r.op for r in log.records] == ["all_gather"] and log.records[0].caller.endswith("issue_gather")
    assert set(log.summary()) == {"all_reduce", "all_gather"}  # the byte accounting stays whole
    # the config block drives it; its switches act only when the logger is enabled
    cfg = {"train_micro_batch_size_per_gpu": 1, "comms_logger": {"enabled": True, "verbose": True, "debug": True,
                                                                  "prof_all": False, "prof_ops": ["all_reduce"]}}
    built = build_comms_logger(load_config(cfg).comms_logger)
    assert built.keep_records and built.verbose and built.debug and built.ops == {"all_reduce"}
    off = build_comms_logger(load_config({**cfg, "comms_logger": {"enabled": False, "verbose": True}}).comms_logger)
    assert not (off.keep_records or off.verbose or off.debug) and off.ops is None


def _exchange_cases():
    import torch.distributed as dist

    from shardspeed.comm.collectives import Collectives, CommsLogger
    from shardspeed.mesh.topology import Topology

    rank, world = dist.get_rank(), dist.get_world_size()
    c = Collectives(Topology.data_parallel(), CommsLogger())
    sends = []
    real = dist.isend
    dist.isend = lambda t, *a, **k: (sends.append(t.numel()), real(t, *a, **k))[1]
    try:
        out = {}
        n = 1000  # 4000-byte chunks
        for name, threshold in (("gloo", 1 << 30), ("exchange", 4000)):
            c.gloo_exchange_bytes = threshold
            a = torch.arange(world * n, dtype=torch.float32) * (rank + 1)  # integers: any sum order is exact
            b = torch.arange(world * n, dtype=torch.float32) - rank
            b_out = torch.empty(n)
            h1 = c.reduce_scatter(a[rank * n : (rank + 1) * n], a, async_op=True)  # in place, two in flight
            h2 = c.reduce_scatter(b_out, b, async_op=True)
            h2.wait()
            h1.wait()
            out[name] = (a[rank * n : (rank + 1) * n].clone(), b_out.clone())
            out[name + "_sends"] = list(sends)
            sends.clear()
        out["summary"] = c.log.summary()["reduce_scatter"]
        return out
    finally:
        dist.isend = real


def test_reduce_scatter_by_exchanges_on_gloo_equals_gloos_own():
    """On gloo, a large reduce-scatter runs as one send and one receive per peer (half the bytes of gloo's
    own, which runs an all-reduce): the same sums, in place or not, with two in flight at once, at world 4;
    the log counts it as the same reduce-scatter."""
    results = run_distributed(_exchange_cases, 4)
    n, world = 1000, 4
    idx = torch.arange(world * n, dtype=torch.float32)
    for rank, r in enumerate(results):
        chunk = idx[rank * n : (rank + 1) * n]
        want_a, want_b = chunk * sum(k + 1 for k in range(world)), chunk * world - sum(range(world))
        for name in ("gloo", "exchange"):
            assert torch.equal(r[name][0], want_a) and torch.equal(r[name][1], want_b), (rank, name)
        assert r["gloo_sends"] == [] and r["exchange_sends"] == [n] * (2 * (world - 1))
        assert r["summary"]["count"] == 4 and r["summary"]["msg_bytes"] == 4 * world * n * 4
