"""DeepSpeed's launcher options on ``shardspeed run`` (shardspeed/cli/ds_options.py), the ``--local_rank`` DeepSpeed
gives its workers (shardspeed/bootstrap.py), and the ``deepspeed`` command of ``shardspeed deepspeed-path --bin``.

Most cases are pure argv mappings (cheap); two real launches at world 2: a DeepSpeed-Chat-style script through the
``deepspeed`` command, and the same job as two torchrun agents on loopback from a two-host hostfile, whose losses
equal the single-node run's."""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

import pytest

from shardspeed import bootstrap
from shardspeed.cli import main
from shardspeed.cli.args import UsageError, build_torchrun_argv, command_option_arity
from shardspeed.cli.ds_options import Machine, is_this_host, parse_hostfile, resolve, take_deepspeed_options
from shardspeed.cli.run import _wrap_in_bootstrap, deepspeed_launch, split_autotuning
from shardspeed.compat import site_path

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _machine(tmp_path, me=("localhost",), gpus=0, environ=None):
    home = tmp_path / "home"
    home.mkdir(exist_ok=True)
    return Machine(lambda h: h in me, lambda: gpus, dict(environ or {}), str(tmp_path), str(home))


def _map(argv, machine, deepspeed_style=False):
    arity = command_option_arity()
    found, rest = take_deepspeed_options(argv, arity)
    launch = resolve(found, rest, arity, machine, deepspeed_style)
    return build_torchrun_argv(launch.argv), launch


def _hostfile(tmp_path, text):
    path = tmp_path / "hostfile"
    path.write_text(text)
    return str(path)


def test_single_node_counts(tmp_path):
    m = _machine(tmp_path, gpus=4)
    argv, launch = _map(["--num_gpus", "2", "train.py", "--num_gpus", "9"], m)
    assert argv == ["--standalone", "--nproc-per-node", "2", "train.py", "--num_gpus", "9"]  # script args untouched
    assert launch.local_rank_arg is False and launch.env == {} and launch.note is None
    assert _map(["--num_accelerators=3", "t.py"], m)[0][:3] == ["--standalone", "--nproc-per-node", "3"]
    # plain shardspeed run keeps torchrun's counts and default; DeepSpeed style uses every local device
    assert _map(["--nproc", "3", "t.py"], m)[0] == ["--standalone", "--nproc-per-node", "3", "t.py"]
    assert _map(["t.py"], m)[0] == ["--standalone", "t.py"]
    argv, launch = _map(["t.py"], m, deepspeed_style=True)
    assert argv == ["--standalone", "--nproc-per-node", "4", "t.py"] and launch.local_rank_arg
    assert _map(["t.py"], _machine(tmp_path, gpus=0), deepspeed_style=True)[0][2] == "1"
    assert _map(["--no_local_rank", "t.py"], m, deepspeed_style=True)[1].local_rank_arg is False
    # torchrun options among DeepSpeed's, with and without '='; the master given: no --standalone
    argv, _ = _map(["--max-restarts", "1", "--num_gpus=2", "--master_port", "29555", "--master_addr=127.0.0.1",
                    "--module", "pkg.train", "--x"], m)
    assert argv == ["--nproc-per-node", "2", "--max-restarts", "1", "--master_port", "29555",
                    "--master_addr", "127.0.0.1", "--module", "pkg.train", "--x"]
    argv, _ = _map(["--enable_each_rank_log", "logs", "--num_gpus", "1", "t.py"], m)
    assert argv == ["--standalone", "--nproc-per-node", "1", "--log-dir", "logs", "--redirects", "3", "t.py"]


def test_hostfile_parsing(tmp_path):
    pool = parse_hostfile(["# workers", "", "worker-0 slots=4  # the first", "worker-1   slots=2"])
    assert list(pool.items()) == [("worker-0", 4), ("worker-1", 2)]
    for lines, msg in [(["worker-0"], "is not 'hostname slots=N'"), (["a slots=x"], "is not 'hostname slots=N'"),
                       (["a slots=1", "a slots=2"], "host 'a' is listed twice"), (["# none"], "lists no host")]:
        with pytest.raises(UsageError, match=msg):
            parse_hostfile(lines)


