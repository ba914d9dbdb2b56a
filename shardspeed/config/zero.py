"""`zero_optimization` and its `offload_optimizer` / `offload_param` blocks."""
from __future__ import annotations

import sys
from typing import Any, Dict, Literal, Optional

from pydantic import PrivateAttr, field_validator, model_validator
from pydantic_core import PydanticCustomError

from .base import AUTO_DEFAULT, ConfigModel, field

OffloadDevice = Literal["none", "cpu", "nvme"]


def _normalize_device(value: Any) -> Any:
    return value.strip().lower() if isinstance(value, str) else value


class OffloadOptimizerConfig(ConfigModel):
    """`zero_optimization.offload_optimizer`: keep optimizer states (and the master weights) off the GPU
    and run the optimizer step on the CPU. Valid at stages 1, 2 and 3."""

    device: OffloadDevice = field("none", "Where optimizer states live: \"none\", \"cpu\" or \"nvme\".")
    nvme_path: Optional[str] = field(None, "Directory for the state files when device is \"nvme\".")
    buffer_count: int = field(4, "Buffers in the pool used to stream states to and from NVMe.", ge=0)
    pin_memory: bool = field(True, "Use page-locked CPU memory (faster, asynchronous host-device copies).")
    pipeline_read: bool = field(False, "Overlap reading the next NVMe tile with the current tile's step.")
    pipeline_write: bool = field(False, "Overlap writing the previous NVMe tile with the current tile's step.")
    fast_init: bool = field(False, "DeepSpeed: fast optimizer initialisation with NVMe.", ignored=True)
    ratio: float = field(1.0, "Fraction of the optimizer states offloaded (< 1 needs stage 3).", ge=0.0, le=1.0)
    super_offload: bool = field(False, "DeepSpeed: Superchip offload path.", ignored=True)
    cpuadam_cores_perc: float = field(0.8, "DeepSpeed: share of CPU cores for CPU Adam with super_offload.",
                                      ge=0.0, le=1.0, ignored=True)

    @field_validator("device", mode="before")
    @classmethod
    def _lowercase_device(cls, value: Any) -> Any:
        return _normalize_device(value)

    @model_validator(mode="after")
    def _nvme_needs_path(self) -> OffloadOptimizerConfig:
        if self.device == "nvme" and not self.nvme_path:
            raise PydanticCustomError("nvme_path", "device \"nvme\" needs nvme_path (a directory)", {})
        return self


class OffloadParamConfig(ConfigModel):
    """`zero_optimization.offload_param`: keep the parameter shards off the GPU between uses.
    Read only at stage 3 (below it the block is dropped with a warning, as DeepSpeed ignores it)."""

    device: OffloadDevice = field("none", "Where parameter shards live: \"none\", \"cpu\" or \"nvme\".")
    nvme_path: Optional[str] = field(None, "Directory for the parameter files when device is \"nvme\".")
    buffer_count: int = field(5, "Buffers in the pool used to stream parameters from NVMe.", ge=0)
    buffer_size: int = field(100_000_000, "Size (elements) of each NVMe buffer.", ge=0)
    max_in_cpu: int = field(1_000_000_000, "Parameter elements kept in CPU memory when offloading to NVMe.",
                            ge=0)
    pin_memory: bool = field(True, "Use page-locked CPU memory (faster, asynchronous host-device copies).")

    @field_validator("device", mode="before")
    @classmethod
    def _lowercase_device(cls, value: Any) -> Any:
        return _normalize_device(value)

    @model_validator(mode="after")
    def _nvme_needs_path(self) -> OffloadParamConfig:
        if self.device == "nvme" and not self.nvme_path:
            raise PydanticCustomError("nvme_path", "device \"nvme\" needs nvme_path (a directory)", {})
        return self


# Stage-3 keys DeepSpeed also accepts with a "stage3_" prefix.
_STAGE3_PREFIXED = ("prefetch_bucket_size", "param_persistence_threshold", "model_persistence_threshold",
                    "max_live_parameters", "max_reuse_distance", "gather_16bit_weights_on_model_save",
                    "module_granularity_threshold", "use_all_reduce_for_fetch_params", "allgather_sequential")


