"""``tensorboard``: scalars through ``torch.utils.tensorboard.SummaryWriter`` in ``{output_path}/{job_name}``."""
from __future__ import annotations

import os
from typing import List

from .sink import Event, Sink, require


class TensorBoardMonitor(Sink):
    def __init__(self, output_path: str, job_name: str):
        require("tensorboard", "tensorboard", "tensorboard")
        from torch.utils.tensorboard import SummaryWriter

        self.log_dir = os.path.join(output_path, job_name)
        os.makedirs(self.log_dir, exist_ok=True)
        self.writer = SummaryWriter(log_dir=self.log_dir)

    def write_events(self, events: List[Event]) -> None:
        for name, value, step in events:
            self.writer.add_scalar(name, value, step)
        self.writer.flush()  # as DeepSpeed: every batch of events is on disk when write_events returns

    def close(self) -> None:
        self.writer.close()