def test_single_host_hostfile_and_slot_filters(tmp_path):
    hf = _hostfile(tmp_path, "w1 slots=4\nw2 slots=4\n")
    m = _machine(tmp_path, me=("w1",), environ={"CUDA_VISIBLE_DEVICES": "4,5,6,7"})
    argv, launch = _map(["--hostfile", hf, "--include", "w1:0,2", "t.py"], m)
    assert argv == ["--standalone", "--nproc-per-node", "2", "t.py"] and launch.note is None
    assert launch.env == {"CUDA_VISIBLE_DEVICES": "4,6"}  # slots index the devices already visible
    argv, launch = _map(["-H", hf, "-e", "w2", "t.py"], _machine(tmp_path, me=("w1",)))
    assert argv[:3] == ["--standalone", "--nproc-per-node", "4"] and launch.env == {}
    argv, launch = _map(["-H", hf, "--exclude", "w1:1@w2", "t.py"], _machine(tmp_path, me=("w1",)))
    assert argv[:3] == ["--standalone", "--nproc-per-node", "3"] and launch.env == {"CUDA_VISIBLE_DEVICES": "0,2,3"}
    assert _map(["-H", hf, "--num_nodes", "1", "t.py"], m)[0][:3] == ["--standalone", "--nproc-per-node", "4"]


def test_multi_node_hostfile(tmp_path):
    hf = _hostfile(tmp_path, "# two hosts\nnode-a slots=2\nnode-b slots=3\n")
    argv, launch = _map(["--hostfile", hf, "t.py", "--lr", "1"], _machine(tmp_path, me=("node-b",)))
    assert argv == ["--nnodes", "2", "--node-rank", "1", "--nproc-per-node", "3", "--master-addr", "node-a",
                    "--master-port", "29500", "t.py", "--lr", "1"]
    assert "node 1 of 2 (node-b, 3 processes)" in launch.note and "on every host" in launch.note
    argv, _ = _map(["--hostfile", hf, "--num_gpus", "1", "--node_rank", "0", "--master_addr", "10.0.0.1",
                    "--master_port=6000", "t.py"], _machine(tmp_path, me=()))
    assert argv == ["--nnodes", "2", "--node-rank", "0", "--nproc-per-node", "1", "--master-addr", "10.0.0.1",
                    "--master-port", "6000", "t.py"]
    # --force_multi: a one-host job still goes through the hostfile's node rank and rendezvous
    argv, _ = _map(["-H", hf, "-i", "node-b", "--force_multi", "t.py"], _machine(tmp_path, me=("node-b",)))
    assert argv[:6] == ["--nnodes", "1", "--node-rank", "0", "--nproc-per-node", "3"]
    # torchrun accepts what comes out
    from torch.distributed.run import get_args_parser
    ns = get_args_parser().parse_args(argv)
    assert (ns.nnodes, ns.node_rank, ns.nproc_per_node, ns.master_addr) == ("1", 0, "3", "node-b")


def test_deepspeed_env_file_goes_to_multi_node_workers(tmp_path):
    hf = _hostfile(tmp_path, "a slots=1\nb slots=1\n")
    (tmp_path / "home" ).mkdir()
    (tmp_path / "home" / ".deepspeed_env").write_text("NCCL_X=home\nHOME_ONLY=1\n")
    (tmp_path / ".deepspeed_env").write_text("# comment\nNCCL_X=cwd=yes\n")
    _, launch = _map(["-H", hf, "t.py"], _machine(tmp_path, me=("a",)))
    assert launch.env == {"NCCL_X": "cwd=yes", "HOME_ONLY": "1"}  # the working folder's wins
    assert _map(["--num_gpus", "1", "t.py"], _machine(tmp_path))[1].env == {}  # one node: DeepSpeed exports nothing
    (tmp_path / "ds_env").write_text("oops\n")
    with pytest.raises(UsageError, match=r"ds_env line 1: 'oops' is not KEY=VALUE"):
        _map(["-H", hf, "t.py"], _machine(tmp_path, me=("a",), environ={"DS_ENV_FILE": "ds_env"}))


@pytest.mark.parametrize("argv,message", [
    (["--include", "w1", "--exclude", "w2", "t.py"], "--include and --exclude cannot be used together"),
    (["--num_gpus", "1", "--include", "w1", "t.py"], "cannot be used with --include/--exclude"),
    (["--nproc", "2", "--num_gpus", "2", "t.py"], "--nproc-per-node and DeepSpeed's"),
    (["--nnodes", "2", "-H", "HF", "t.py"], "--nnodes and DeepSpeed's"),
    (["-H", "HF", "--include", "w9", "t.py"], "--include: host 'w9' is not in the hostfile"),
    (["-H", "HF", "--include", "w1:7", "t.py"], "host 'w1' has no slot 7"),
    (["-H", "HF", "--include", "w1:a", "t.py"], "slots must be numbers"),
    (["-H", "HF", "--exclude", "w1@w2", "t.py"], "leaves no slot to run on"),
    (["--hostfile", "/no/such/file", "t.py"], "--hostfile /no/such/file: no such file"),
    (["--num_nodes", "2", "t.py"], "--num_nodes 2 needs a --hostfile"),
    (["--num_gpus", "two", "t.py"], "--num_gpus must be a number"),
    (["-H", "HF", "--launcher", "openmpi", "t.py"], "--launcher openmpi is not provided: shardspeed starts no remote"),
    (["--launcher", "torchx", "t.py"], "--launcher 'torchx' is unknown"),
    (["--ssh_port", "22", "t.py"], r"--ssh_port \(shardspeed starts no ssh session\) is not provided"),
    (["--elastic_training", "t.py"], "use torchrun's --nnodes MIN:MAX"),
    (["--bind_cores_to_rank", "t.py"], "--numa-binding"),
    (["-H", "HF", "t.py"], "cannot tell which host of .* this is \\(none of w1, w2 match\\): give --node_rank"),
    (["-H", "HF", "--node_rank", "2", "t.py"], "--node_rank 2 is not a node of the 2 hosts"),
    (["--no_local_rank=1", "t.py"], "--no_local_rank takes no value"),
    (["--num_gpus"], "--num_gpus needs a value"),
    (["--hostfile", "a", "--hostfile", "b", "t.py"], "--hostfile given twice"),
])
def test_refused_with_one_line(tmp_path, argv, message):
    hf = _hostfile(tmp_path, "w1 slots=2\nw2 slots=2\n")
    with pytest.raises(UsageError, match=message):
        _map([hf if a == "HF" else a for a in argv], _machine(tmp_path, me=()))


