"""Environment variables (issue 35): read when used, never at import; a bad value is one ConfigError line
naming the variable, the value and what it may be."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from shardspeed.errors import ConfigError
from shardspeed.utils import env

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.parametrize("value", ["abc", "nan", "0", "-5", "inf"])
def test_bad_timeout_is_one_line(monkeypatch, value):
    monkeypatch.setenv("SHARDSPEED_TIMEOUT", value)
    with pytest.raises(ConfigError) as info:
        env.collective_timeout_s()
    assert str(info.value) == (f"environment variable SHARDSPEED_TIMEOUT={value!r} is invalid: it must be a finite "
                               "number of seconds > 0 (e.g. 600)")


def test_values_read_at_use_time(monkeypatch):
    monkeypatch.delenv("SHARDSPEED_TIMEOUT", raising=False)
    assert env.collective_timeout_s() == 600.0
    monkeypatch.setenv("SHARDSPEED_TIMEOUT", " 12.5 ")
    assert env.collective_timeout_s() == 12.5
    monkeypatch.setenv("SHARDSPEED_ERROR_WAIT", "0")
    assert env.error_wait_s() == 0.0
    for value, want in (("0", False), ("off", False), ("1", True), ("TRUE", True), ("", True)):
        monkeypatch.setenv("SHARDSPEED_VERIFY_SWAP", value)
        assert env.verify_swap() is want


@pytest.mark.parametrize("name,value,expected", [
    ("SHARDSPEED_ERROR_WAIT", "-1", "a finite number of seconds >= 0"),
    ("SHARDSPEED_VERIFY_SWAP", "maybe", "1 or 0"),
    ("SHARDSPEED_TRACEBACK", "2", "1 or 0"),
])
def test_other_variables_are_checked(monkeypatch, name, value, expected):
    monkeypatch.setenv(name, value)
    with pytest.raises(ConfigError, match=f"^environment variable {name}='{value}' is invalid: it must be {expected}"):
        env.check_environment()


def test_import_survives_a_bad_timeout_and_init_refuses_it():
    code = ("import shardspeed, shardspeed.mesh as m\n"
            "try:\n    m.init_distributed(backend='gloo')\n"
            "except shardspeed.errors.ConfigError as e:\n    print('REFUSED', e)\n"
            "import torch.distributed as dist; print('INITIALISED', dist.is_initialized())\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT,
                          env=dict(os.environ, SHARDSPEED_TIMEOUT="abc", PYTHONPATH=ROOT))
    assert proc.returncode == 0, proc.stderr
    assert "REFUSED environment variable SHARDSPEED_TIMEOUT='abc' is invalid" in proc.stdout
    assert "INITIALISED False" in proc.stdout


def test_launcher_refuses_a_bad_variable_before_starting_workers(monkeypatch, capsys, tmp_path):
    from shardspeed.cli import main

    script = tmp_path / "train.py"
    marker = tmp_path / "ran"
    script.write_text(f"open({str(marker)!r}, 'w').close()\n")
    monkeypatch.setenv("SHARDSPEED_TIMEOUT", "nan")
    assert main(["run", "--nproc", "1", str(script)]) == 2
    err = capsys.readouterr().err.strip()
    assert err == ("shardspeed run: error: environment variable SHARDSPEED_TIMEOUT='nan' is invalid: it must be a "
                   "finite number of seconds > 0 (e.g. 600)")
    assert not marker.exists()


def test_bootstrap_error_wait_falls_back_with_its_line(monkeypatch, capsys):
    from shardspeed import bootstrap

    monkeypatch.setenv("SHARDSPEED_ERROR_WAIT", "soon")
    assert bootstrap._error_wait() == 3.0
    assert "SHARDSPEED_ERROR_WAIT='soon' is invalid" in capsys.readouterr().err


def _save_with_a_garbage_crash_variable(root: str):
    from models import make_model

    import shardspeed

    os.environ["SHARDSPEED_CKPT_CRASH"] = "after_files=garbage@nobody"  # once a test hook read by the package
    engine, *_ = shardspeed.initialize(model=make_model("mlp"), config={
        "train_batch_size": 2, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}})
    engine.save_checkpoint(root, tag="t")
    return sorted(os.listdir(root))


def test_checkpoint_crash_variable_is_not_read(tmp_path):
    from distributed import run_distributed

    assert run_distributed(_save_with_a_garbage_crash_variable, 1, str(tmp_path))[0] == ["latest", "t"]
