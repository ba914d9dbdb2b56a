"""`ShardspeedConfig`: the whole DeepSpeed-format config (top-level keys and blocks)."""
from __future__ import annotations

import json
from typing import Any, List, Literal, Optional, Tuple

import torch
from pydantic import PrivateAttr, field_validator, model_validator
from pydantic_core import PydanticCustomError

from .autotuning import AutotuningConfig
from .base import AUTO_DEFAULT, ConfigModel, field
from .blocks import (
    ActivationCheckpointingConfig,
    AioConfig,
    CheckpointConfig,
    CometConfig,
    CommsLoggerConfig,
    CSVMonitorConfig,
    FlopsProfilerConfig,
    OptimizerConfig,
    PipelineConfig,
    SchedulerConfig,
    TensorBoardConfig,
    TensorParallelConfig,
    WandbConfig,
)
from .compile import CompileConfig
from .expert import ExpertParallelConfig
from .precision import (
    TORCH_DTYPES,
    BF16Config,
    DataTypesConfig,
    DtypeName,
    FP16Config,
    TorchAutocastConfig,
    check_precision,
    normalize_dtype_name,
)
from .zero import ZeroConfig

_REMOVED = "was removed from DeepSpeed and is not supported; remove it"
_NOT_IMPLEMENTED = "is a DeepSpeed feature shardspeed does not implement; remove the block"

# Feature blocks shardspeed does not implement: accepted only when absent, null or {"enabled": false}.
_UNIMPLEMENTED_BLOCKS = ("hybrid_engine", "data_efficiency",
                         "weight_quantization", "datastates")


