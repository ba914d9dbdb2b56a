"""A job's stores listen on loopback only (issue 35): a one-process run (plain ``python train.py``) and a
single-node ``shardspeed run`` under ``--max-restarts``, whose launcher then listens on nothing at all. Read from
/proc: the process's listening TCP sockets (their inodes among its open files) and their local addresses."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LOOPBACK = "0100007F"  # 127.0.0.1 as /proc/net/tcp writes it

SCRIPT = r'''
import json, os, sys
from shardspeed.mesh import init_distributed, shutdown_distributed
import torch.distributed as dist


def listeners(pid):
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in open(table).read().splitlines()[1:]:
            cols = line.split()
            if cols[3] == "0A" and cols[9] in inodes:  # state LISTEN
                address, port = cols[1].rsplit(":", 1)
                found.append([address, int(port, 16)])
    return found


init_distributed(backend="gloo")
dist.barrier()
store = dist.distributed_c10d._get_default_store()
while hasattr(store, "underlying_store"):  # torch wraps the store in PrefixStores
    store = store.underlying_store
store_port = store.port if dist.get_rank() == 0 else None
record = {"self": listeners(os.getpid()), "parent": listeners(os.getppid()), "store_port": store_port}
with open(os.path.join(sys.argv[1], f"rank{dist.get_rank()}.json"), "w") as f:
    json.dump(record, f)
dist.barrier()
shutdown_distributed()
'''

pytestmark = pytest.mark.skipif(not os.path.exists("/proc/net/tcp"), reason="needs Linux's /proc/net/tcp")


def _run(tmp_path, *argv):
    script = tmp_path / "listen.py"
    script.write_text(SCRIPT)
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                                                             "TORCH_DISABLE_SHARE_RDZV_TCP_STORE")}
    env["PYTHONPATH"] = ROOT
    proc = subprocess.run([sys.executable, *argv, str(script), str(tmp_path)], capture_output=True, text=True,
                          timeout=240, env=env, cwd=str(tmp_path))
    assert proc.returncode == 0, proc.stderr[-3000:]
    return [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(len(list(tmp_path.glob("rank*"))))]


def test_one_process_store_listens_on_loopback_only(tmp_path):
    (rank0,) = _run(tmp_path)
    assert rank0["self"], rank0
    assert all(address == LOOPBACK for address, _ in rank0["self"]), rank0  # not 0.0.0.0, not ::
    assert [LOOPBACK, rank0["store_port"]] in rank0["self"]


def test_launcher_with_restarts_listens_on_nothing_and_rank0_on_loopback(tmp_path):
    ranks = _run(tmp_path, "-m", "shardspeed.cli", "run", "--nproc", "2", "--max-restarts", "1")
    assert len(ranks) == 2
    assert ranks[0]["parent"] == [] and ranks[1]["parent"] == []  # torchrun's agent: a file store, no socket
    for record in ranks:
        assert all(address == LOOPBACK for address, _ in record["self"]), record
    assert [LOOPBACK, ranks[0]["store_port"]] in ranks[0]["self"]