def test_launcher_choice_maps_directly_on_one_node(tmp_path):
    argv, _ = _map(["--launcher", "slurm", "--num_gpus", "2", "--no_ssh_check", "-q", "--log_level", "error", "t.py"],
                   _machine(tmp_path))
    assert argv == ["--standalone", "--nproc-per-node", "2", "t.py"]


def test_this_host_by_name_or_address():
    assert is_this_host("localhost") and is_this_host("127.0.0.1") and is_this_host(socket.gethostname())
    assert not is_this_host("no-such-host.invalid")


def test_workers_get_local_rank_only_deepspeed_style():
    # the bootstrap's argv: DeepSpeed puts --local_rank=N right after the script
    assert bootstrap.worker_argv(["t.py", "--a", "1"], 3) == ["t.py", "--local_rank=3", "--a", "1"]
    assert bootstrap.worker_argv(["--module", "pkg.m", "--a"], 0) == ["--module", "pkg.m", "--local_rank=0", "--a"]
    assert bootstrap.worker_argv(["--no-python", "prog"], 1) == ["--no-python", "prog", "--local_rank=1"]
    assert bootstrap.worker_argv(["t.py", "--a"], None) == ["t.py", "--a"]
    script = os.path.realpath(bootstrap.__file__)
    plain = build_torchrun_argv(["--nproc", "2", "t.py", "--a"])
    assert _wrap_in_bootstrap(plain) == ["--standalone", "--nproc-per-node", "2", script, "t.py", "--a"]
    assert _wrap_in_bootstrap(plain, True) == ["--standalone", "--nproc-per-node", "2", script,
                                               bootstrap.LOCAL_RANK_ARG, "t.py", "--a"]
    assert _wrap_in_bootstrap(build_torchrun_argv(["-m", "pkg.m"]), True)[-3:] == [bootstrap.LOCAL_RANK_ARG,
                                                                                   "--module", "pkg.m"]
    no_python = build_torchrun_argv(["--no_python", "prog"])
    assert _wrap_in_bootstrap(no_python) is None  # torchrun runs the program itself, as before
    assert _wrap_in_bootstrap(no_python, True)[-3:] == [bootstrap.LOCAL_RANK_ARG, "--no-python", "prog"]


def test_as_deepspeed_puts_the_package_first_for_the_workers(monkeypatch):
    monkeypatch.setenv("PYTHONPATH", "/x:/y")
    launch = deepspeed_launch(["--num_gpus", "2", "t.py"], as_deepspeed=True)
    assert launch.env["PYTHONPATH"] == os.pathsep.join([site_path(), "/x", "/y"]) and launch.local_rank_arg
    assert "PYTHONPATH" not in deepspeed_launch(["--num_gpus", "2", "t.py"]).env


def test_autotuning_flag_is_found_after_deepspeed_options():
    mode, rest = split_autotuning(["--hostfile", "hf", "--autotuning", "tune", "t.py"])
    assert mode == "tune" and rest == ["--hostfile", "hf", "t.py"]


def test_usage_error_is_one_line(capsys):
    assert main(["run", "--include", "a", "--exclude", "b", "t.py"]) == 2
    err = capsys.readouterr().err
    assert err == "shardspeed run: error: --include and --exclude cannot be used together\n"


# ---------------------------------------------------------------- real launches (world 2)

