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
