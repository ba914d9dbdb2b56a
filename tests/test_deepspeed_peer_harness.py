"""What DeepSpeed's own unit tests (tests/unit, with their harness ``tests/unit/common.py``) need from the opt-in
``deepspeed`` package beyond the integrations' names, each against the real DeepSpeed as the oracle (a
subprocess each): the harness's ``init_distributed(init_method="file://...", rank=, world_size=)`` rendezvous and
its ``deepspeed.comm`` calls, the LR schedules' and optimizers' key constants, ``get_bfloat16_config``,
``required_torch_version``, ``git_version_info.torch_info``, ``see_memory_usage``, ``ZeRORuntimeException``, the
package's ``__version_major__`` and git names, ``initialize(model=None)`` as an AssertionError, and the deprecated
``args.deepscale_config``."""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

import pytest
import torch.multiprocessing as mp

from shardspeed.compat import site_path

pytest.importorskip("deepspeed")

LR_KEYS = ["LR_SCHEDULE", "LR_RANGE_TEST", "ONE_CYCLE", "WARMUP_LR", "WARMUP_DECAY_LR", "WARMUP_COSINE_LR",
           "LR_RANGE_TEST_MIN_LR", "LR_RANGE_TEST_STEP_RATE", "LR_RANGE_TEST_STEP_SIZE", "LR_RANGE_TEST_STAIRCASE",
           "EDGE_VALUE", "MID_VALUE", "CYCLE_FIRST_STEP_SIZE", "CYCLE_FIRST_STAIR_COUNT", "CYCLE_SECOND_STEP_SIZE",
           "CYCLE_SECOND_STAIR_COUNT", "DECAY_STEP_SIZE", "CYCLE_MIN_LR", "CYCLE_MAX_LR", "DECAY_LR_RATE",
           "CYCLE_MIN_MOM", "CYCLE_MAX_MOM", "DECAY_MOM_RATE", "WARMUP_MIN_LR", "WARMUP_MAX_LR", "WARMUP_NUM_STEPS",
           "WARMUP_TYPE", "WARMUP_LOG_RATE", "WARMUP_LINEAR_RATE", "WARMUP_MIN_RATIO", "COS_MIN_RATIO",
           "TOTAL_NUM_STEPS"]

