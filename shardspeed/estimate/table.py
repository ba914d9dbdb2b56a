"""The ``shardspeed estimate`` peak table: one model, one base config, every stage × offload choice."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence, Tuple

from ..errors import ConfigError
from ..plan import zero_variant
from .model import ModelSpec
from .peak import PeakEstimate, estimate_peak

#: (optimizer offload device, parameter offload device) rows tried at each stage
OFFLOADS: Tuple[Tuple[str, str], ...] = (("none", "none"), ("cpu", "none"), ("nvme", "none"), ("cpu", "cpu"),
                                         ("nvme", "nvme"))


@dataclass(frozen=True)
class PeakRow:
    stage: int
    offload_optimizer: str
    offload_param: str
    estimate: PeakEstimate

    @property
    def offload(self) -> str:
        parts = [f"optim:{self.offload_optimizer}" if self.offload_optimizer != "none" else "",
                 f"param:{self.offload_param}" if self.offload_param != "none" else ""]
        return "+".join(p for p in parts if p) or "-"


def config_for(base: Dict[str, Any], stage: int, optim: str, param: str, nvme_path: str = "/local_nvme"
               ) -> Dict[str, Any]:
    """``base`` at ``stage`` with the offload devices ``optim`` and ``param`` (:func:`shardspeed.plan.zero_variant`)."""
    return zero_variant(base, stage, optim, param, nvme_path)


def peak_rows(spec: ModelSpec, base: Dict[str, Any], *, world_size: int, stages: Sequence[int] = (0, 1, 2, 3),
              offloads: Optional[Sequence[Tuple[str, str]]] = None, **kwargs) -> List[PeakRow]:
    """An estimate for every (stage, offload) pair whose plan :func:`shardspeed.plan.decide` accepts (optimizer
    offload needs stages 1-3, parameter offload stage 3, ``zero_init`` stage 3); ``kwargs`` go to
    :func:`estimate_peak`. Raises the first pair's ConfigError when no pair is accepted."""
    rows: List[PeakRow] = []
    first: Optional[ConfigError] = None
    for stage in stages:
        for optim, param in offloads or OFFLOADS:
            try:
                if param != "none" and stage != 3:  # a config may carry it (ignored, as DeepSpeed): not a row
                    raise ConfigError(f"offload_param needs stage 3 (stage is {stage})")
                est = estimate_peak(spec, config_for(base, stage, optim, param), world_size=world_size, **kwargs)
            except ConfigError as e:  # a contradiction of this pair (or of every pair: raised below)
                first = first or e
                continue
            rows.append(PeakRow(stage, optim, param, est))
    if not rows and first is not None:
        raise first
    return rows


def format_rows(rows: Sequence[PeakRow]) -> str:
    """A table in GB (1e9 bytes), or MB when every figure is below 1 GB."""
    big = max((max(r.estimate.device, r.estimate.host, r.estimate.nvme) for r in rows), default=0.0) >= 1e9
    gb, u = (1e9, "GB") if big else (1e6, "MB")
    head = "{:<6}{:<22}{:>12}{:>11}{:>10}{:>11}{:>14}  {}".format(
        "stage", "offload", f"device {u}", f"host {u}", f"nvme {u}", f"states {u}", "activations", "peak at")
    out = [head]
    for r in rows:
        e = r.estimate
        states = sum(e.model_states.values())
        out.append("{:<6}{:<22}{:>12.2f}{:>11.2f}{:>10.2f}{:>11.2f}{:>14.2f}  {}".format(
            r.stage, r.offload, e.device / gb, e.host / gb, e.nvme / gb, states / gb,
            e.terms.get("activations", 0.0) / gb,
            "start-up" if e.startup_device > sum(v for k, v in e.terms.items() if not k.endswith("_host"))
            else e.phase))
    return "\n".join(out)


def rows_json(rows: Sequence[PeakRow]) -> List[Dict[str, Any]]:
    return [{"stage": r.stage, "offload_optimizer": r.offload_optimizer, "offload_param": r.offload_param,
             **r.estimate.as_dict()} for r in rows]
