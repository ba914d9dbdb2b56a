"""FLOPs profiling: DeepSpeed's ``get_model_profile`` and ``FlopsProfiler`` on ``FlopCounterMode``, and the
dense peaks of common accelerators (for MFU). See docs/profiling.md."""
from .peak import PEAK_TABLE, peak_flops, peak_flops_for_name
from .profiler import (
    FlopsProfiler,
    ModuleProfile,
    RunInfo,
    duration_to_string,
    flops_to_string,
    get_model_profile,
    macs_to_string,
    number_to_string,
    params_to_string,
)

__all__ = [
    "FlopsProfiler", "ModuleProfile", "RunInfo", "get_model_profile", "peak_flops", "peak_flops_for_name",
    "PEAK_TABLE", "number_to_string", "macs_to_string", "flops_to_string", "params_to_string",
    "duration_to_string",
]