PROBE = r"""
import contextlib, importlib.metadata, io, json, sys
import torch
import deepspeed
import deepspeed.runtime.lr_schedules as lrs
from deepspeed.runtime import config as cfg
from deepspeed.runtime.precision_config import BFLOAT16, BFLOAT16_OLD, get_bfloat16_config
from deepspeed.utils.torch import required_torch_version
from deepspeed.git_version_info import torch_info, version
from deepspeed.runtime.utils import see_memory_usage
from deepspeed.runtime.zero.utils import ZeRORuntimeException
out = {"lr": {k: getattr(lrs, k) for k in json.loads(sys.argv[1])}}
out["opt"] = [cfg.ADAGRAD_OPTIMIZER, cfg.ADAM_OPTIMIZER, cfg.ADAMW_OPTIMIZER, cfg.LAMB_OPTIMIZER, cfg.LION_OPTIMIZER]
out["bf16"] = [BFLOAT16, BFLOAT16_OLD] + [get_bfloat16_config(c).enabled for c in (
    {"bf16": {"enabled": True}}, {"bfloat16": {"enabled": True}}, {}, {"bf16": {"enabled": False}})]
out["torch_version"] = [required_torch_version(**kw) for kw in (
    {"min_version": 1.0}, {"min_version": "99.0"}, {"max_version": "1.0"}, {"max_version": 99},
    {"min_version": "2.0", "max_version": "99"})]
out["torch_info"] = sorted(torch_info)
out["version"] = version == importlib.metadata.version("deepspeed")
quiet, loud = io.StringIO(), io.StringIO()
with contextlib.redirect_stdout(quiet):
    see_memory_usage("before step")
with contextlib.redirect_stdout(loud):
    see_memory_usage("before step", force=True)
out["memory"] = [quiet.getvalue(), [line.split()[0] for line in loud.getvalue().splitlines()]]
out["zero_exc"] = issubclass(ZeRORuntimeException, Exception)
try:
    from deepspeed.runtime.bf16_optimizer import BF16_Optimizer
except ImportError as e:
    out["bf16_optimizer"] = str(e)
out["version_parts"] = [deepspeed.__version_major__, deepspeed.__version_minor__, deepspeed.__version_patch__]
out["git"] = [hasattr(deepspeed, "__git_hash__"), hasattr(deepspeed, "__git_branch__")]
out["allreduce_op"] = cfg.DeepSpeedConfig({"train_batch_size": 1}).gradient_allreduce_op
out["no_model"] = []
for call in (lambda: deepspeed.initialize(model=None, config={"train_batch_size": 1}),
             lambda: deepspeed.initialize(torch.nn.Linear(2, 2), config={"train_batch_size": 1})):
    try:
        call()
    except AssertionError:
        out["no_model"].append("AssertionError")
import argparse, os, tempfile, torch
path = os.path.join(tempfile.mkdtemp(), "ds.json")
with open(path, "w") as f:
    json.dump({"train_batch_size": 2, "optimizer": {"type": "Adam", "params": {"lr": 0.01}}}, f)
args = argparse.Namespace(deepscale_config=path, local_rank=0)
torch.manual_seed(0)
engine, *_ = deepspeed.initialize(args=args, model=torch.nn.Linear(4, 1), model_parameters=None)
x, y = torch.randn(2, 4), torch.randn(2, 1)
losses = []
for _ in range(3):
    loss = torch.nn.functional.mse_loss(engine(x), y)
    engine.backward(loss)
    engine.step()
    losses.append(loss.item())
out["deepscale"] = [engine.train_batch_size(), losses]
print("RESULT " + json.dumps(out))
"""


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _probe(package: bool) -> dict:
    paths = [site_path(), os.getcwd()] if package else [os.getcwd()]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(paths), DS_ACCELERATOR="cpu", RANK="0", LOCAL_RANK="0",
               WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()))
    res = subprocess.run([sys.executable, "-c", PROBE, json.dumps(LR_KEYS)], env=env, capture_output=True,
                         text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    return json.loads([x for x in res.stdout.splitlines() if x.startswith("RESULT ")][-1][len("RESULT "):])


@pytest.fixture(scope="module")
def both():
    return _probe(package=True), _probe(package=False)


def test_constants_and_helpers_equal_deepspeeds(both):
    ours, real = both
    for key in ("lr", "opt", "bf16", "torch_version", "version", "zero_exc", "git", "allreduce_op", "no_model"):
        assert ours[key] == real[key], key
    assert ours["no_model"] == ["AssertionError", "AssertionError"]
    assert ours["version_parts"] == [0, 18, 2] and len(real["version_parts"]) == 3
    assert ours["bf16"] == ["bf16", "bfloat16", True, True, False, False]
    assert ours["torch_version"] == [True, False, False, True, True]
    assert set(real["torch_info"]) <= set(ours["torch_info"])


def test_deprecated_deepscale_config_argument_trains_as_deepspeed(both):
    ours, real = both
    assert ours["deepscale"][0] == real["deepscale"][0] == 2
    assert ours["deepscale"][1] == pytest.approx(real["deepscale"][1], abs=1e-5)
    assert ours["deepscale"][1][2] < ours["deepscale"][1][0]


def test_see_memory_usage_prints_as_deepspeed(both):
    ours, real = both
    assert ours["memory"][0] == real["memory"][0] == ""  # nothing without force
    assert ours["memory"][1] == real["memory"][1] == ["before", "MA", "CPU"]


def test_deepspeeds_optimizer_wrappers_are_not_provided(both):
    ours, real = both
    assert "bf16_optimizer" not in real
    assert ours["bf16_optimizer"] == \
        "shardspeed's deepspeed compatibility does not provide deepspeed.runtime.bf16_optimizer"


def _harness_rank(rank: int, path: str, port: int, out) -> None:
    # what tests/unit/common.py's DistributedTest does in each worker
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), LOCAL_RANK=str(rank), RANK=str(rank),
                      WORLD_SIZE="2", LOCAL_SIZE="2")
    import torch

    import shardspeed.comm as comm

    comm.init_distributed(dist_backend="gloo", init_method=f"file://{path}", rank=rank, world_size=2)
    comm.barrier()
    gathered = torch.zeros(4)
    comm.all_gather_into_tensor(gathered, torch.tensor([rank + 1.0, rank + 10.0]))
    parts = [torch.zeros(1), torch.zeros(1)]
    comm.all_gather(parts, torch.tensor([rank * 3.0]))
    out.put((rank, comm.get_rank(), comm.get_world_size(), gathered.tolist(), [p.item() for p in parts]))
    comm.destroy_process_group()
    out.put((rank, "destroyed", comm.is_initialized()))


def test_harness_file_rendezvous_and_comm_calls(tmp_path):
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=_harness_rank, args=(r, str(tmp_path / "store"), _free_port(), out)) for r in range(2)]
    for p in procs:
        p.start()
    got = [out.get(timeout=240) for _ in range(4)]
    for p in procs:
        p.join(timeout=60)
    assert [p.exitcode for p in procs] == [0, 0]
    ranks = sorted(g for g in got if g[1] != "destroyed")
    assert ranks == [(0, 0, 2, [1.0, 10.0, 2.0, 11.0], [0.0, 3.0]), (1, 1, 2, [1.0, 10.0, 2.0, 11.0], [0.0, 3.0])]
    assert sorted(g for g in got if g[1] == "destroyed") == [(0, "destroyed", False), (1, "destroyed", False)]


def test_comm_missing_name_says_the_one_line():
    import shardspeed.comm as comm

    with pytest.raises(AttributeError, match="^shardspeed's deepspeed compatibility does not provide "
                                             "deepspeed.comm.no_such_collective$"):
        comm.no_such_collective  # noqa: B018
