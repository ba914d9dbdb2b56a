"""One job: DeepSpeed's LR schedules (same formulas, defaults and checkpoint state), built by ``build_scheduler``.

Conventions shared by all five (as in DeepSpeed): ``last_batch_iteration`` counts the ``step()`` calls
so far, starting at -1; the constructor already writes the lr for iteration -1 into the optimizer (for
WarmupLR/WarmupDecayLR that is ``warmup_min_lr``, for WarmupCosineLR 0, for OneCycle ``cycle_min_lr``,
for LRRangeTest ``lr_range_test_min_lr``), so the first optimizer step runs at that lr. Values given as
lists are per param group. ``state_dict()`` is ``{"last_batch_iteration": n}``, the same as DeepSpeed
writes into its checkpoints; ``load_state_dict`` also re-applies the lr (and momentum) of that
iteration to the optimizer, so a resumed run is right even when the optimizer state was not loaded.

Deliberate differences from DeepSpeed: bad arguments raise :class:`ConfigError` (DeepSpeed logs a
warning for an unknown ``warmup_type`` and falls back to log); OneCycle keeps each group's own beta2
when cycling momentum (DeepSpeed overwrites it with 0.99); ``get_last_lr()`` works before the first
``step()`` (DeepSpeed asserts).
"""

from __future__ import annotations

import inspect
import logging
import math
from types import MappingProxyType
from typing import Any, Dict, List, Optional, Protocol, Sequence, Tuple, runtime_checkable

import torch

from shardspeed.errors import ConfigError

logger = logging.getLogger(__name__)

__all__ = [
    "WarmupLR",
    "WarmupDecayLR",
    "WarmupCosineLR",
    "OneCycle",
    "LRRangeTest",
    "build_scheduler",
    "DEEPSPEED_SCHEDULER_NAMES",
]

WARMUP_TYPES = ("log", "linear")


def _unwrap(optimizer):
    """The torch optimizer inside an engine/wrapper (anything with ``.optimizer``), or itself."""
    if isinstance(optimizer, torch.optim.Optimizer):
        return optimizer
    inner = getattr(optimizer, "optimizer", None)
    if isinstance(inner, torch.optim.Optimizer):
        return inner
    if hasattr(optimizer, "param_groups"):
        return optimizer
    raise TypeError(f"{type(optimizer).__name__} is not a torch.optim.Optimizer and does not wrap one")


def _per_group(optimizer, value, name: str) -> List[Any]:
    n = len(optimizer.param_groups)
    if isinstance(value, (list, tuple)):
        if len(value) != n:
            raise ConfigError(f"scheduler.params.{name} has {len(value)} values but the optimizer has {n} param groups")
        return list(value)
    return [value] * n


