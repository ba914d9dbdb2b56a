"""What every monitor sink shares: the event tuple, the sink interface, and the check for optional packages."""
from __future__ import annotations

import importlib
from typing import Any, List, Tuple

from ..errors import ConfigError

#: ``(name, value, step)``: DeepSpeed's event tuple; ``step`` is the number of samples trained so far (all ranks).
Event = Tuple[str, float, int]


class Sink:
    """One destination of events (a CSV directory, a TensorBoard writer, a W&B or Comet run)."""

    def write_events(self, events: List[Event]) -> None:  # pragma: no cover - interface
        raise NotImplementedError

    def close(self) -> None:
        """Flush and release what the sink holds (called at interpreter exit and by ``MonitorMaster.close``)."""


def require(module: str, block: str, pip: str) -> Any:
    """Import ``module`` for the config block ``block``, or raise a one-line :class:`ConfigError` naming the
    missing package and the pip command. Every rank calls it at ``initialize`` so all of them fail together."""
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise ConfigError(f"{block}.enabled is true but the {module} package is not installed ({exc}): "
                          f"pip install {pip}, or disable {block}") from None