class ZeroConfig(ConfigModel):
    """`zero_optimization`: which model states are sharded across data-parallel ranks, and how.
    `"zero_optimization": true` means stage 1 and `false` stage 0 (DeepSpeed's old form)."""

    ALIASES = {**{f"stage3_{name}": name for name in _STAGE3_PREFIXED},
               "stage3_gather_fp16_weights_on_model_save": "gather_16bit_weights_on_model_save"}

    #: The device of an ``offload_param`` block given below stage 3, which is dropped (DeepSpeed ignores it
    #: there); the loader warns about it once.
    _dropped_offload_param: Optional[str] = PrivateAttr(default=None)

    stage: int = field(0, "0: plain data parallel; 1: shard optimizer states; 2: also gradients; "
                       "3: also parameters. A JSON number (\"2\" is refused); \"auto\" means 0, as in "
                       "DeepSpeed.", ge=0, le=3, strict=True, auto=AUTO_DEFAULT)
    contiguous_gradients: bool = field(True, "Copy gradients into a contiguous buffer as they are produced.")
    reduce_scatter: bool = field(True, "Average gradients with reduce-scatter rather than all-reduce.")
    reduce_bucket_size: int = field(500_000_000, "Elements reduced at a time (gradient bucket size).", gt=0,
                                    auto=AUTO_DEFAULT)
    allgather_partitions: bool = field(True, "Gather updated parameters with all-gather (vs broadcasts).")
    allgather_bucket_size: int = field(500_000_000, "Elements all-gathered at a time (stages 1-2).", gt=0,
                                       auto=AUTO_DEFAULT)
    overlap_comm: Optional[bool] = field(
        None, "Overlap gradient reduction with the backward pass. Resolved to a bool when loaded.",
        default_doc="true at stage 3, else false")
    load_from_fp32_weights: bool = field(True, "On resume, initialise master weights from the fp32 copies in "
                                         "the checkpoint (not from the 16-bit weights).")
    sub_group_size: int = field(1_000_000_000, "Elements per optimizer-step tile (offload at stage 3).", gt=0,
                                auto=AUTO_DEFAULT)
    offload_optimizer: Optional[OffloadOptimizerConfig] = field(
        None, "Offload optimizer states and step to CPU or NVMe. Alias: `cpu_offload: true`.")
    offload_param: Optional[OffloadParamConfig] = field(
        None, "Offload parameter shards to CPU or NVMe (stage 3). Alias: `cpu_offload_param: true`.")
    prefetch_bucket_size: int = field(50_000_000, "Stage 3: parameter elements fetched ahead of use "
                                      "(0: no prefetch). Also `stage3_prefetch_bucket_size`.", ge=0,
                                      auto=AUTO_DEFAULT)
    param_persistence_threshold: int = field(
        100_000, "Stage 3: parameters smaller than this (elements) are not sharded. Also "
        "`stage3_param_persistence_threshold`.", ge=0, auto=AUTO_DEFAULT)
    model_persistence_threshold: int = field(
        sys.maxsize, "Stage 3: cap on the total unsharded (persistent) elements. Also "
        "`stage3_model_persistence_threshold`.", ge=0, auto=AUTO_DEFAULT, default_doc="sys.maxsize")
    max_live_parameters: int = field(
        1_000_000_000, "Stage 3: gathered parameter elements kept resident before releasing. Also "
        "`stage3_max_live_parameters`.", ge=0, auto=AUTO_DEFAULT)
    max_reuse_distance: int = field(
        1_000_000_000, "Stage 3: do not release a parameter reused within this many elements. Also "
        "`stage3_max_reuse_distance`.", ge=0, auto=AUTO_DEFAULT)
    gather_16bit_weights_on_model_save: bool = field(
        False, "Stage 3: gather the full 16-bit weights when saving the model (save_16bit_model). Also "
        "`stage3_gather_16bit_weights_on_model_save`, `stage3_gather_fp16_weights_on_model_save`.",
        auto={"value": True})
    ignore_unused_parameters: bool = field(True, "Allow parameters that get no gradient in a step.")
    round_robin_gradients: bool = field(False, "DeepSpeed: stage 1-2 offload gradient copy order.", ignored=True)
    use_multi_rank_bucket_allreduce: bool = field(True, "DeepSpeed: merge ranks' buckets into one all-reduce.",
                                                  ignored=True)
    compute_grad_norm: bool = field(True, "DeepSpeed: compute the global gradient norm at stages 1-2.",
                                    ignored=True)
    elastic_checkpoint: bool = field(False, "DeepSpeed: legacy elastic checkpoints.", ignored=True)
    cpu_offload: Optional[bool] = field(None, "Deprecated alias: true means offload_optimizer device cpu.")
    cpu_offload_param: Optional[bool] = field(None, "Deprecated alias: true means offload_param device cpu.")
    cpu_offload_use_pin_memory: Optional[bool] = field(None, "Deprecated; use the offload blocks' pin_memory.",
                                                       ignored=True)
    module_granularity_threshold: int = field(0, "DeepSpeed: stage 3 fine-grained module fetching. Also "
                                              "`stage3_module_granularity_threshold`.", ignored=True)
    use_all_reduce_for_fetch_params: bool = field(
        False, "DeepSpeed: fetch stage-3 parameters with all-reduce. Also "
        "`stage3_use_all_reduce_for_fetch_params`.", ignored=True)
    allgather_sequential: bool = field(False, "DeepSpeed: gather stage-3 parameters one by one. Also "
                                       "`stage3_allgather_sequential`.", ignored=True)
    legacy_stage1: bool = field(False, "DeepSpeed: old stage 1 implementation.", ignored=True)
    parameter_alignment: bool = field(False, "DeepSpeed: 16-byte alignment in flat buffers.", ignored=True)
    zero_hpz_partition_size: int = field(1, "ZeRO++ hpZ: ranks of a secondary partition of the stage-3 "
                                         "parameters (a node); backward gathers stay inside it (1: off).", ge=0)
    zero_quantized_weights: bool = field(False, "ZeRO++ qwZ: stage-3 parameter all-gathers carry block-quantized "
                                         "integers and a scale per block.")
    zero_quantized_nontrainable_weights: bool = field(False, "ZeRO++: quantize the all-gathers of frozen "
                                                      "(requires_grad=False) units only.")
    zero_quantized_gradients: bool = field(False, "ZeRO++ qgZ: stage-3 gradient reduction by an all-to-all of "
                                           "block-quantized integers, summed in fp32.")
    zero_quantized_weights_bits: int = field(8, "shardspeed: bits per quantized weight (8 or 4).")
    zero_quantized_gradients_bits: int = field(8, "shardspeed: bits per quantized gradient (8 or 4).")
    zero_quantization_block_size: int = field(256, "shardspeed: values per quantization scale (ZeRO++).", ge=2)
    memory_efficient_linear: bool = field(True, "DeepSpeed: stage 3 linear layer.", ignored=True)
    pipeline_loading_checkpoint: bool = field(False, "DeepSpeed: stage 3 pipeline checkpoint loading.",
                                              ignored=True)
    override_module_apply: bool = field(True, "DeepSpeed: stage 3 patches nn.Module.apply.", ignored=True)
    log_trace_cache_warnings: bool = field(False, "DeepSpeed: stage 3 trace cache warnings.", ignored=True)
    enable_sanity_checks: bool = field(False, "DeepSpeed: internal sanity checks.", ignored=True)
    save_muon_momentum_buffer_in_memory: bool = field(False, "DeepSpeed: Muon with NVMe offload keeps its momentum in memory (shardspeed keeps it in the state files).", ignored=True)
    leaf_module: Optional[Dict[str, Any]] = field(None, "DeepSpeed: modules treated as stage-3 leaf modules.",
                                                  ignored=True)

    @model_validator(mode="before")
    @classmethod
    def _deprecated_offload_flags(cls, data: Any) -> Any:
        """`cpu_offload` / `cpu_offload_param` → offload blocks with device cpu; `zenflow` refused."""
        if not isinstance(data, dict):
            return data
        data = dict(data)
        if data.get("zenflow") is not None:
            raise PydanticCustomError("rejected_key", "'{key}': {reason}", {
                "key": "zenflow", "reason": "ZenFlow is not implemented in shardspeed; remove the block"})
        data.pop("zenflow", None)
        for old, new in (("cpu_offload", "offload_optimizer"), ("cpu_offload_param", "offload_param")):
            if data.get(old) is True:
                if data.get(new) is not None:
                    raise PydanticCustomError(
                        "duplicate_alias", "'{alias}' and '{name}' are the same setting; give only one",
                        {"alias": old, "name": new})
                data[new] = {"device": "cpu"}
        return data

    @model_validator(mode="after")
    def _resolve(self) -> ZeroConfig:
        if self.overlap_comm is None:
            object.__setattr__(self, "overlap_comm", self.stage == 3)
        param_offloaded = self.offload_param is not None and self.offload_param.device != "none"
        if param_offloaded and self.stage != 3:  # DeepSpeed reads offload_param only at stage 3
            assert self.offload_param is not None
            self._dropped_offload_param = self.offload_param.device
            object.__setattr__(self, "offload_param", None)
        opt = self.offload_optimizer
        if opt is not None and opt.device != "none" and self.stage == 0:
            raise PydanticCustomError("stage", "offload_optimizer needs stage 1, 2 or 3 (stage is 0)", {})
        if opt is not None and opt.ratio < 1.0 and self.stage != 3:
            raise PydanticCustomError("stage", "offload_optimizer.ratio < 1 needs stage 3", {})
        return self

    @property
    def ignored_note(self) -> Optional[str]:
        """What the loader warns about: an ``offload_param`` block dropped below stage 3, or None."""
        if self._dropped_offload_param is None:
            return None
        return (f"'offload_param' (device \"{self._dropped_offload_param}\") is ignored at stage {self.stage}, as "
                "DeepSpeed ignores it: parameters are offloaded only at stage 3 (use offload_optimizer at stages 1-2)")

    @property
    def offload_optimizer_device(self) -> str:
        """"none", "cpu" or "nvme"."""
        return self.offload_optimizer.device if self.offload_optimizer is not None else "none"

    @property
    def offload_param_device(self) -> str:
        """"none", "cpu" or "nvme"."""
        return self.offload_param.device if self.offload_param is not None else "none"


def zero_block(config: Optional[Dict[str, Any]]) -> ZeroConfig:
    """The ``zero_optimization`` block of a DeepSpeed-format config dict, parsed and validated (its defaults
    when the dict or the block is missing): for code that writes files another program reads with that config
    (the export to DeepSpeed's checkpoint layout), so that no module outside ``config/`` reads its sections."""
    return ZeroConfig.model_validate((config or {}).get("zero_optimization") or {})
