"""DeepSpeed's results layout: ``<results_dir>/<exp>/{ds_config.json, cmd.txt, metrics.json, stdout.log,
stderr.log}``, ``<exps_dir>/<exp>.json``, ``summary.txt``, ``ds_config_optimal.json``, ``cmd_optimal.txt``."""
from __future__ import annotations

import json
import os
import shlex
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence

from ..config.secrets import mask_secrets
from .model import Prediction
from .space import Candidate

_GB = 1e9


@dataclass
class CandidateRecord:
    """Everything known about one candidate, for the summary."""

    candidate: Candidate
    prediction: Optional[Prediction] = None
    measured_time_s: List[float] = field(default_factory=list)
    measured_memory: Optional[float] = None
    status: str = "not run"  # best, ran, over budget, failed: ..., timeout, pruned: ..., not run: ...

    @property
    def time_s(self) -> Optional[float]:
        """The mean of this candidate's measured step times (paired reruns included)."""
        return sum(self.measured_time_s) / len(self.measured_time_s) if self.measured_time_s else None


def write_experiment(results_dir: str, exps_dir: str, name: str, ds_config: Dict[str, Any],
                     cmd: Sequence[str]) -> str:
    """The experiment's directory with ds_config.json and cmd.txt (and its description in exps_dir)."""
    exp_dir = os.path.join(results_dir, name)
    os.makedirs(exp_dir, exist_ok=True)
    os.makedirs(exps_dir, exist_ok=True)
    with open(os.path.join(exp_dir, "ds_config.json"), "w") as f:
        json.dump(ds_config, f, indent=2)
    with open(os.path.join(exp_dir, "cmd.txt"), "w") as f:
        f.write(shlex.join(cmd) + "\n")
    with open(os.path.join(exps_dir, f"{name}.json"), "w") as f:
        json.dump({"name": name, "ds_config": mask_secrets(ds_config), "result_dir": exp_dir, "cmd": list(cmd)}, f,
                  indent=2)
    return exp_dir


def _fmt(x: Optional[float], scale: float = 1.0, digits: int = 3) -> str:
    return "-" if x is None else f"{x / scale:.{digits}f}"


def summary_table(records: Sequence[CandidateRecord], header: str = "") -> str:
    """One line per candidate: its settings, predicted memory and time, measured where run, and status."""
    cols = ("exp", "stage", "mbs", "gas", "off_opt", "off_param", "bucket", "ckpt", "tp", "pred_dev_GB",
            "pred_host_GB", "pred_step_s", "meas_step_s", "meas_mem_GB", "status")
    rows = []
    order = sorted(records, key=lambda r: (r.time_s is None, r.time_s or 0.0,
                                           r.prediction.step_time_s if r.prediction else 0.0))
    for r in order:
        c, p = r.candidate, r.prediction
        rows.append((c.name, str(c.stage), str(c.micro_batch), str(c.grad_accum), "y" if c.offload_optimizer else "-",
                     "y" if c.offload_param else "-", str(c.reduce_bucket_size or "user"),
                     "y" if c.activation_checkpointing else "-", str(c.tp),
                     _fmt(p.device_bytes if p else None, _GB), _fmt(p.host_bytes if p else None, _GB),
                     _fmt(p.step_time_s if p else None), _fmt(r.time_s), _fmt(r.measured_memory, _GB), r.status))
    widths = [max(len(h), *(len(row[i]) for row in rows)) if rows else len(h) for i, h in enumerate(cols)]
    lines = [header] if header else []
    lines.append("  ".join(h.ljust(w) for h, w in zip(cols, widths)))
    lines += ["  ".join(v.ljust(w) for v, w in zip(row, widths)) for row in rows]
    return "\n".join(lines) + "\n"


def write_summary(results_dir: str, records: Sequence[CandidateRecord], header: str) -> str:
    path = os.path.join(results_dir, "summary.txt")
    with open(path, "w") as f:
        f.write(summary_table(records, header))
    return path


def optimal_config_path(results_dir: str) -> str:
    return os.path.abspath(os.path.join(results_dir, "ds_config_optimal.json"))


def write_optimal(results_dir: str, ds_config: Dict[str, Any], cmd: Sequence[str]) -> Dict[str, Any]:
    """``ds_config_optimal.json`` (the winner's config without the autotuning block, as DeepSpeed writes
    it) and ``cmd_optimal.txt`` (``cmd``, which should point at that file). Returns the config written."""
    cfg = {k: v for k, v in ds_config.items() if k != "autotuning"}
    with open(optimal_config_path(results_dir), "w") as f:
        json.dump(cfg, f, indent=2)
    with open(os.path.join(results_dir, "cmd_optimal.txt"), "w") as f:
        f.write(shlex.join(cmd) + "\n")
    return cfg
