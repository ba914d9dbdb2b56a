"""Timers, rank-aware logging and the metric monitors (CSV, TensorBoard, W&B, Comet)."""
from .master import MonitorMaster
from .sink import Event, Sink
from .timers import Timers

__all__ = ["Event", "MonitorMaster", "Sink", "Timers"]
