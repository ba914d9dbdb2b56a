"""DeepSpeed's ``RepeatingLoader``: a loader read for ever, one epoch after another."""
from __future__ import annotations

from typing import Any, Iterable


class RepeatingLoader:
    """DeepSpeed's ``RepeatingLoader`` (``deepspeed.utils`` / ``deepspeed.runtime.dataloader``): iterates
    ``loader`` for ever, starting it again (its next epoch) when it ends. A pipeline engine's
    ``train_batch()`` reads ``initialize(training_data=...)``'s loader through one."""

    def __init__(self, loader: Iterable):
        self.loader = loader
        self.data_iter = iter(loader)

    def __iter__(self) -> RepeatingLoader:
        return self

    def __next__(self) -> Any:
        try:
            return next(self.data_iter)
        except StopIteration:
            self.data_iter = iter(self.loader)
            return next(self.data_iter)  # an empty loader still ends
