"""`shardspeed plot RUN_DIR`: the CSV monitor's loss, LR and throughput drawn into a PNG."""
from __future__ import annotations

import struct
import sys

import pytest

from shardspeed.cli import main


def _write(path, name, rows, header_again=False):
    # DeepSpeed 0.19.8's csv_monitor: header "step,<last part of the event name>", then step,value
    lines = [f"step,{name}"] + [f"{s},{v}" for s, v in rows]
    if header_again:  # a resumed run appends to the file and writes the header again
        lines.insert(3, f"step,{name}")
    path.write_text("\r\n".join(lines) + "\r\n")  # csv.writer's line ends


@pytest.fixture
def run_dir(tmp_path):
    job = tmp_path / "ds_logs" / "train_gpt"
    job.mkdir(parents=True)
    steps = [16 * i for i in range(1, 11)]
    _write(job / "Train_Samples_train_loss.csv", "train_loss", [(s, 5.5 - 0.2 * i) for i, s in enumerate(steps)],
           header_again=True)
    _write(job / "Train_Samples_lr.csv", "lr", [(s, 1e-3 * min(1, i / 5)) for i, s in enumerate(steps)])
    _write(job / "Train_Samples_samples_per_sec.csv", "samples_per_sec", [(s, 100.0 + i) for i, s in enumerate(steps)])
    return tmp_path / "ds_logs"


def _png_size(path):
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and data[12:16] == b"IHDR"
    return struct.unpack(">II", data[16:24])


def test_plot_writes_png(run_dir, tmp_path, capsys):
    pytest.importorskip("matplotlib")
    out = tmp_path / "plots" / "run.png"
    assert main(["plot", str(run_dir), "-o", str(out)]) == 0  # output_path with one job: found
    width, height = _png_size(out)
    assert width > 100 and height > 100
    assert capsys.readouterr().out.strip() == str(out)


def test_plot_default_output_in_job_dir(run_dir):
    pytest.importorskip("matplotlib")
    assert main(["plot", str(run_dir / "train_gpt")]) == 0
    assert _png_size(run_dir / "train_gpt" / "training.png")[0] > 0


def test_reader_matches_csv_monitor_format(run_dir):
    from shardspeed.monitor.csv_plot import read_run

    panels = read_run(str(run_dir / "train_gpt"))
    steps, values = panels["loss"]["train_loss"]
    assert steps[:2] == [16.0, 32.0] and len(values) == 10 and values[0] == 5.5
    assert set(panels["lr"]) == {"lr"} and set(panels["throughput"]) == {"samples_per_sec"}


@pytest.mark.parametrize("case", ["missing", "empty", "bad_csv"])
def test_bad_run_dir_one_line_error(case, tmp_path, capsys):
    target = tmp_path / "run"
    if case != "missing":
        target.mkdir()
    if case == "bad_csv":
        (target / "Train_Samples_train_loss.csv").write_text("step,train_loss\n16,abc\n")
    assert main(["plot", str(target)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("shardspeed plot: ") and "\n" not in err


def test_missing_matplotlib_names_it(run_dir, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)
    assert main(["plot", str(run_dir)]) == 2
    err = capsys.readouterr().err.strip()
    assert "matplotlib" in err and "\n" not in err
