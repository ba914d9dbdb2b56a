"""``comet``: a ``comet_ml.start(...)`` experiment; each event name is logged at most once per
``samples_log_interval`` samples (the first event of a name always), as DeepSpeed does."""
from __future__ import annotations

from typing import Any, Dict, List, Optional

from ..errors import ConfigError
from .sink import Event, Sink, require

MIN_COMET_VERSION = (3, 41, 0)


def _version(text: str) -> tuple:
    parts = []
    for piece in text.split(".")[:3]:
        digits = "".join(ch for ch in piece if ch.isdigit())
        parts.append(int(digits) if digits else 0)
    return tuple(parts)


def require_comet() -> Any:
    comet_ml = require("comet_ml", "comet", '"comet_ml>=3.41.0"')
    if _version(getattr(comet_ml, "__version__", "0")) < MIN_COMET_VERSION:
        raise ConfigError(f"comet.enabled is true but comet_ml {comet_ml.__version__} is installed; it needs "
                          f'comet_ml>=3.41.0: pip install "comet_ml>=3.41.0", or disable comet')
    return comet_ml


class CometMonitor(Sink):
    def __init__(self, samples_log_interval: int = 100, project: Optional[str] = None,
                 workspace: Optional[str] = None, api_key: Optional[str] = None,
                 experiment_name: Optional[str] = None, experiment_key: Optional[str] = None,
                 online: Optional[bool] = None, mode: Optional[str] = None):
        comet_ml = require_comet()
        self.samples_log_interval = samples_log_interval
        self.experiment = comet_ml.start(api_key=api_key, project=project, workspace=workspace,
                                         experiment_key=experiment_key, mode=mode, online=online)
        if experiment_name is not None:
            self.experiment.set_name(experiment_name)
        self._last_logged: Dict[str, int] = {}

    def _due(self, name: str, step: int) -> bool:
        last = self._last_logged.get(name)
        if last is None or step - last >= self.samples_log_interval:
            self._last_logged[name] = step
            return True
        return False

    def write_events(self, events: List[Event]) -> None:
        for name, value, step in events:
            if self._due(name, step):
                self.experiment.log_metric(name, value, step=step)

    def close(self) -> None:
        self.experiment.end()
