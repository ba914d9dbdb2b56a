"""The ``compile`` block (DeepSpeed's ``CompileConfig``): settings of ``engine.compile()``.

shardspeed compiles each transformer block with ``torch.compile`` (``engine.compile()``; docs/compile.md).
DeepCompile (ZeRO as compiler passes over the captured graph) is not built: ``deepcompile: true`` and the keys
only DeepCompile reads are refused by name when set to anything but their defaults. As in DeepSpeed, the
block alone compiles nothing: ``engine.compile()`` does (the Hugging Face Trainer and accelerate call it).
"""
from __future__ import annotations

from typing import Any, List, Optional

from pydantic import model_validator

from .base import ConfigModel, field

_DEEPCOMPILE = "a DeepCompile option (ZeRO as compiler passes)"


class CompileConfig(ConfigModel):
    """DeepSpeed's ``compile`` block."""

    deepcompile: bool = field(False, "DeepCompile: ZeRO's gathers and reduce-scatters inserted and scheduled by "
                              "compiler passes.", not_implemented="DeepCompile (ZeRO as compiler passes; "
                              "engine.compile() compiles each block with torch.compile instead)")
    autoep_non_moe: bool = field(False, "Compile around MoE layers and keep them eager. shardspeed's "
                                 "engine.compile() always keeps MoE layers eager, whatever the value.")
    free_activation: bool = field(False, "DeepCompile: free activations early.", not_implemented=_DEEPCOMPILE)
    free_activation_threshold: int = field(10 * 1024 * 1024, "DeepCompile: bytes of an activation freed "
                                           "early.", not_implemented=_DEEPCOMPILE)
    offload_activation: bool = field(False, "DeepCompile: activations to host memory.",
                                     not_implemented=_DEEPCOMPILE)
    offload_activation_pin_memory: bool = field(True, "DeepCompile: pinned host buffers for offloaded "
                                                "activations.", not_implemented=_DEEPCOMPILE)
    offload_opt_states: bool = field(False, "DeepCompile: optimizer states to host memory during forward and "
                                     "backward.", not_implemented=_DEEPCOMPILE)
    double_buffer: bool = field(True, "DeepCompile: double buffering.", not_implemented=_DEEPCOMPILE)
    symmetric_memory: bool = field(False, "DeepCompile: symmetric memory.", not_implemented=_DEEPCOMPILE)
    debug_log: bool = field(False, "DeepCompile: dump the graphs.", not_implemented=_DEEPCOMPILE)
    offload_parameters: bool = field(False, "DeepCompile: parameter offloading.", not_implemented=_DEEPCOMPILE)
    sync_before_reduce: bool = field(False, "DeepCompile: synchronize before a reduction.",
                                     not_implemented=_DEEPCOMPILE)
    sync_after_reduce: bool = field(False, "DeepCompile: synchronize after a reduction.",
                                    not_implemented=_DEEPCOMPILE)
    sync_before_allgather: bool = field(False, "DeepCompile: synchronize before an all-gather.",
                                        not_implemented=_DEEPCOMPILE)
    sync_after_allgather: bool = field(False, "DeepCompile: synchronize after an all-gather.",
                                       not_implemented=_DEEPCOMPILE)
    keep_int_input_tensors: bool = field(True, "DeepCompile: real values of int inputs in its input storage.",
                                         not_implemented=_DEEPCOMPILE)
    keep_all_input_tensors: bool = field(False, "DeepCompile: real values of every input in its input storage.",
                                         not_implemented=_DEEPCOMPILE)
    passes: Optional[List[str]] = field(None, "DeepCompile: the passes composed.", not_implemented=_DEEPCOMPILE)

    @model_validator(mode="before")
    @classmethod
    def _enabled_false(cls, data: Any) -> Any:
        """``{"enabled": false}``, which shardspeed accepted before the block was implemented: the defaults."""
        if isinstance(data, dict) and data.get("enabled") is False:
            data = {k: v for k, v in data.items() if k != "enabled"}
        return data
