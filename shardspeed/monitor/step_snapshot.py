"""What one optimizer step leaves behind, as the engine hands it to the parts that report on it (the
``steps_per_print`` line, the progress bar, the monitors' events): a typed, frozen snapshot of its counters."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Tuple

import torch


@dataclass(frozen=True)
class StepSnapshot:
    """The engine's counters right after an optimizer step (skipped or not)."""

    step: int  #: ``global_steps`` after the step
    samples: int  #: ``global_samples`` after the step
    batch: int  #: samples in this step (``train_batch_size``)
    loss: Optional[torch.Tensor]  #: the last loss given to the engine, not converted: no host sync until shown
    lrs: Tuple[float, ...]  #: each parameter group's LR, after the schedule's step
    loss_scale: float  #: the loss scale in use now (1.0 unless fp16)
    grad_norm: Optional[float]  #: the global gradient norm of the step; None when skipped or not computed