class ShardspeedConfig(ConfigModel):
    """The training config, in DeepSpeed's JSON format. Build it with `shardspeed.config.load_config`,
    which also resolves the batch sizes for the data-parallel world size."""

    ALIASES = {"bfloat16": "bf16"}
    REJECTED = {
        "amp": "NVIDIA Apex AMP is not supported; use \"bf16\" or \"fp16\" instead",
        "elasticity": "elastic training is not supported; set train_batch_size, "
                      "train_micro_batch_size_per_gpu and gradient_accumulation_steps directly",
        "gradient_accumulation_dtype": "not a DeepSpeed key; use \"data_types\": {\"grad_accum_dtype\": ...}",
        **{key: _REMOVED for key in ("nebula", "compression_training", "quantize_training", "eigenvalue",
                                     "sparse_attention", "graph_harvesting", "curriculum_learning",
                                     "progressive_layer_drop")},
    }

    #: The batch trio as the user gave it (set by load_config), so a loaded config can be re-resolved
    #: for another world size.
    _given_batch: Optional[Tuple[Optional[int], Optional[int], Optional[int]]] = PrivateAttr(default=None)

    train_batch_size: Optional[int] = field(
        None, "Global batch per optimizer step: micro-batch × accumulation steps × data-parallel size. "
        "Derived when omitted or \"auto\".", gt=0, auto=AUTO_DEFAULT)
    train_micro_batch_size_per_gpu: Optional[int] = field(
        None, "Samples per rank per forward/backward. Derived when omitted or \"auto\".", gt=0,
        auto=AUTO_DEFAULT)
    gradient_accumulation_steps: Optional[int] = field(
        None, "Micro-batches accumulated per optimizer step. Derived when omitted or \"auto\".", gt=0,
        auto=AUTO_DEFAULT)
    gradient_clipping: float = field(1.0, "Clip the global gradient norm to this value; 0 disables. "
                                     "\"auto\" means 1.0.", ge=0, allow_inf_nan=False, auto={"value": 1.0})
    steps_per_print: Optional[int] = field(None, "Log a progress line every N optimizer steps; None: never.",
                                           gt=0)
    wall_clock_breakdown: bool = field(False, "Time forward, backward and step, and log the breakdown.")
    prescale_gradients: bool = field(False, "Divide gradients by the data-parallel size before (not after) "
                                     "the reduction.")
    gradient_predivide_factor: float = field(1.0, "Divide gradients by this factor before the reduction and by "
                                             "world size / factor after it.", gt=0, allow_inf_nan=False)
    communication_data_type: Optional[DtypeName] = field(
        None, "Dtype of gradient collectives: \"fp32\", \"fp16\" or \"bf16\" (DeepSpeed's spellings such as "
        "\"float16\" or \"FP16\" are accepted). None: the training dtype.")
    zero_allow_untested_optimizer: bool = field(False, "Allow a client optimizer that is not one of the "
                                                "known optimizers with ZeRO.")
    dataloader_drop_last: bool = field(False, "Drop the last incomplete batch of the training data loader.")
    fp16: FP16Config = field(default_factory=FP16Config, description="fp16 mixed precision.")
    bf16: BF16Config = field(default_factory=BF16Config, description="bf16 mixed precision. Also `bfloat16`.")
    data_types: DataTypesConfig = field(default_factory=DataTypesConfig, description="Buffer dtypes.")
    torch_autocast: TorchAutocastConfig = field(default_factory=TorchAutocastConfig,
                                                description="torch.autocast forward, fp32 parameters.")
    zero_optimization: ZeroConfig = field(default_factory=ZeroConfig, description="ZeRO sharding. "
                                          "`true` means stage 1, `false` stage 0.")
    optimizer: Optional[OptimizerConfig] = field(None, "Optimizer to build when the caller passes none.")
    scheduler: Optional[SchedulerConfig] = field(None, "LR schedule to build when the caller passes none.")
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig, description="Checkpoint options.")
    comms_logger: CommsLoggerConfig = field(default_factory=CommsLoggerConfig, description="Collectives log.")
    tensorboard: TensorBoardConfig = field(default_factory=TensorBoardConfig, description="TensorBoard.")
    csv_monitor: CSVMonitorConfig = field(default_factory=CSVMonitorConfig, description="CSV metrics.")
    wandb: WandbConfig = field(default_factory=WandbConfig, description="Weights & Biases.")
    comet: CometConfig = field(default_factory=CometConfig, description="Comet.")
    flops_profiler: FlopsProfilerConfig = field(default_factory=FlopsProfilerConfig,
                                                description="FLOPs profiler.")
    activation_checkpointing: ActivationCheckpointingConfig = field(
        default_factory=ActivationCheckpointingConfig, description="Activation checkpointing options.")
    aio: AioConfig = field(default_factory=AioConfig, description="Asynchronous I/O for NVMe offload.")
    pipeline: PipelineConfig = field(default_factory=PipelineConfig, description="Pipeline parallelism "
                                     "(`stages` sizes the mesh's pipe dimension).")
    tensor_parallel: TensorParallelConfig = field(default_factory=TensorParallelConfig, description="Tensor "
                                                  "parallelism (`autotp_size` sizes the mesh's model dimension).")
    expert_parallel: ExpertParallelConfig = field(default_factory=ExpertParallelConfig, description="AutoEP: "
                                                  "expert-parallel MoE blocks for Hugging Face models "
                                                  "(`autoep_size` sizes the mesh's expert dimension).")
    autotuning: AutotuningConfig = field(default_factory=AutotuningConfig, description="Autotuning "
                                         "(`shardspeed autotune`) and a trial's profiling.")
    compile: CompileConfig = field(default_factory=CompileConfig, description="engine.compile()'s settings "
                                   "(docs/compile.md); DeepCompile's keys refused.")
    # Accepted for compatibility, not acted on.
    seq_parallel_communication_data_type: Optional[DtypeName] = field(
        "fp32", "DeepSpeed: gradient dtype of sequence-parallel collectives.", ignored=True)
    dump_state: bool = field(False, "Log the resolved config (rank 0) when the engine is built.")
    memory_breakdown: bool = field(False, "Log this rank's model-state memory (engine.memory_breakdown()) with "
                                   "each steps_per_print line (rank 0).")
    disable_allgather: bool = field(False, "DeepSpeed: legacy flag, no effect.", ignored=True)
    sparse_gradients: bool = field(False, "Older DeepSpeed: reduce embedding gradients sparsely. Gradients are "
                                   "reduced dense here (same result).", ignored=True)
    disable_python_gc: bool = field(False, "DeepSpeed: disable Python's cyclic garbage collector.",
                                    ignored=True)
    zero_force_ds_cpu_optimizer: bool = field(True, "DeepSpeed: require its CPU optimizer with offload.",
                                              ignored=True)
    vocabulary_size: Optional[int] = field(None, "DeepSpeed: warns when not a multiple of 8.", ignored=True)
    log_level: Optional[str] = field(None, "DeepSpeed: its logger's level.", ignored=True)
    use_data_before_expert_parallelism: bool = field(False, "DeepSpeed: MoE process-group order.",
                                                     ignored=True)
    sequence_parallel_size: int = field(1, "DeepSpeed: Ulysses sequence-parallel size: ranks that split each "
                                        "sequence (the mesh's sequence dimension; ZeRO shards over data × "
                                        "sequence). See docs/long-context.md.", ge=1)
    sequence_parallel_gradients: Literal["sum", "mean"] = field(
        "sum", "shardspeed: how the sequence-parallel ranks' gradients combine. \"sum\" (DeepSpeed's): summed over "
        "the sequence ranks and averaged over data, so gradients, their norm and clipping are P times the "
        "true ones, as under DeepSpeed; \"mean\": averaged over data × sequence, the true gradient (a clipped "
        "run then differs from DeepSpeed's). See docs/long-context.md.")
    managed_gradient_accumulation: bool = field(True, "DeepSpeed: false lets the client own the accumulation "
                                                "boundary (only true is supported).", unsupported=True)
    gradient_allreduce_op: str = field("mean", "DeepSpeed: \"mean\" or \"sum\" (only \"mean\" is supported).",
                                       unsupported=True)

    @model_validator(mode="before")
    @classmethod
    def _legacy_forms(cls, data: Any) -> Any:
        """`"zero_optimization": true|false` → stage 1|0; unimplemented feature blocks refused."""
        if not isinstance(data, dict):
            return data
        data = dict(data)
        if isinstance(data.get("zero_optimization"), bool):
            data["zero_optimization"] = {"stage": 1 if data["zero_optimization"] else 0}
        if data.get("tensor_parallel") == {"enabled": False}:  # accepted before the block was implemented
            del data["tensor_parallel"]
        for key in _UNIMPLEMENTED_BLOCKS:
            if key in data:
                block = data.pop(key)
                if block is not None and block != {} and not (isinstance(block, dict) and block.get("enabled")
                                                              is False):
                    raise PydanticCustomError("rejected_key", "'{key}': {reason}",
                                              {"key": key, "reason": _NOT_IMPLEMENTED})
        return data

    @classmethod
    def read_keys(cls) -> List[str]:
        """Every top-level key this model reads: fields, aliases, refused keys and unimplemented blocks."""
        return cls.accepted_keys() + list(cls.REJECTED) + list(_UNIMPLEMENTED_BLOCKS)

    @field_validator("steps_per_print", mode="before")
    @classmethod
    def _infinite_means_never(cls, value: Any) -> Any:
        """accelerate writes ``float("inf")`` to silence DeepSpeed's progress lines: never print."""
        return None if isinstance(value, float) and value == float("inf") else value

    @field_validator("communication_data_type", "seq_parallel_communication_data_type", mode="before")
    @classmethod
    def _normalize_dtype(cls, value: Any) -> Any:
        return normalize_dtype_name(value)

    @field_validator("steps_per_print", mode="before")
    @classmethod
    def _never_print(cls, value: Any) -> Any:
        """accelerate writes ``float("inf")`` (DeepSpeed then never prints): the same as None here."""
        return None if value == float("inf") else value

    @model_validator(mode="after")
    def _check(self) -> ShardspeedConfig:
        check_precision(self.fp16, self.bf16)
        for name in ("managed_gradient_accumulation", "gradient_allreduce_op"):
            default = type(self).model_fields[name].default
            if getattr(self, name) != default:
                raise PydanticCustomError("unsupported", "'{key}' = {value} is not supported (only {default})",
                                          {"key": name, "value": json.dumps(getattr(self, name)),
                                           "default": json.dumps(default)})
        return self

    @property
    def train_dtype(self) -> torch.dtype:
        """torch.float16 when fp16 is enabled, torch.bfloat16 when bf16 is, else torch.float32."""
        if self.fp16.enabled:
            return torch.float16
        if self.bf16.enabled:
            return torch.bfloat16
        return torch.float32

    @property
    def comm_dtype(self) -> torch.dtype:
        """The dtype of gradient collectives: communication_data_type, else the training dtype."""
        if self.communication_data_type is not None:
            return TORCH_DTYPES[self.communication_data_type]
        return self.train_dtype
