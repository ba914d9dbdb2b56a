"""DeepSpeed's number strings in the profiler's report: ``number_to_string(1.5e9)`` → ``"1.5 G"``, and the
MACs, FLOPS, parameter and duration variants."""
from __future__ import annotations

from typing import Optional

DEFAULT_PRECISION = 2
_MAGNITUDES = ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "K"))


def number_to_string(num: float, units: Optional[str] = None, precision: int = DEFAULT_PRECISION) -> str:
    if units is None:
        magnitude, units = 1e-6, "u"
        for m, u in _MAGNITUDES:
            if num >= m:
                magnitude, units = m, u
                break
        else:
            if num >= 1 or num == 0:
                magnitude, units = 1, ""
            elif num >= 1e-3:
                magnitude, units = 1e-3, "m"
    else:
        magnitude = {u: m for m, u in (*_MAGNITUDES, (1e-3, "m"), (1e-6, "u"))}.get(units, 1)
    return f"{round(num / magnitude, precision):g} {units}"


def macs_to_string(macs: float, units: Optional[str] = None, precision: int = DEFAULT_PRECISION) -> str:
    return f"{number_to_string(macs, units, precision)}MACs"


def flops_to_string(flops: float, units: Optional[str] = None, precision: int = DEFAULT_PRECISION) -> str:
    return f"{number_to_string(flops, units, precision)}FLOPS"


def params_to_string(params: float, units: Optional[str] = None, precision: int = DEFAULT_PRECISION) -> str:
    units = units.replace("B", "G") if units else units
    return number_to_string(params, units, precision).replace("G", "B").strip()


def duration_to_string(seconds: float, units: Optional[str] = None, precision: int = DEFAULT_PRECISION) -> str:
    return f"{number_to_string(seconds, units, precision)}s"
