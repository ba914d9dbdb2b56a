"""The smaller blocks: optimizer, scheduler, checkpoint, monitors, profilers, comms logger, aio, pipeline,
tensor parallel."""
from __future__ import annotations

import json
from typing import Any, Dict, List, Literal, Optional, Union

from pydantic import field_validator, model_validator
from pydantic_core import PydanticCustomError

from .base import ConfigModel, field


def _reject_auto_params(params: Dict[str, Any]) -> None:
    for key, value in params.items():
        if isinstance(value, str) and value == "auto":
            raise PydanticCustomError(
                "auto_unresolved", "'{key}' is \"auto\", which shardspeed cannot derive: the caller (e.g. the "
                "Hugging Face Trainer) must fill in a value before passing the config",
                {"key": f"params.{key}"})


class OptimizerConfig(ConfigModel):
    """`optimizer`: the optimizer shardspeed builds when the caller passes none."""

    type: str = field(..., "Optimizer name, case-insensitive: Adam, AdamW, Adagrad, Lamb, Lion, Muon, ..., or "
                      "any torch.optim class name. Adam means AdamW unless params.adam_w_mode is false. Muon is "
                      "DeepSpeed's: Muon on hidden matrices, AdamW on the rest (lr, momentum, weight_decay, "
                      "ns_method, muon_lr, adam_lr, betas, eps; docs/optimizers.md).")
    params: Dict[str, Any] = field(default_factory=dict, description="Keyword arguments of the optimizer "
                                   "(lr, betas, eps, weight_decay, adam_w_mode, torch_adam, ...).")
    legacy_fusion: bool = field(False, "DeepSpeed: legacy fused fp16 optimizer.", ignored=True)

    @model_validator(mode="after")
    def _check_params(self) -> OptimizerConfig:
        if "max_grad_norm" in self.params:
            raise PydanticCustomError(
                "max_grad_norm", "'{key}' is not an optimizer parameter; set the top-level "
                "\"gradient_clipping\" instead (value {value})",
                {"key": "params.max_grad_norm", "value": self.params["max_grad_norm"]})
        _reject_auto_params(self.params)
        return self


class SchedulerConfig(ConfigModel):
    """`scheduler`: the learning-rate schedule shardspeed builds when the caller passes none."""

    type: str = field(..., "Schedule name: WarmupLR, WarmupDecayLR, WarmupCosineLR, OneCycle, LRRangeTest.")
    params: Dict[str, Any] = field(default_factory=dict, description="Keyword arguments of the schedule "
                                   "(warmup_min_lr, warmup_max_lr, warmup_num_steps, total_num_steps, ...).")

    @model_validator(mode="after")
    def _check_params(self) -> SchedulerConfig:
        _reject_auto_params(self.params)
        return self


class ParallelWriteConfig(ConfigModel):
    """`checkpoint.parallel_write`."""

    pipeline_stage: bool = field(False, "Write pipeline-stage checkpoints in parallel.")


class CheckpointConfig(ConfigModel):
    """`checkpoint`: checkpoint saving and loading."""

    tag_validation: Literal["WARN", "IGNORE", "FAIL"] = field(
        "WARN", "When ranks save under different tags: Fail raises on every rank; Warn (logs it) and Ignore save "
                "the one checkpoint under rank 0's tag. Any case.")
    load_universal: bool = field(False, "Load a universal (data-parallel-size independent) checkpoint.")
    use_node_local_storage: bool = field(False, "Each node writes to its own local storage.")
    parallel_write: ParallelWriteConfig = field(default_factory=ParallelWriteConfig,
                                                description="Parallel writing options.")
    async_save: bool = field(False, "shardspeed: save_checkpoint's default for async_save: snapshot each rank's "
                             "state to host memory (pinned on a GPU), then write and commit the checkpoint in a "
                             "background thread while training goes on; the next save, load_checkpoint and "
                             "engine.destroy() wait for it (docs/checkpoints.md).")
    checkpoint_serialization: bool = field(True, "DeepSpeed: torch.save serialization.", ignored=True)
    writer: Optional[Dict[str, Any]] = field(None, "DeepSpeed: fast checkpoint writer options.", ignored=True)

    @field_validator("tag_validation", mode="before")
    @classmethod
    def _upper(cls, value: Any) -> Any:
        return value.upper() if isinstance(value, str) else value


class TensorBoardConfig(ConfigModel):
    """`tensorboard`: write metrics as TensorBoard events."""

    enabled: bool = field(False, "Log to TensorBoard (needs the tensorboard package).")
    output_path: str = field("", "Directory of the logs; empty means under the launch directory.")
    job_name: str = field("DeepSpeedJobName", "Sub-directory of output_path for this job.")


