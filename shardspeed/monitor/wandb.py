"""``wandb``: ``wandb.init(project=..., group=..., entity=team)`` then one ``wandb.log`` per event."""
from __future__ import annotations

from typing import List, Optional

from .sink import Event, Sink, require


class WandbMonitor(Sink):
    def __init__(self, project: str, group: Optional[str], team: Optional[str]):
        self._wandb = require("wandb", "wandb", "wandb")
        self.run = self._wandb.init(project=project, group=group, entity=team)

    def write_events(self, events: List[Event]) -> None:
        for name, value, step in events:
            self._wandb.log({name: value}, step=step)

    def close(self) -> None:
        self._wandb.finish()