def _positive_int(value, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value != int(value) or value <= 0:
        raise ConfigError(f"scheduler.params.{name} must be a positive integer, got {value!r}")
    return int(value)


def _check_warmup_type(warmup_type: str) -> str:
    if warmup_type not in WARMUP_TYPES:
        raise ConfigError(f"scheduler.params.warmup_type must be one of {WARMUP_TYPES}, got {warmup_type!r}")
    return warmup_type


def _warmup_gamma(it: int, num_steps: int, warmup_type: str) -> float:
    """Warmup fraction at iteration ``it`` (< num_steps): log(it+1)/log(N) or it/N."""
    if warmup_type == "log":
        return math.log(it + 1) / math.log(num_steps)
    return it / num_steps


@runtime_checkable
class SchedulerLike(Protocol):
    """What the engine needs of an LR scheduler: ``step()`` once per optimizer step (one of this module's, a
    torch scheduler or a user's; ``state_dict``/``load_state_dict`` too if it is to be checkpointed)."""

    def step(self, *args: Any, **kwargs: Any) -> Any: ...


class _Schedule:
    """Shared plumbing: iteration counter, writing lrs into the optimizer, state dict."""

    def __init__(self, optimizer, last_batch_iteration: int) -> None:
        self.optimizer = _unwrap(optimizer)
        self.last_batch_iteration = int(last_batch_iteration)
        self._last_lr: Optional[List[float]] = None

    def get_lr(self) -> List[float]:  # pragma: no cover - abstract
        raise NotImplementedError

    def _apply(self) -> None:
        for group, lr in zip(self.optimizer.param_groups, self.get_lr()):
            if isinstance(group["lr"], torch.Tensor):
                group["lr"].fill_(lr)
            else:
                group["lr"] = lr
        self._last_lr = [g["lr"] for g in self.optimizer.param_groups]

    def step(self, last_batch_iteration: Optional[int] = None) -> None:
        """Advance one iteration (or jump to ``last_batch_iteration``) and set the optimizer's lr."""
        self.last_batch_iteration = (
            self.last_batch_iteration + 1 if last_batch_iteration is None else int(last_batch_iteration)
        )
        self._apply()

    def get_last_lr(self) -> List[float]:
        """The lrs last written into the optimizer's param groups."""
        if self._last_lr is None:
            return [g["lr"] for g in self.optimizer.param_groups]
        return list(self._last_lr)

    def state_dict(self) -> Dict[str, Any]:
        return {"last_batch_iteration": self.last_batch_iteration}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        self.last_batch_iteration = int(state["last_batch_iteration"])
        self._apply()


class WarmupLR(_Schedule):
    """lr = min + (max - min) * gamma; gamma = log(it+1)/log(N) (or it/N for "linear") while it < N,
    then 1. ``warmup_max_lr`` defaults to each group's current lr; N is at least 2."""

    def __init__(
        self,
        optimizer,
        warmup_min_lr: float = 0.0,
        warmup_max_lr: Optional[float] = None,
        warmup_num_steps: int = 1000,
        warmup_type: str = "log",
        last_batch_iteration: int = -1,
    ) -> None:
        super().__init__(optimizer, last_batch_iteration)
        num_steps = _positive_int(warmup_num_steps, "warmup_num_steps")
        max_lr = (warmup_max_lr if warmup_max_lr is not None
                  else [float(g["lr"]) for g in self.optimizer.param_groups])
        self.min_lrs = _per_group(self.optimizer, warmup_min_lr, "warmup_min_lr")
        self.max_lrs = _per_group(self.optimizer, max_lr, "warmup_max_lr")
        self.delta_lrs = [hi - lo for hi, lo in zip(self.max_lrs, self.min_lrs)]
        self.warmup_num_steps = max(2, num_steps)
        self.warmup_type = _check_warmup_type(warmup_type)
        if self.last_batch_iteration == -1:
            self._apply()

    def _gamma(self) -> float:
        if self.last_batch_iteration < self.warmup_num_steps:
            return _warmup_gamma(self.last_batch_iteration, self.warmup_num_steps, self.warmup_type)
        return 1.0

    def get_lr(self) -> List[float]:
        if self.last_batch_iteration < 0:
            return list(self.min_lrs)
        gamma = self._gamma()
        return [lo + d * gamma for lo, d in zip(self.min_lrs, self.delta_lrs)]


class WarmupDecayLR(WarmupLR):
    """WarmupLR's warmup, then linear decay: gamma = max(0, (T - it) / max(1, T - N)).
    Note DeepSpeed's default ``warmup_max_lr`` here is 0.001, not the optimizer's lr."""

    def __init__(
        self,
        optimizer,
        total_num_steps: int,
        warmup_min_lr: float = 0.0,
        warmup_max_lr: float = 0.001,
        warmup_num_steps: int = 1000,
        warmup_type: str = "log",
        last_batch_iteration: int = -1,
    ) -> None:
        self.total_num_steps = _positive_int(total_num_steps, "total_num_steps")
        super().__init__(optimizer, warmup_min_lr, warmup_max_lr, warmup_num_steps, warmup_type, last_batch_iteration)
        if self.total_num_steps < self.warmup_num_steps:
            logger.warning(
                "WarmupDecayLR: total_num_steps %d is less than warmup_num_steps %d",
                self.total_num_steps,
                self.warmup_num_steps,
            )

    def _gamma(self) -> float:
        if self.last_batch_iteration < self.warmup_num_steps:
            return _warmup_gamma(self.last_batch_iteration, self.warmup_num_steps, self.warmup_type)
        return max(
            0.0,
            float(self.total_num_steps - self.last_batch_iteration)
            / float(max(1.0, self.total_num_steps - self.warmup_num_steps)),
        )


class WarmupCosineLR(_Schedule):
    """lr = base_lr * ratio. Warmup (it < N): ratio = min_ratio + (1 - min_ratio) * gamma (log or
    linear as WarmupLR). Then with p = min(1, (it - N + 1) / max(1, T - N)):
    ratio = max(0, cos_min_ratio + (1 - cos_min_ratio) * (1 + cos(pi * p)) / 2).
    ``base_lr`` is each group's lr when the schedule is built; before the first step the lr is 0."""

    def __init__(
        self,
        optimizer,
        total_num_steps: int,
        warmup_min_ratio: float = 0.0,
        warmup_num_steps: int = 1000,
        cos_min_ratio: float = 0.0001,
        warmup_type: str = "log",
        last_batch_iteration: int = -1,
    ) -> None:
        super().__init__(optimizer, last_batch_iteration)
        self.total_num_steps = _positive_int(total_num_steps, "total_num_steps")
        self.warmup_num_steps = max(2, _positive_int(warmup_num_steps, "warmup_num_steps"))
        self.warmup_min_ratio = warmup_min_ratio
        self.cos_min_ratio = cos_min_ratio
        self.warmup_type = _check_warmup_type(warmup_type)
        if self.total_num_steps < self.warmup_num_steps:
            logger.warning(
                "WarmupCosineLR: total_num_steps %d is less than warmup_num_steps %d",
                self.total_num_steps,
                self.warmup_num_steps,
            )
        self.org_lrs = [
            g["lr"].item() if isinstance(g["lr"], torch.Tensor) else g["lr"] for g in self.optimizer.param_groups
        ]
        if self.last_batch_iteration == -1:
            self._apply()

    def get_lr_ratio(self) -> float:
        it = self.last_batch_iteration
        if it < 0:
            return 0.0
        if it < self.warmup_num_steps:
            gamma = _warmup_gamma(it, self.warmup_num_steps, self.warmup_type)
            return self.warmup_min_ratio + gamma * (1.0 - self.warmup_min_ratio)
        progress = min(1.0, (it - self.warmup_num_steps + 1) / max(1, self.total_num_steps - self.warmup_num_steps))
        cosine = (1 + math.cos(math.pi * progress)) / 2
        return max(0.0, self.cos_min_ratio + (1.0 - self.cos_min_ratio) * cosine)

    def get_lr(self) -> List[float]:
        ratio = self.get_lr_ratio()
        return [lr * ratio for lr in self.org_lrs]


class OneCycle(_Schedule):
    """1Cycle (Smith 2018): lr rises from ``cycle_min_lr`` to ``cycle_max_lr`` over
    ``cycle_first_step_size`` iterations and falls back over ``cycle_second_step_size`` (default: the
    first), optionally in stairs; afterwards lr = cycle_min_lr / (1 + decay_lr_rate * k /
    decay_step_size) with k the iterations past the cycle (no decay when either is 0). With
    ``cycle_momentum`` (only for optimizers with ``betas``), beta1 moves inversely between
    ``cycle_max_mom`` and ``cycle_min_mom``, and after the cycle = cycle_max_mom * (1 + decay_mom_rate *
    k / decay_step_size)."""

    def __init__(
        self,
        optimizer,
        cycle_min_lr: float,
        cycle_max_lr: float,
        decay_lr_rate: float = 0.0,
        cycle_first_step_size: int = 2000,
        cycle_second_step_size: Optional[int] = None,
        cycle_first_stair_count: int = 0,
        cycle_second_stair_count: Optional[int] = None,
        decay_step_size: int = 0,
        cycle_momentum: bool = True,
        cycle_min_mom: float = 0.8,
        cycle_max_mom: float = 0.9,
        decay_mom_rate: float = 0.0,
        last_batch_iteration: int = -1,
    ) -> None:
        super().__init__(optimizer, last_batch_iteration)
        first = float(cycle_first_step_size)
        second = float(cycle_second_step_size) if cycle_second_step_size is not None else first
        if first <= 0:
            raise ConfigError(f"scheduler.params.cycle_first_step_size must be positive, got {cycle_first_step_size}")
        if second < 0:
            raise ConfigError(
                f"scheduler.params.cycle_second_step_size must be non-negative, got {cycle_second_step_size}"
            )
        self.first_step_size = first
        self.second_step_size = second
        self.total_size = first + second
        self.step_ratio = first / self.total_size
        self.first_stair_count = cycle_first_stair_count
        self.second_stair_count = (
            cycle_first_stair_count if cycle_second_stair_count is None else cycle_second_stair_count
        )
        self.decay_step_size = decay_step_size
        self.decay_lr_rate = decay_lr_rate
        self.decay_mom_rate = decay_mom_rate
        no_decay_steps = math.isclose(decay_step_size, 0)
        self.skip_lr_decay = no_decay_steps or math.isclose(decay_lr_rate, 0)
        self.skip_mom_decay = no_decay_steps or math.isclose(decay_mom_rate, 0)
        self.min_lrs = _per_group(self.optimizer, cycle_min_lr, "cycle_min_lr")
        self.max_lrs = _per_group(self.optimizer, cycle_max_lr, "cycle_max_lr")

        self.cycle_momentum = bool(cycle_momentum)
        if self.cycle_momentum and "betas" not in getattr(self.optimizer, "defaults", {}):
            logger.warning(
                "OneCycle: cycle_momentum disabled, %s has no 'betas'", type(self.optimizer).__name__
            )
            self.cycle_momentum = False
        if self.cycle_momentum:
            self.min_moms = _per_group(self.optimizer, cycle_min_mom, "cycle_min_mom")
            self.max_moms = _per_group(self.optimizer, cycle_max_mom, "cycle_max_mom")

        if self.last_batch_iteration == -1:
            self._write_lrs(self.min_lrs)
            if self.cycle_momentum:
                self._write_moms(self.min_moms)

    def _write_lrs(self, lrs: Sequence[float]) -> None:
        for group, lr in zip(self.optimizer.param_groups, lrs):
            if isinstance(group["lr"], torch.Tensor):
                group["lr"].fill_(lr)
            else:
                group["lr"] = lr
        self._last_lr = [g["lr"] for g in self.optimizer.param_groups]

    def _write_moms(self, moms: Sequence[float]) -> None:
        for group, mom in zip(self.optimizer.param_groups, moms):
            group["betas"] = (mom, group["betas"][1])

    def _scale_factor(self) -> float:
        it = self.last_batch_iteration + 1
        cycle = math.floor(1 + it / self.total_size)
        x = 1.0 + it / self.total_size - cycle
        if x <= self.step_ratio:
            scale = x / self.step_ratio
            stairs = self.first_stair_count
        else:
            scale = (x - 1) / (self.step_ratio - 1)
            stairs = self.second_stair_count
        if stairs > 0:
            cycle_it = it % self.total_size
            if cycle_it <= self.first_step_size:
                position = cycle_it * stairs / self.first_step_size
            else:
                position = (self.total_size - cycle_it) * stairs / self.second_step_size
            scale = math.floor(position) / stairs
        return scale

    def get_lr(self) -> List[float]:
        if self.last_batch_iteration < self.total_size:
            scale = self._scale_factor()
            return [lo + (hi - lo) * scale for lo, hi in zip(self.min_lrs, self.max_lrs)]
        if self.skip_lr_decay:
            return list(self.min_lrs)
        k = self.last_batch_iteration - self.total_size + 1
        factor = 1 + self.decay_lr_rate * k / self.decay_step_size
        return [lo / factor for lo in self.min_lrs]

    def get_mom(self) -> Optional[List[Tuple[float, float]]]:
        """``(beta1, beta2)`` per group for the current iteration, as DeepSpeed's (None without momentum
        cycling); beta2 is the group's own."""
        if not self.cycle_momentum:
            return None
        return [(b1, g["betas"][1]) for b1, g in zip(self._beta1s(), self.optimizer.param_groups)]

    def _beta1s(self) -> List[float]:
        if self.last_batch_iteration < self.total_size:
            scale = self._scale_factor()
            return [hi - (hi - lo) * scale for lo, hi in zip(self.min_moms, self.max_moms)]
        if self.skip_mom_decay:
            return list(self.max_moms)
        k = self.last_batch_iteration - self.total_size + 1
        factor = 1 + self.decay_mom_rate * k / self.decay_step_size
        return [hi * factor for hi in self.max_moms]

    def _apply(self) -> None:
        super()._apply()
        if self.cycle_momentum:
            self._write_moms(self._beta1s())


class LRRangeTest(_Schedule):
    """lr = min_lr * (1 + step_rate * i), i = (it + 1) / step_size (floored with ``staircase``)."""

    def __init__(
        self,
        optimizer,
        lr_range_test_min_lr: float = 1e-3,
        lr_range_test_step_size: int = 2000,
        lr_range_test_step_rate: float = 1.0,
        lr_range_test_staircase: bool = False,
        last_batch_iteration: int = -1,
    ) -> None:
        super().__init__(optimizer, last_batch_iteration)
        self.min_lr = _per_group(self.optimizer, lr_range_test_min_lr, "lr_range_test_min_lr")
        self.step_size = _positive_int(lr_range_test_step_size, "lr_range_test_step_size")
        self.step_rate = lr_range_test_step_rate
        self.staircase = bool(lr_range_test_staircase)
        if self.last_batch_iteration == -1:
            self._apply()

    def get_lr(self) -> List[float]:
        interval = (self.last_batch_iteration + 1) / self.step_size
        if self.staircase:
            interval = math.floor(interval)
        return [lr * (1 + self.step_rate * interval) for lr in self.min_lr]


_DEEPSPEED_SCHEDULES = MappingProxyType({c.__name__: c for c in (WarmupLR, WarmupDecayLR, WarmupCosineLR, OneCycle, LRRangeTest)})
#: DeepSpeed schedule names (matched case-insensitively).
DEEPSPEED_SCHEDULER_NAMES = tuple(_DEEPSPEED_SCHEDULES)

# torch schedulers that need callables or other schedulers, which a JSON config cannot give.
_EXCLUDED_TORCH = frozenset({"LRScheduler", "_LRScheduler", "LambdaLR", "MultiplicativeLR", "SequentialLR", "ChainedScheduler"})


def _torch_schedulers() -> Dict[str, type]:
    mod = torch.optim.lr_scheduler
    bases = tuple(b for b in (getattr(mod, "LRScheduler", None), getattr(mod, "ReduceLROnPlateau", None)) if b)
    out = {}
    for name in dir(mod):
        obj = getattr(mod, name)
        if isinstance(obj, type) and issubclass(obj, bases) and name not in _EXCLUDED_TORCH and not name.startswith("_"):
            out[name.lower()] = obj
    return out


def _valid_names() -> str:
    torch_names = sorted(c.__name__ for c in _torch_schedulers().values())
    return ", ".join(DEEPSPEED_SCHEDULER_NAMES) + "; or a torch.optim.lr_scheduler class: " + ", ".join(torch_names)


def _one_line(e: BaseException) -> str:
    return " ".join(str(e).split())


def build_scheduler(cfg: Any, optimizer):
    """The LR schedule for a ``{"type": ..., "params": {...}}`` block (any object with ``.type`` and
    ``.params``; None gives None): a DeepSpeed schedule by name, or a ``torch.optim.lr_scheduler`` class
    by name, both case-insensitive. Unknown names or params raise :class:`ConfigError`."""
    if cfg is None:
        return None
    type_name = getattr(cfg, "type", None)
    if not isinstance(type_name, str) or not type_name:
        raise ConfigError(f"scheduler.type must be a non-empty string, got {type_name!r}; valid: {_valid_names()}")
    params = dict(getattr(cfg, "params", None) or {})
    key = type_name.lower()
    ds = {n.lower(): c for n, c in _DEEPSPEED_SCHEDULES.items()}
    if key in ds:
        cls: type = ds[key]
        target = optimizer
    else:
        classes = _torch_schedulers()
        if key not in classes:
            raise ConfigError(f"scheduler.type {type_name!r} is unknown; valid: {_valid_names()}")
        cls = classes[key]
        target = _unwrap(optimizer)
    sig = inspect.signature(cls.__init__)  # type: ignore[misc]  # the class's own __init__ is what we want
    accepted = [n for n, p in sig.parameters.items() if n not in ("self", "optimizer") and p.kind != p.VAR_KEYWORD]
    for k in params:
        if k not in accepted:
            raise ConfigError(
                f"scheduler.params.{k} is not a parameter of {type_name!r}; accepted: {', '.join(accepted)}"
            )
    missing = [
        n
        for n, p in sig.parameters.items()
        if n not in ("self", "optimizer") and p.default is p.empty and p.kind == p.POSITIONAL_OR_KEYWORD
        and n not in params
    ]
    if missing:
        raise ConfigError(f"scheduler {type_name!r} needs scheduler.params.{missing[0]}")
    try:
        return cls(target, **params)
    except ConfigError:
        raise
    except (TypeError, ValueError) as e:
        raise ConfigError(f"scheduler {type_name!r} rejected its params {params}: {_one_line(e)}") from e
