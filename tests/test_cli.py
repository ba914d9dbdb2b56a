import json

import pytest
import torch

from shardspeed.cli import UsageError, build_torchrun_argv, main, parse_count
from shardspeed.errors import ConfigError
from shardspeed.memory_estimate import estimate_model_state_memory

# ---- estimate: the ZeRO paper's arithmetic, checked by hand ----

def test_zero_paper_example_7_5b_on_64_ranks():
    # ZeRO paper, Figure 1: Ψ = 7.5B, N = 64, mixed precision Adam: 120 → 31.4 → 16.6 → 1.9 GB
    gb = [estimate_model_state_memory(7.5e9, 64, s, "bf16").device / 1e9 for s in range(4)]
    assert gb == pytest.approx([120.0, 31.40625, 16.640625, 1.875])


def test_hand_computed_1b_on_8_ranks():
    psi, n = 1e9, 8
    bf16 = [estimate_model_state_memory(psi, n, s, "bf16").device for s in range(4)]
    assert bf16 == pytest.approx([16e9, 4e9 + 12e9 / 8, 2e9 + 14e9 / 8, 16e9 / 8])
    fp32 = [estimate_model_state_memory(psi, n, s, "fp32").device for s in range(4)]
    assert fp32 == pytest.approx([16e9, 8e9 + 8e9 / 8, 4e9 + 12e9 / 8, 16e9 / 8])
    m = estimate_model_state_memory(psi, n, 2, "bf16")
    assert (m.params_device, m.grads_device, m.optimizer_device, m.host) == (2e9, 0.25e9, 1.5e9, 0)


def test_offload_moves_states_to_host():
    m = estimate_model_state_memory(1e9, 8, 2, "bf16", offload_optimizer=True)
    assert m.device == pytest.approx(2e9 + 2e9 / 8)  # 16-bit params + grad shard
    assert m.host == pytest.approx(12e9 / 8)
    m = estimate_model_state_memory(1e9, 8, 3, "fp32", offload_optimizer=True, offload_param=True)
    assert m.device == pytest.approx(4e9 / 8)  # only the fp32 grad shard stays
    # host: m, v + the parameter shard + the fp32 master, a copy of it (offload/master.py; as peak._held prices it)
    assert m.host == pytest.approx(8e9 / 8 + 4e9 / 8 + 4e9 / 8)
    assert m.total == pytest.approx(20e9 / 8)


@pytest.mark.parametrize("kwargs", [
    dict(stage=0, offload_optimizer=True),
    dict(stage=2, offload_param=True),
    dict(stage=4),
    dict(dtype="int8"),
    dict(world_size=0),
])
def test_estimate_rejects_impossible_settings(kwargs):
    with pytest.raises(ConfigError):
        estimate_model_state_memory(1e9, **{"world_size": 8, **kwargs})


def test_parse_count():
    assert parse_count("1.3B") == 1_300_000_000
    assert parse_count("125M") == 125_000_000
    assert parse_count("7.5e9") == 7_500_000_000
    assert parse_count("350000") == 350_000
    with pytest.raises(ValueError):
        parse_count("lots")


def test_estimate_command_table(capsys):
    assert main(["estimate", "--params", "1B", "--world", "8", "--stage", "2"]) == 0
    out = capsys.readouterr().out
    row = [line for line in out.splitlines() if line.startswith("2 ")][0].split()
    # stage, offload, params, grads, optim, device/rank, host/rank (GB)
    assert row == ["2", "-", "2.00", "0.25", "1.50", "3.75", "0.00"]