class CSVMonitorConfig(ConfigModel):
    """`csv_monitor`: write metrics as CSV files."""

    enabled: bool = field(False, "Log metrics to CSV files.")
    output_path: str = field("", "Directory of the files; empty means under the launch directory.")
    job_name: str = field("DeepSpeedJobName", "Sub-directory of output_path for this job.")


class WandbConfig(ConfigModel):
    """`wandb`: log metrics to Weights & Biases."""

    enabled: bool = field(False, "Log to Weights & Biases (needs the wandb package).")
    group: Optional[str] = field(None, "Run group.")
    team: Optional[str] = field(None, "Team (entity).")
    project: str = field("deepspeed", "Project name.")


class CometConfig(ConfigModel):
    """`comet`: log metrics to Comet (needs comet_ml>=3.41.0)."""

    enabled: bool = field(False, "Log to Comet (needs the comet_ml package, 3.41 or newer).")
    samples_log_interval: int = field(100, "Samples between submissions.")
    project: Optional[str] = field(None, "Project name.")
    workspace: Optional[str] = field(None, "Workspace name.")
    api_key: Optional[str] = field(None, "API key.")
    experiment_name: Optional[str] = field(None, "Experiment name.")
    experiment_key: Optional[str] = field(None, "Experiment key.")
    online: Optional[bool] = field(None, "Log online (true) or offline.")
    mode: Optional[str] = field(None, "\"get\", \"create\" or \"get_or_create\".")


class FlopsProfilerConfig(ConfigModel):
    """`flops_profiler`: profile the model's FLOPs at one step."""

    enabled: bool = field(False, "Run the FLOPs profiler.")
    recompute_fwd_factor: float = field(0.0, "Extra forward passes due to activation recomputation.", ge=0)
    profile_step: int = field(1, "Training step at which to profile.", ge=1)
    module_depth: int = field(-1, "Depth of the module tree in the report (-1: all).")
    top_modules: int = field(1, "How many top modules the report lists.", ge=0)
    detailed: bool = field(True, "Print the per-module breakdown.")
    output_file: Optional[str] = field(None, "File for the report; None means stdout.")


class ActivationCheckpointingConfig(ConfigModel):
    """`activation_checkpointing`: DeepSpeed's activation-checkpointing settings, read by
    `shardspeed.checkpointing` (`checkpoint(function, *args)`; the engine configures it from this block,
    as `deepspeed.checkpointing.configure(mpu, deepspeed_config=...)` would). Our extension: `enabled`
    wraps every transformer block of the model in that checkpoint function (as
    `engine.enable_activation_checkpointing()` does), with the recompute `policy` given. See
    docs/activation-checkpointing.md."""

    enabled: bool = field(False, "shardspeed: checkpoint every transformer block of the model when the engine "
                          "is built (shardspeed.models.GPT's blocks, a Hugging Face model's layers through its "
                          "gradient_checkpointing_enable, or the repeated blocks of a ModuleList); false leaves "
                          "the model as it is (its own calls to shardspeed.checkpointing.checkpoint still use "
                          "the keys below).")
    policy: Literal["full", "selective"] = field(
        "full", "shardspeed: what a checkpointed block keeps. \"full\": only its inputs, everything else is "
        "recomputed in backward; \"selective\": also the outputs of matrix multiplies and attention, "
        "recomputing only the cheap elementwise ops (norms, activations, dropout).")
    partition_activations: bool = field(False, "Split each checkpoint's saved inputs over the tensor-parallel "
                                        "(model) group, each rank keeping 1/model_size; all-gathered before the "
                                        "recompute. With a model group of 1 there is nothing to split.")
    number_checkpoints: Optional[int] = field(None, "How many checkpoints one forward stores (the number of "
                                              "checkpointed blocks): sizes the buffers of "
                                              "contiguous_memory_optimization, which requires it.", ge=1)
    contiguous_memory_optimization: bool = field(False, "Copy the partitioned checkpoints into one preallocated "
                                                 "buffer per input position (number_checkpoints slots) instead of "
                                                 "one allocation each, against fragmentation. Requires "
                                                 "partition_activations and number_checkpoints.")
    synchronize_checkpoint_boundary: bool = field(False, "Synchronise the device at the start and end of each "
                                                  "checkpoint's forward and backward (CUDA; nothing to wait "
                                                  "for on CPU).")
    profile: bool = field(False, "Time each checkpoint's forward and backward (recompute included) and log them "
                          "(rank 0, logger shardspeed.checkpointing); totals in "
                          "shardspeed.checkpointing.profile_totals().")
    cpu_checkpointing: bool = field(False, "Keep the checkpoints' saved inputs (the partitions, with "
                                    "partition_activations) in host memory, pinned on CUDA, and copy them back "
                                    "for the recompute. On a CPU device they are there already (a no-op, logged "
                                    "once).")

    @model_validator(mode="after")
    def _contiguous_needs(self) -> ActivationCheckpointingConfig:
        if self.contiguous_memory_optimization and not self.partition_activations:
            raise PydanticCustomError(
                "contiguous", "'{key}' needs partition_activations: true (the buffers hold the partitions, as in "
                "DeepSpeed); enable it or remove the key", {"key": "contiguous_memory_optimization"})
        if self.contiguous_memory_optimization and self.number_checkpoints is None:
            raise PydanticCustomError(
                "contiguous", "'{key}' needs number_checkpoints (how many checkpointed blocks one forward runs) "
                "to size its buffers; set it", {"key": "contiguous_memory_optimization"})
        return self


