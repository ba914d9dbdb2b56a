"""ZeRO: flat sharded units, gradient reduction, master weights, stage-3 parameter management."""
from .gathered import GatheredParameters
from .init import Init
from .layout import FlatLayout, Piece, group_by_size

__all__ = ["Init", "GatheredParameters", "FlatLayout", "Piece", "group_by_size"]
