"""Timers, rank-aware logging and metrics."""
from .timers import Timers

__all__ = ["Timers"]