def test_estimate_command_json_all_stages(capsys):
    assert main(["estimate", "--params", "7.5e9", "--world", "64", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [r["stage"] for r in rows] == [0, 1, 2, 3]
    assert rows[3]["device"] == pytest.approx(16 * 7.5e9 / 64)


def test_estimate_command_bad_combination_exits_2(capsys):
    assert main(["estimate", "--params", "1B", "--stage", "1", "--offload-param"]) == 2
    assert "stage 3" in capsys.readouterr().err


def test_estimate_command_from_model_preset(capsys):
    assert main(["estimate", "--model", "tiny", "--stage", "0", "--dtype", "fp32", "--json"]) == 0
    (row,) = json.loads(capsys.readouterr().out)
    assert row["num_params"] == 220_544 and row["device"] == 16 * 220_544


# ---- run: the torchrun argv, built but never launched ----

def test_run_argv_single_node_gets_standalone():
    argv = build_torchrun_argv(["--nproc", "2", "examples/train_gpt.py", "--config", "c.json"])
    assert argv == ["--standalone", "--nproc-per-node", "2", "examples/train_gpt.py", "--config", "c.json"]


def test_run_argv_script_args_are_not_touched():
    argv = build_torchrun_argv(["--nproc=2", "train.py", "--nproc", "7", "--master-port", "1"])
    assert argv == ["--standalone", "--nproc-per-node", "2", "train.py", "--nproc", "7", "--master-port", "1"]


def test_run_argv_multi_node_and_passthrough():
    argv = build_torchrun_argv([
        "--nnodes", "2", "--node-rank", "1", "--master-addr", "10.0.0.1", "--master-port", "29600",
        "--max-restarts", "3", "--nproc", "8", "--log-dir", "/tmp/logs", "-r3", "--no-python",
        "--", "train.sh", "-x",
    ])
    assert argv == [
        "--nnodes", "2", "--node-rank", "1", "--master-addr", "10.0.0.1", "--master-port", "29600",
        "--max-restarts", "3", "--nproc-per-node", "8", "--log-dir", "/tmp/logs", "-r", "3",
        "--no-python", "train.sh", "-x",
    ]


def test_run_argv_rdzv_endpoint_disables_standalone():
    argv = build_torchrun_argv(["--rdzv-endpoint", "host:29400", "--rdzv-backend", "c10d", "t.py"])
    assert "--standalone" not in argv and argv[-1] == "t.py"


def test_run_argv_is_accepted_by_torchrun_parser():
    from torch.distributed.run import parse_args

    args = parse_args(build_torchrun_argv(["--nproc", "2", "t.py", "--steps", "5"]))
    assert args.nproc_per_node == "2" and args.standalone
    assert args.training_script == "t.py" and args.training_script_args == ["--steps", "5"]


@pytest.mark.parametrize("argv, message", [
    (["--nproc", "2"], "no script"),
    (["--bogus", "t.py"], "unknown torchrun option"),
    (["--nproc"], "needs a value"),
])
def test_run_argv_errors(argv, message):
    with pytest.raises(UsageError, match=message):
        build_torchrun_argv(argv)


def test_run_usage_error_exits_2(capsys):
    assert main(["run", "--bogus", "t.py"]) == 2
    assert "unknown torchrun option" in capsys.readouterr().err


# ---- env, and the commands not written yet ----

def test_env_prints_torch_version(capsys):
    assert main(["env"]) == 0
    out = capsys.readouterr().out
    assert torch.__version__ in out
    assert "gloo" in out and "cuda available" in out


def test_autotune_usage_and_errors(capsys, tmp_path):
    assert main(["autotune"]) == 2
    assert "usage: shardspeed autotune" in capsys.readouterr().out
    assert main(["run", "--autotuning", "bogus", "x.py"]) == 2
    assert "--autotuning must be tune or run" in capsys.readouterr().err
    script = tmp_path / "x.py"
    script.write_text("")
    assert main(["run", "--autotuning", "tune", "--nproc", "1", str(script), "--lr", "1"]) == 2
    assert "--deepspeed_config" in capsys.readouterr().err
    cfg = tmp_path / "c.json"
    cfg.write_text('{"train_batch_size": 4, "autotuning": {"tuner_typ": "gridsearch"}}')
    assert main(["autotune", str(script), "--deepspeed_config", str(cfg)]) == 2
    err = capsys.readouterr().err
    assert "autotuning.tuner_typ" in err and "tuner_type" in err and err.count("\n") == 1
    assert main(["autotune", str(script), "--deepspeed_config", str(tmp_path / "missing.json")]) == 2
    assert "cannot read the config" in capsys.readouterr().err


def test_run_autotuning_run_trains_with_the_optimal_command(tmp_path, monkeypatch, capsys):
    """`run --autotuning run`: tune (stubbed here), then `shardspeed run` with cmd_optimal.txt's arguments."""
    import types

    import shardspeed.autotune.search as search
    import shardspeed.cli as cli

    (tmp_path / "summary.txt").write_text("summary\n")
    (tmp_path / "cmd_optimal.txt").write_text(
        f"/usr/bin/python -m shardspeed.cli run --nproc 2 train.py --deepspeed_config {tmp_path}/ds_config_optimal.json\n")
    seen = {}

    class FakeTuner:
        def __init__(self, script, args, nproc, model_spec=None, seq_len=None):
            seen["tuner"] = (script, args, nproc)
            seen["spec"] = (model_spec, seq_len)

        def run(self):
            return types.SimpleNamespace(results_dir=str(tmp_path), best=object())

    monkeypatch.setattr(search, "Tuner", FakeTuner)
    real_run = cli._cmd_run
    monkeypatch.setattr(cli, "_cmd_run", lambda argv: seen.setdefault("run", list(argv)) and 0
                        if argv and argv[0] != "--autotuning" else real_run(argv))
    assert cli.main(["run", "--autotuning", "run", "--nproc", "2", "train.py", "--deepspeed_config", "c.json"]) == 0
    assert seen["tuner"] == ("train.py", ["--deepspeed_config", "c.json"], 2)
    assert seen["run"] == ["--nproc", "2", "train.py", "--deepspeed_config", f"{tmp_path}/ds_config_optimal.json"]
    assert "summary" in capsys.readouterr().out and seen["spec"] == (None, None)
    # --model describes the script's model on the meta device (its shape adds TP to the search)
    cfg = tmp_path / "c.json"
    cfg.write_text('{"train_batch_size": 4}')
    assert cli.main(["autotune", "--nproc", "2", "--model", "small", "--seq-len", "64", "train.py",
                     "--deepspeed_config", str(cfg)]) == 0
    spec, seq_len = seen["spec"]
    assert spec.shape is not None and spec.shape.hidden == 256 and seq_len == 64
    assert seen["tuner"] == ("train.py", ["--deepspeed_config", str(cfg)], 2)
    assert cli.main(["autotune", "--seq-len", "x", "train.py", "--deepspeed_config", str(cfg)]) == 2
    assert "--seq-len must be a positive number" in capsys.readouterr().err


# ---- run: one line per distinct shardspeed error (issue 21), the bootstrap and the summary

def test_run_wraps_the_script_in_the_bootstrap():
    import os

    from shardspeed import bootstrap
    from shardspeed.cli import _wrap_in_bootstrap

    boot = os.path.realpath(bootstrap.__file__)
    argv = build_torchrun_argv(["--nproc", "2", "--max-restarts", "1", "t.py", "-m", "x"])
    assert _wrap_in_bootstrap(argv) == ["--standalone", "--nproc-per-node", "2", "--max-restarts", "1",
                                        boot, "t.py", "-m", "x"]
    # torchrun's -m becomes the bootstrap's --module; --no-python and --run-path are left to torchrun
    assert _wrap_in_bootstrap(build_torchrun_argv(["-m", "pkg.train", "--lr", "1"])) == [
        "--standalone", boot, "--module", "pkg.train", "--lr", "1"]
    assert _wrap_in_bootstrap(build_torchrun_argv(["--no-python", "train.sh"])) is None
    assert _wrap_in_bootstrap(build_torchrun_argv(["--run-path", "t.py"])) is None


def _record(rank, type_="ConfigError", message="bad", attempt=0, world=2, local_world=2):
    from shardspeed.bootstrap import ErrorRecord

    return ErrorRecord(type=type_, module="shardspeed.errors", message=message, traceback="Traceback ...\n",
                       rank=rank, local_rank=rank % local_world, world_size=world, local_world_size=local_world,
                       attempt=attempt, pid=1000 + rank)


def test_summary_groups_identical_errors_and_names_the_ranks_of_the_others():
    from shardspeed.bootstrap import summary_lines

    assert summary_lines([_record(0), _record(1)]) == ["shardspeed: ConfigError on 2 of 2 ranks: bad"]
    lines = summary_lines([_record(r, world=4, local_world=4) for r in (0, 1, 2)]
                          + [_record(3, "DistributedError", "peer gone", world=4, local_world=4)])
    assert lines == ["shardspeed: ConfigError on 3 of 4 ranks (ranks 0-2): bad",
                     "shardspeed: DistributedError on 1 of 4 ranks (rank 3): peer gone"]
    # only the last attempt is summed up; the same error in every attempt says so
    again = [_record(0), _record(1), _record(0, attempt=1), _record(1, attempt=1)]
    assert summary_lines(again) == ["shardspeed: ConfigError on 2 of 2 ranks (in all 2 attempts): bad"]
    # one node of several: the count is of this node's ranks
    assert summary_lines([_record(2, world=4), _record(3, world=4)]) == [
        "shardspeed: ConfigError on 2 of 2 ranks on this node (ranks 2-3): bad"]


_BAD_CONFIG_SCRIPT = """\
import os
import sys
import time

import torch

import shardspeed

mode = sys.argv[1]
rank = int(os.environ["RANK"])
if mode == "mixed" and rank == 1:
    # once rank 0 has recorded its ConfigError (else torchrun may stop rank 0 before it gets there)
    shardspeed.init_distributed()
    while not os.path.exists(os.path.join(os.environ["SHARDSPEED_ERROR_DIR"], "attempt0-rank0.json")):
        time.sleep(0.05)
    raise KeyError("not a shardspeed error")
model = torch.nn.Linear(2, 2)
config = {"train_batch_size": 2, "zero_optimization": {"stag": 2}}  # a misspelt key
shardspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
"""


def _run_cli(tmp_path, *args, env=None):
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    script = tmp_path / "bad_config.py"
    script.write_text(_BAD_CONFIG_SCRIPT)
    full_env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(root), os.environ.get("PYTHONPATH")])))
    full_env.pop("SHARDSPEED_TRACEBACK", None)
    full_env["TMPDIR"] = str(tmp_path)  # the launcher's traceback log goes under pytest's tmp_path
    full_env.update(env or {})
    proc = subprocess.run([sys.executable, "-m", "shardspeed.cli", "run", *args[:-1], str(script), args[-1]],
                          cwd=tmp_path, env=full_env, capture_output=True, text=True, timeout=300)
    return proc