class CommsLoggerConfig(ConfigModel):
    """`comms_logger`: record every collective (op, size, time)."""

    enabled: bool = field(False, "Record collectives.")
    verbose: bool = field(False, "Print every collective as it completes.")
    prof_all: bool = field(True, "Record all collectives (else only those in prof_ops).")
    debug: bool = field(False, "Include the calling function in each record.")
    prof_ops: List[str] = field(default_factory=list, description="Collective names to record when "
                                "prof_all is false, e.g. [\"all_reduce\", \"all_gather\"].")


class AioConfig(ConfigModel):
    """`aio`: DeepSpeed's libaio tuning for NVMe offload. shardspeed's NVMe path streams whole tiles with
    `os.preadv`/`os.pwritev` and `O_DIRECT` (the page cache where the file system refuses it), on one reader
    and one writer thread and one I/O thread per file (docs/offload.md), so these request-level knobs are
    accepted and have no counterpart (performance only)."""

    ALIASES = {"thread_count": "intra_op_parallelism"}

    block_size: int = field(1_048_576, "DeepSpeed: bytes per libaio request.", gt=0, ignored=True)
    queue_depth: int = field(8, "DeepSpeed: libaio requests in flight.", gt=0, ignored=True)
    intra_op_parallelism: int = field(1, "DeepSpeed: libaio threads per I/O operation. Also `thread_count` (older "
                                         "name).", gt=0, ignored=True)
    single_submit: bool = field(False, "DeepSpeed: submit libaio requests one at a time.", ignored=True)
    overlap_events: bool = field(True, "DeepSpeed: overlap libaio submission with completion.", ignored=True)
    use_gds: bool = field(False, "DeepSpeed: GPUDirect Storage.", ignored=True)


class PipelineConfig(ConfigModel):
    """`pipeline`: pipeline-parallel engine options, read when the model is a `shardspeed.pipe.PipelineModule`
    (its `num_stages` sizes the mesh's pipe dimension). `schedule` and `virtual_stages` are shardspeed
    extensions: which `torch.distributed.pipelining` schedule runs a step."""

    stages: Union[Literal["auto"], int] = field(
        "auto", "Number of pipeline stages: the size of the mesh's pipe dimension (\"auto\": the "
        "PipelineModule's num_stages, 1 for other models).", auto="keep")
    schedule: Literal["1f1b", "gpipe", "interleaved_1f1b", "zbv", "dualpipev"] = field(
        "1f1b", "shardspeed extension: the pipeline schedule (torch.distributed.pipelining): \"1f1b\" "
        "(DeepSpeed's), \"gpipe\", \"interleaved_1f1b\" (virtual_stages chunks per rank), \"zbv\" and "
        "\"dualpipev\" (zero-bubble V schedules, 2 chunks per rank).")
    virtual_stages: Union[Literal["auto"], int] = field(
        "auto", "shardspeed extension: stages each pipe rank runs (\"auto\": 2 for zbv and dualpipev, 2 for "
        "interleaved_1f1b, else 1).", auto="keep")
    partition: str = field("best", "How layers are split across stages: \"best\", \"parameters\", "
                           "\"uniform\", \"type:<regex>\". As in DeepSpeed, PipelineModule(partition_method=) "
                           "decides.", ignored=True)
    seed_layers: bool = field(False, "Seed each layer's initialisation by its index. As in DeepSpeed, "
                              "PipelineModule(seed_layers=) decides.", ignored=True)
    activation_checkpoint_interval: int = field(0, "Checkpoint activations every N layers (0: off). As in "
                                                "DeepSpeed, PipelineModule(activation_checkpoint_interval=) "
                                                "decides.", ge=0, ignored=True)
    pipe_partitioned: bool = field(True, "Shard activations sent between stages across tensor-parallel ranks "
                                   "(communication volume only).", ignored=True)
    grad_partitioned: bool = field(True, "Shard gradients sent between stages across tensor-parallel ranks "
                                   "(communication volume only).", ignored=True)
    use_reentrant: bool = field(True, "Use torch's reentrant activation checkpointing (PipelineModule uses "
                                "torch's non-reentrant one unless given activation_checkpoint_func).", ignored=True)

    @model_validator(mode="before")
    @classmethod
    def _check_stages(cls, data: Any) -> Any:
        for key in ("stages", "virtual_stages"):
            value = data.get(key, "auto") if isinstance(data, dict) else "auto"
            if value != "auto" and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
                raise PydanticCustomError(key, "'{key}' = {value} is invalid: it must be \"auto\" or an integer "
                                          ">= 1", {"key": key, "value": json.dumps(value)})
        return data

    @property
    def num_stages(self) -> int:
        """The pipe dimension's size: `stages`, with "auto" meaning 1."""
        return 1 if self.stages == "auto" else int(self.stages)

    @property
    def chunks_per_rank(self) -> int:
        """`virtual_stages` with "auto" resolved for the schedule."""
        if self.virtual_stages != "auto":
            return int(self.virtual_stages)
        return 2 if self.schedule in ("interleaved_1f1b", "zbv", "dualpipev") else 1


