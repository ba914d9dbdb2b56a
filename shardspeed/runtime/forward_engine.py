"""The engine ``initialize`` builds without an optimizer (no ``optimizer`` block, no ``optimizer=``), as
DeepSpeed does for inference or a frozen reference model (TRL's ``prepare_deepspeed``): the same engine,
parameters placed and (stage 3) sharded and gathered per unit in forward, with nothing to train. Its
``backward`` and ``step`` fail with one line."""
from __future__ import annotations

import torch

from ..errors import ShardspeedError
from .engine import Engine

_NO_TRAINING = ("{what} on an engine built without an optimizer (no 'optimizer' block in the config and no "
                "optimizer= to initialize): it runs forward only; add an optimizer to train")


class ForwardEngine(Engine):
    """An :class:`Engine` for forward only: ``engine(x)`` (under ``torch.no_grad()`` for inference),
    ``engine.eval()``, ``state_dict`` / ``save_16bit_model`` as usual; ``engine.optimizer`` is None."""

    def backward(self, loss: torch.Tensor, retain_graph: bool = False, scale_wrt_gas: bool = True) -> torch.Tensor:
        raise ShardspeedError(_NO_TRAINING.format(what="backward()"))

    def step(self) -> None:
        raise ShardspeedError(_NO_TRAINING.format(what="step()"))

    def boundary_step(self, before_optimizer=None) -> None:
        raise ShardspeedError(_NO_TRAINING.format(what="step()"))

    def get_lr(self):
        return []