def test_run_prints_a_config_error_raised_on_every_rank_once(tmp_path):
    proc = _run_cli(tmp_path, "--nproc", "2", "same")
    err = proc.stderr
    assert proc.returncode == 1, err
    lines = [ln for ln in err.splitlines() if "ConfigError" in ln]
    assert lines == ["shardspeed: ConfigError on 2 of 2 ranks: unknown key 'zero_optimization.stag'; "
                     "did you mean 'stage'?"], err
    assert "Traceback" not in err and "Traceback" not in proc.stdout, err
    assert "failed (exitcode" not in err and "ChildFailedError" not in err, err  # torchrun's summary
    # the next line: where the tracebacks are
    after = err.splitlines()[err.splitlines().index(lines[0]) + 1]
    assert after.startswith("shardspeed: tracebacks in "), err
    log = after.split("tracebacks in ", 1)[1].split(" ")[0]
    assert log.startswith(str(tmp_path))
    text = open(log).read()
    assert text.count("Traceback (most recent call last)") == 2 and "---- rank 0" in text and "---- rank 1" in text
    assert "shardspeed.errors.ConfigError: unknown key 'zero_optimization.stag'" in text
    assert 'bad_config.py", line 19, in <module>' in text and "runpy" not in text and "bootstrap" not in text


def test_run_full_tracebacks_and_other_exceptions(tmp_path):
    # SHARDSPEED_TRACEBACK=1 (or --full-tracebacks): every rank prints its traceback, as under torchrun
    proc = _run_cli(tmp_path, "--nproc", "2", "same", env={"SHARDSPEED_TRACEBACK": "1"})
    assert proc.returncode == 1
    assert proc.stderr.count("ConfigError: unknown key 'zero_optimization.stag'") == 2, proc.stderr
    assert "shardspeed: ConfigError on" not in proc.stderr
    # a rank's non-shardspeed exception keeps its traceback (without the bootstrap's frames); the other
    # rank's ConfigError is one line naming its rank
    proc = _run_cli(tmp_path, "--nproc", "2", "mixed")
    err = proc.stderr
    assert proc.returncode == 1, err
    assert "shardspeed: ConfigError on 1 of 2 ranks (rank 0): unknown key 'zero_optimization.stag'" in err, err
    assert err.count("Traceback (most recent call last)") == 1 and "KeyError: 'not a shardspeed error'" in err, err
    assert "bootstrap.py" not in err and "runpy" not in err, err
