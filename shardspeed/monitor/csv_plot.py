"""`shardspeed plot RUN_DIR`: draw loss, LR and throughput from the CSV monitor's files into a PNG.

The files are DeepSpeed's csv_monitor layout: ``{output_path}/{job_name}/{event name with '/' -> '_'}.csv``
(``Train_Samples_train_loss.csv``, ``Train_Samples_lr.csv``, ...), each starting with the header row
``step,<last part of the event name>`` and then ``step,value`` rows keyed by global samples. DeepSpeed
appends, so a resumed run may repeat the header further down; such rows are skipped. RUN_DIR is the job
directory or an output_path holding exactly one job directory. matplotlib is imported only here.
"""
from __future__ import annotations

import csv
import os
from typing import Dict, List, Optional, Tuple

Series = Tuple[List[float], List[float]]

LOSS_FILE = "Train_Samples_train_loss.csv"
LR_FILE = "Train_Samples_lr.csv"
# Substrings of file names drawn in the throughput panel.
THROUGHPUT_MARKERS = ("samples_per_sec", "tokens_per_sec", "throughput", "tflops")


class PlotError(ValueError):
    """A run directory that cannot be plotted (one line)."""


def find_job_dir(run_dir: str) -> str:
    """The directory holding the CSV files: run_dir itself, or its only job sub-directory that has them."""
    if not os.path.isdir(run_dir):
        raise PlotError(f"'{run_dir}' is not a directory")
    if any(name.endswith(".csv") for name in os.listdir(run_dir)):
        return run_dir
    jobs = sorted(d for d in os.listdir(run_dir) if os.path.isdir(os.path.join(run_dir, d))
                  and any(n.endswith(".csv") for n in os.listdir(os.path.join(run_dir, d))))
    if len(jobs) == 1:
        return os.path.join(run_dir, jobs[0])
    if not jobs:
        raise PlotError(f"no CSV monitor files in '{run_dir}' (expected {{output_path}}/{{job_name}}/"
                        f"{LOSS_FILE}, as written with \"csv_monitor\": {{\"enabled\": true}})")
    raise PlotError(f"'{run_dir}' holds several jobs ({', '.join(jobs)}): give one of them")


def read_series(path: str) -> Tuple[str, Series]:
    """(column name, (steps, values)) of one csv_monitor file."""
    steps: List[float] = []
    values: List[float] = []
    name = ""
    with open(path, newline="", encoding="utf-8") as f:
        for lineno, row in enumerate(csv.reader(f), 1):
            if not row:
                continue
            if len(row) != 2:
                raise PlotError(f"{path}, line {lineno}: expected 2 columns (step,value), got {len(row)}")
            if row[0] == "step":  # the header (repeated when a resumed run appended to the file)
                name = name or row[1]
                continue
            try:
                steps.append(float(row[0]))
                values.append(float(row[1]))
            except ValueError:
                raise PlotError(f"{path}, line {lineno}: not numbers: {','.join(row)}") from None
    if not name:
        raise PlotError(f"{path}: no 'step,<name>' header row (not a csv_monitor file)")
    return name, (steps, values)


def read_run(job_dir: str) -> Dict[str, Dict[str, Series]]:
    """The series to draw, by panel ("loss", "lr", "throughput") and name."""
    panels: Dict[str, Dict[str, Series]] = {"loss": {}, "lr": {}, "throughput": {}}
    for filename in sorted(os.listdir(job_dir)):
        if not filename.endswith(".csv"):
            continue
        panel: Optional[str] = None
        if filename == LOSS_FILE:
            panel = "loss"
        elif filename == LR_FILE:
            panel = "lr"
        elif any(marker in filename for marker in THROUGHPUT_MARKERS):
            panel = "throughput"
        if panel is not None:
            name, series = read_series(os.path.join(job_dir, filename))
            panels[panel][name] = series
    if not panels["loss"] and not panels["lr"]:
        raise PlotError(f"no {LOSS_FILE} or {LR_FILE} in '{job_dir}'")
    return panels


def plot_run(run_dir: str, out: Optional[str] = None) -> str:
    """Draw the run's loss, LR and throughput panels into a PNG; returns its path."""
    job_dir = find_job_dir(run_dir)
    panels = read_run(job_dir)
    try:
        from matplotlib.figure import Figure
    except ImportError:
        raise PlotError("shardspeed plot needs matplotlib: pip install matplotlib") from None
    out = out or os.path.join(job_dir, "training.png")
    fig = Figure(figsize=(8, 9), layout="constrained")
    axes = fig.subplots(3, 1, sharex=True)
    titles = {"loss": "train loss", "lr": "learning rate", "throughput": "throughput"}
    for ax, (panel, series) in zip(axes, panels.items()):
        ax.set_title(titles[panel])
        for name, (steps, values) in series.items():
            ax.plot(steps, values, label=name)
        if len(series) > 1 or panel == "throughput":
            if series:
                ax.legend(loc="best", fontsize="small")
        if not series:
            ax.text(0.5, 0.5, "no data", ha="center", va="center", transform=ax.transAxes)
        ax.grid(True, alpha=0.3)
    axes[-1].set_xlabel("samples")
    fig.suptitle(os.path.basename(os.path.normpath(job_dir)))
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    fig.savefig(out, format="png", dpi=100)
    return out


__all__ = ["plot_run", "read_run", "read_series", "find_job_dir", "PlotError"]