DS_CHAT = r"""
import argparse, json, os, sys
import torch
import deepspeed

parser = argparse.ArgumentParser()
parser.add_argument("--local_rank", type=int, default=-1)
parser.add_argument("--out", required=True)
args = parser.parse_args()
if args.local_rank == -1:  # DeepSpeed-Chat: no launcher, one process
    device = torch.device("cpu")
else:
    deepspeed.init_distributed()
rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
config = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "Adam", "params": {"lr": 1e-2}},
          "zero_optimization": {"stage": 2}}
engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
g = torch.Generator().manual_seed(100 + rank)
losses = []
for _ in range(4):
    x, y = torch.randn(2, 4, generator=g), torch.randn(2, 1, generator=g)
    loss = torch.nn.functional.mse_loss(engine(x), y)
    engine.backward(loss)
    engine.step()
    losses.append(loss.item())
try:  # Lightning passes exclude_frozen_parameters; only False is provided
    engine.save_checkpoint("ckpt", tag="checkpoint", exclude_frozen_parameters=True)
    refused = None
except AttributeError as e:
    refused = str(e)
with open(f"{args.out}.rank{rank}.json", "w") as f:
    json.dump({"losses": losses, "world": world, "local_rank": args.local_rank, "argv": sys.argv[1:],
               "deepspeed": deepspeed.__file__, "refused": refused, "env": {k: os.environ.get(k) for k in ("DS_TEST_VAR", "DS_HOME_ONLY")}},
              f)
"""


def _env(tmp_path, bin_path=True):
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR",
                                                          "MASTER_PORT", "PYTHONPATH")}
    env.update(PYTHONPATH=ROOT, OMP_NUM_THREADS="1", HOME=str(tmp_path / "home"),
               PATH=os.pathsep.join([os.path.join(site_path(), "bin"), os.path.dirname(sys.executable),
                                     env.get("PATH", "")]))
    return env


def _read(prefix):
    return [json.load(open(f"{prefix}.rank{r}.json")) for r in (0, 1)]


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def ds_chat(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("ds_chat")
    (tmp / "home").mkdir()
    (tmp / "home" / ".deepspeed_env").write_text("DS_TEST_VAR=home\nDS_HOME_ONLY=yes\n")
    (tmp / ".deepspeed_env").write_text("DS_TEST_VAR=cwd\n")
    (tmp / "train.py").write_text(DS_CHAT)
    env = _env(tmp)
    single = subprocess.run(["deepspeed", "--num_gpus", "2", "train.py", "--out", "single"], cwd=tmp, env=env,
                            capture_output=True, text=True, timeout=300)
    assert single.returncode == 0, single.stderr[-4000:]
    (tmp / "hostfile").write_text("# two agents on loopback\nlocalhost slots=1\n127.0.0.1 slots=1\n")
    port = str(_free_port())
    common = ["--hostfile", "hostfile", "--master_port", port]
    agents = [subprocess.Popen(["deepspeed", *common, "--node_rank", "0", "train.py", "--out", "two"], cwd=tmp,
                               env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True),
              subprocess.Popen([sys.executable, "-m", "deepspeed.launcher.runner", *common, "--node_rank", "1",
                                "train.py", "--out", "two"], cwd=tmp, stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True,
                               env=dict(env, PYTHONPATH=os.pathsep.join([site_path(), ROOT])))]
    outs = [a.communicate(timeout=300) for a in agents]
    for a, (_, err) in zip(agents, outs):
        assert a.returncode == 0, err[-4000:]
    return tmp, outs


def test_deepspeed_command_gives_local_rank_and_the_package(ds_chat):
    tmp, _ = ds_chat
    for rank, got in enumerate(_read(tmp / "single")):
        assert got["world"] == 2 and got["local_rank"] == rank  # init_distributed ran: --local_rank was given
        assert got["argv"] == [f"--local_rank={rank}", "--out", "single"]
        assert got["deepspeed"].startswith(site_path())  # `import deepspeed` was shardspeed's package
        assert got["env"] == {"DS_TEST_VAR": None, "DS_HOME_ONLY": None}  # one node: .deepspeed_env not read
        assert got["refused"] == ("shardspeed's deepspeed compatibility does not provide "
                                  "deepspeed.DeepSpeedEngine.save_checkpoint(exclude_frozen_parameters=True)")
    assert not (tmp / "ckpt").exists()


def test_two_agents_from_a_hostfile_equal_one_node(ds_chat):
    tmp, outs = ds_chat
    single, two = _read(tmp / "single"), _read(tmp / "two")
    for rank in (0, 1):
        assert two[rank]["world"] == 2 and two[rank]["local_rank"] == 0  # one slot on each "host"
        assert two[rank]["losses"] == pytest.approx(single[rank]["losses"], abs=1e-6)
        assert two[rank]["env"] == {"DS_TEST_VAR": "cwd", "DS_HOME_ONLY": "yes"}
    assert single[0]["losses"] != single[1]["losses"]  # the ranks saw different data
    assert "node 0 of 2 (localhost, 1 process)" in outs[0][1]
    assert "node 1 of 2 (127.0.0.1, 1 process)" in outs[1][1]