_TP_REFUSED = ("this DeepSpeed AutoTP/inference option is not implemented (shardspeed's tensor parallelism is "
               "configured by autotp_size, partition_config, preset_model and sequence_parallel); remove it")
_REFUSED_DOC = "Refused when set: not implemented."


class TensorParallelConfig(ConfigModel):
    """`tensor_parallel`: DeepSpeed's AutoTP training block. `autotp_size` sizes the mesh's model
    dimension (data-parallel size = world / (pipeline stages × autotp_size)); `initialize` splits the
    model's layers over it with the plan of `preset_model` (or the one the model implies:
    `shardspeed.models.GPT`, Hugging Face GPT-2, Llama-style names) and the `partition_config` patterns.
    Unmatched layers stay replicated (see docs/parallelism.md)."""

    ALIASES = {"tp": "tensor_parallel", "kernel_inject": "replace_with_kernel_inject"}

    autotp_size: int = field(0, "Tensor-parallel degree: the size of the mesh's model dimension (0 or 1: "
                             "none).", ge=0)
    dtype: Optional[str] = field(None, "DeepSpeed: the dtype AutoTP converts the model to (shardspeed uses the "
                                 "fp16/bf16 blocks).", ignored=True)
    tp_overlap_comm: bool = field(False, "DeepSpeed: overlap tensor-parallel all-reduces with compute.",
                                  ignored=True)
    keep_module_on_host: bool = field(False, "DeepSpeed: keep checkpoint weights on the host while loading.",
                                      ignored=True)
    vocab_parallel_ce_backend: Literal["torch", "liger"] = field(
        "torch", "DeepSpeed: the vocabulary-parallel cross-entropy kernel.", ignored=True)
    partition_config: Optional[Dict[str, Any]] = field(
        None, "Which layers to split: {\"layer_specs\": [{\"patterns\": [regex, ...], \"partition_type\": "
        "\"row\"|\"column\"|\"skip\", \"shape\": [k, -1]}], \"use_default_specs\": true, "
        "\"strict_mode\": false}; patterns match module (or weight) names with re.match, first match wins, "
        "before the preset's rules unless use_default_specs is false.")
    preset_model: Optional[str] = field(None, "The built-in plan: \"gpt2\", \"llama\" (also mistral, qwen2, "
                                        "...), \"shardspeed_gpt\"; None: the one the model implies.")
    sequence_parallel: bool = field(False, "shardspeed extension: split activations along the sequence between "
                                    "tensor-parallel regions (norms, dropout, residuals; all-gather and "
                                    "reduce-scatter instead of all-reduce). shardspeed.models.GPT only.")
    vocab_parallel_lm_head: Optional[bool] = field(None, "DeepSpeed: shard the LM head by vocabulary (always "
                                                   "done by the presets). " + _REFUSED_DOC)
    injection_policy_tuple: Optional[List[Any]] = field(None, "DeepSpeed: the AutoTP parser's injection "
                                                        "policy. " + _REFUSED_DOC)
    replace_with_kernel_inject: bool = field(False, "DeepSpeed: inject inference kernels. Also "
                                             "`kernel_inject`. " + _REFUSED_DOC)
    tensor_parallel: Dict[str, Any] = field(default_factory=dict, description="DeepSpeed: the inference "
                                            "TP settings (`tp_size`, ...). Also `tp`. " + _REFUSED_DOC)

    @model_validator(mode="after")
    def _refused(self) -> TensorParallelConfig:
        for key in ("vocab_parallel_lm_head", "injection_policy_tuple", "replace_with_kernel_inject",
                    "tensor_parallel"):
            if getattr(self, key) not in (None, False, {}):
                raise PydanticCustomError("rejected_key", "'{key}': {reason}", {"key": key, "reason": _TP_REFUSED})
        return self

    @property
    def size(self) -> int:
        """The model dimension's size: `autotp_size`, with 0 meaning 1."""
        return max(int(self.autotp_size), 1)
