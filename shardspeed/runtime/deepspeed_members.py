"""One job: DeepSpeedEngine's members that the :class:`~shardspeed.runtime.engine.Engine` takes from this mixin,
with DeepSpeed's behaviour and return types (DeepSpeed 0.19.8); engine.py keeps the step.

The getters answer from the parts the builder made (never from the config again), and the config getters
DeepSpeed has by the hundred are not repeated here: a DeepSpeedEngine member the engine does not provide
(:data:`DEEPSPEED_ENGINE_MEMBERS`) fails where it is used with the one line of
:func:`shardspeed.compat.not_provided`, instead of being looked up on the wrapped module. docs/integrations.md
("Engine members") lists what is not provided.
"""
from __future__ import annotations

import dataclasses
import gc
import os
from typing import TYPE_CHECKING, Any, Callable, Container, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist

from ..compat.alias import not_provided
from ..errors import ConfigError, NotProvidedError, ShardspeedError
from ..mesh.current import CURRENT
from ..utils.timer import ThroughputTimer
from .compat_links import link_engine
from .compiled_blocks import CompiledBlocks
from .state_offload import StateOffload

if TYPE_CHECKING:  # pragma: no cover
    from ..plan import Plan
    from .parts import EngineParts

ENGINE_NAME = "deepspeed.runtime.engine.DeepSpeedEngine"
_DEEPSPEED_OPTIMIZERS = ("adagrad", "adam", "adamw", "lamb", "muadam", "muadamw", "musgd", "lion", "muon")
ROUTE_TRAIN, ROUTE_EVAL, ROUTE_PREDICT = "train", "eval", "predict"  # deepspeed_io's routes, as DeepSpeed's

#: The public members of DeepSpeed 0.19.8's DeepSpeedEngine (its class, and the attributes its ``__init__``
#: sets) that ``torch.nn.Module`` lacks. The engine provides some; asking it for any other fails with the one line.
DEEPSPEED_ENGINE_MEMBERS = frozenset("""
aio_config all_gather_scalar all_to_all_group allreduce_and_copy allreduce_bucket allreduce_gradients
allreduce_no_retain autotp_size autotuning_enabled autotuning_end_profile_step autotuning_metric
autotuning_metric_path autotuning_model_info_path autotuning_profile_model_info autotuning_start_profile_step
backward basic_optimizer bf16_master_weights_and_gradients bf16_optimizer_states bfloat16_enabled
buffered_allreduce_fallback checkpoint_engine checkpoint_mp_rank checkpoint_serialization_enabled
checkpoint_tag_validation_enabled checkpoint_tag_validation_fail checkpoint_writer_enabled client_lr_scheduler
client_optimizer clip_fp32_gradients coalesce_grad_reduction collate_fn collect_python_gc communication_data_type
compile compile_autosp compile_autotp compile_zero_optimization_stage config cpuadam_cores_perc
curriculum_learning_config curriculum_learning_enabled data_efficiency_config data_efficiency_enabled
data_parallel_group data_sampling_config data_sampling_enabled dataloader_drop_last deepspeed_io destroy device
dist_backend dont_change_device dp_world_size dump_state dynamic_loss_scale dynamic_loss_scale_args
empty_partition_cache enable_backward_allreduce engine_timers engine_timers_cache expert_data_parallel_group
expert_parallel_group flatten flops_profiler_detailed flops_profiler_enabled flops_profiler_module_depth
flops_profiler_output_file flops_profiler_profile_step flops_profiler_recompute_fwd_factor
flops_profiler_top_modules fp16_auto_cast fp16_enabled fp16_master_weights_and_gradients gate_modules
get_autosp_backend get_autotp_backend get_batch_info get_compile_time get_data_parallel_rank get_data_types
get_deepcompile_backend get_deepspeed_compile_backend get_global_grad_norm get_lr get_model_parallel_rank get_mom
get_optimizer_configuration get_sequence_parallel_group get_tensor_parallel_rank get_type get_wall_clock_timers
global_rank global_samples global_steps gradient_accumulation_steps gradient_average gradient_clipping
gradient_predivide_factor has_moe_layers initial_dynamic_scale inside_no_sync_ctxt is_compiled
is_deepcompile_active is_deepcompile_enabled is_first_weights_partition_group is_gradient_accumulation_boundary
is_iterable_style_dataset is_map_style_dataset is_sanity_checks_enabled load_checkpoint load_module_state_dict
load_moe_state_dict load_universal_checkpoint loaded_checkpoint_dp_world_size loaded_checkpoint_mp_world_size
local_all_to_all_group local_rank log_level loss_scale losses lr_scheduler managed_gradient_accumulation
memory_breakdown mesh_device micro_steps module module_forward_post_hook module_forward_pre_hook
module_state_dict moe_layers monitor mp_world_size mpu no_sync num_experts offload_states
optimized_linear_base_weight_sharding optimized_linear_lora_enabled optimizer optimizer_legacy_fusion
optimizer_name optimizer_params param_names pipeline_parallelism postscale_gradients print_forward_breakdown
random_ltd_config random_ltd_enabled random_ltd_initialize register_compile_pass reload_states save_16bit_model
save_checkpoint save_fp16_model save_non_zero_checkpoint save_zero_checkpoint scale scale_wrt_gas scheduler_name
scheduler_params seq_data_parallel_group seq_dp_world_size sequence_parallel_size
set_custom_curriculum_learning_schedule set_data_post_process_func set_gradient_accumulation_boundary
set_train_batch_size set_train_micro_batch_size skipped_steps sparse_all_gather sparse_allreduce
sparse_allreduce_bucket sparse_allreduce_no_retain step steps_per_print super_offload swap_tensor_config
tensor_parallel_config timers torch_autocast_dtype torch_autocast_enabled
torch_autocast_lower_precision_safe_modules torch_autocast_z0_gradscaler tput_timer train_batch_size
train_micro_batch_size_per_gpu training training_data training_dataloader unflatten use_ds_comm
use_node_local_storage uses_parallelization_pass_only wall_clock_breakdown warn_unscaled_loss was_step_applied
world_size zenflow zenflow_config zero_allgather_bucket_size zero_allgather_partitions zero_allgather_sequential
zero_allow_untested_optimizer zero_compute_grad_norm zero_contiguous_gradients zero_cpu_offload
zero_elastic_checkpoint zero_force_ds_cpu_optimizer zero_gather_16bit_weights_on_model_save
zero_hpz_partition_size zero_ignore_unused_parameters zero_legacy_stage1 zero_load_from_fp32_weights
zero_log_trace_cache_warnings zero_max_live_parameters zero_max_reuse_distance zero_model_persistence_threshold
zero_module_granularity_threshold zero_multi_rank_bucket_allreduce zero_nvme_offload_optimizer
zero_offload_optimizer zero_offload_param zero_optimization zero_optimization_partition_gradients
zero_optimization_partition_weights zero_optimization_stage zero_overlap_comm zero_param_persistence_threshold
zero_parameter_alignment zero_partial_offload zero_prefetch_bucket_size zero_quantized_gradients
zero_quantized_nontrainable_weights zero_quantized_weights zero_reduce_bucket_size zero_reduce_scatter
zero_round_robin_gradients zero_save_muon_momentum_buffer_in_memory zero_sub_group_size zero_use_cpu_optimizer
""".split())


def missing_member(name: str) -> Optional[NotProvidedError]:
    """The one-line error for a DeepSpeedEngine member the engine lacks; None for any other name."""
    return not_provided(f"{ENGINE_NAME}.{name}") if name in DEEPSPEED_ENGINE_MEMBERS else None


class DeepSpeedMembers:
    """DeepSpeedEngine's members over the engine's parts (``self._p``): a mixin of :class:`Engine`."""

    _p: EngineParts
    optimizer: Any
    lr_scheduler: Any
    module: Any
    global_steps: int
    wait_checkpoint: Callable[[], None]

    def _init_deepspeed_members(self) -> None:
        self.tput_timer = ThroughputTimer(batch_size=self._p.train_batch_size, steps_per_output=self.steps_per_print())
        link_engine(self)  # DeepSpeed's names find the engine: isinstance(optimizer, DeepSpeedOptimizer), safe_get_*
        self._states = StateOffload(self._p.topology.device)
        self._compiled = CompiledBlocks()  # engine.compile()
        self._record_overflow(False)
        self._step_applied = False  # no step yet

    def destroy(self) -> None:
        """End of training (DeepSpeed's name): waits for the save in flight (``wait_checkpoint``); then
        DeepSpeed's module-level functions (``utils.groups``, ``checkpointing``) no longer answer for this
        engine (the one built before it, if alive, is current again), and its hooks come off the model (as
        DeepSpeed's stage-3 optimizer's ``destroy`` removes its module hooks). Call it before destroying process
        groups."""
        self.wait_checkpoint()
        self._p.scope.close()
        self._p.zero.close()
        self._compiled.close()
        CURRENT.engines.discard(self)

    def train_batch_size(self) -> int:
        return self._p.train_batch_size

    def train_micro_batch_size_per_gpu(self) -> int:
        return self._p.micro_batch_size

    def gradient_accumulation_steps(self) -> int:
        return self._p.gradient_accumulation_steps

    def zero_optimization_stage(self) -> int:
        return self._p.zero_stage

    def _before_update(self) -> None:
        """Before the optimizer updates the states: wait for a save in flight; refuse offloaded states."""
        if self._states.offloaded:
            raise ShardspeedError("step() after offload_states(): call engine.reload_states() first")
        self._p.async_saves.before_update()

    def _record_overflow(self, overflow: bool) -> None:
        """After an optimizer step: ``was_step_applied()`` and DeepSpeed's ``optimizer.overflow`` (which
        accelerate's ``step_was_skipped`` reads)."""
        self._step_applied = not overflow
        if self.optimizer is not None:
            self.optimizer.overflow = bool(overflow)

    @property
    def shardspeed_config(self) -> Any:
        """The validated ``ShardspeedConfig`` (``engine.config`` is the dict given, as DeepSpeed's): for reading
        only; the engine's parts were built from the plan decided of it."""
        source = self._p.plan.source if self._p.plan is not None else None
        return source.loaded if source is not None else None

    def _plan(self) -> Plan:
        plan = self._p.plan
        assert plan is not None, "an engine built by shardspeed.initialize has its plan"
        return plan

    # ---- ranks and groups ----------------------------------------------------------------------------
    @property
    def local_rank(self) -> int:
        return int(os.environ.get("LOCAL_RANK", "0"))

    @property
    def world_size(self) -> int:
        return dist.get_world_size()

    @property
    def mp_world_size(self) -> int:
        """The tensor-parallel degree (DeepSpeed's model-parallel world)."""
        return self._p.topology.model_size

    @property
    def sequence_parallel_size(self) -> int:
        return self._p.topology.sequence_size

    @property
    def seq_dp_world_size(self) -> int:
        """The shard group (ZeRO's): data × expert × sequence."""
        return self._p.topology.shard_size

    @property
    def data_parallel_group(self) -> Any:
        """The ranks that read different samples (``dp_world_size`` of them)."""
        group = self._p.topology.batch_group
        return group if group is not None else dist.group.WORLD

    @property
    def seq_data_parallel_group(self) -> Any:
        group = self._p.topology.shard_group
        return group if group is not None else dist.group.WORLD

    def get_data_parallel_rank(self) -> int:
        return self._p.topology.batch_rank

    def get_model_parallel_rank(self) -> int:
        return self._p.topology.model_rank

    get_tensor_parallel_rank = get_model_parallel_rank

    def get_sequence_parallel_group(self) -> Optional[dist.ProcessGroup]:
        return self._p.topology.sequence_group

    # ---- what the config decided (as the builder built it) ------------------------------------------------
    def fp16_enabled(self) -> bool:
        return self._p.train_dtype == torch.float16

    def bfloat16_enabled(self) -> bool:
        return self._p.train_dtype == torch.bfloat16

    def torch_autocast_enabled(self) -> bool:
        return self._p.autocast is not None

    def torch_autocast_dtype(self) -> Optional[torch.dtype]:
        return self._p.autocast

    def bf16_master_weights_and_gradients(self) -> bool:
        return self._p.master.master_dtype == torch.bfloat16

    def bf16_optimizer_states(self) -> bool:  # bf16 masters offloaded keep fp32 moments without it
        return self._p.master.state_dtype == torch.bfloat16

    def fp16_master_weights_and_gradients(self) -> bool:
        return self._p.master.master_dtype == torch.float16

    def zero_optimization(self) -> bool:
        return self._p.zero_stage > 0

    def zero_optimization_partition_gradients(self) -> bool:
        return self._p.zero_stage >= 2

    def zero_optimization_partition_weights(self) -> bool:
        return self._p.zero_stage >= 3

    def _zero_block(self) -> Any:
        cfg = self.shardspeed_config
        return cfg.zero_optimization if cfg is not None else None

    def zero_offload_optimizer(self) -> Any:
        """The config's ``offload_optimizer`` block (``.device``, ``.pin_memory``, ...) or None, as DeepSpeed's."""
        z = self._zero_block()
        return z.offload_optimizer if z is not None else None

    def zero_offload_param(self) -> Any:
        """The config's ``offload_param`` block or None, as DeepSpeed's."""
        z = self._zero_block()
        return z.offload_param if z is not None else None

    def zero_cpu_offload(self) -> bool:
        return self._plan().placement.optimizer == "host"

    def zero_gather_16bit_weights_on_model_save(self) -> bool:
        return bool(self._p.gather_16bit_weights_on_save)

    def gradient_clipping(self) -> float:
        return float(self._p.gradient_clipping)

    def steps_per_print(self) -> Optional[int]:
        return self._p.steps_per_print

    def wall_clock_breakdown(self) -> bool:
        return bool(self._p.wall_clock_breakdown)

    def dataloader_drop_last(self) -> bool:
        return self._plan().batch.drop_last

    def dynamic_loss_scale(self) -> bool:
        return bool(getattr(self._p.loss_scaler, "dynamic", False))

    def loss_scale(self) -> float:
        """The configured static fp16 loss scale, 0 for dynamic scaling (DeepSpeed's ``loss_scale()``); the
        scale in use now is ``cur_scale``."""
        return self._plan().precision.loss_scale.static_scale

    @property
    def cur_scale(self) -> float:
        """The loss scale in use now (1.0 unless fp16)."""
        return float(self._p.loss_scaler.scale)

    def optimizer_name(self) -> Optional[str]:
        block = self._plan().optimizer.optimizer
        if block is not None:  # DeepSpeed's own optimizers' names in lower case
            return block.type.lower() if block.type.lower() in _DEEPSPEED_OPTIMIZERS else block.type
        return type(self.optimizer).__name__ if self.optimizer is not None else None

    def scheduler_name(self) -> Optional[str]:
        block = self._plan().optimizer.scheduler
        return block.type if block is not None else None

    # ---- the step's state ------------------------------------------------------------------------------
    def get_mom(self) -> List[Any]:
        """Per parameter group: ``momentum`` for SGD and RMSprop, else the ``betas`` tuple (0.0 where missing)."""
        if self.optimizer is None:
            return []
        key = "momentum" if type(self.optimizer).__name__ in ("SGD", "RMSprop") else "betas"
        return [g.get(key, 0.0) for g in self.optimizer.param_groups]

    def was_step_applied(self) -> bool:
        """Whether the last ``step()`` updated the parameters (False between accumulation boundaries and on
        a skipped step)."""
        return self._step_applied

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        """``loss`` times the loss scale, for a ``loss.backward()`` of one's own (then ``step()``)."""
        s = self._p.loss_scaler.scale
        return loss * s if s != 1.0 else loss

    # ---- batch sizes -------------------------------------------------------------------------------------
    def get_batch_info(self) -> Tuple[int, int, int]:
        """(train_batch_size, train_micro_batch_size_per_gpu, gradient_accumulation_steps)."""
        p = self._p
        return p.train_batch_size, p.micro_batch_size, p.gradient_accumulation_steps

    def set_train_batch_size(self, train_batch_size: int) -> None:
        """Change the global batch by changing the accumulation steps (the micro-batch stays)."""
        per_step = self._p.micro_batch_size * self._p.topology.batch_world
        if train_batch_size % per_step != 0:
            raise ConfigError(f"set_train_batch_size({train_batch_size}): must be a multiple of micro-batch × "
                              f"data-parallel ranks = {per_step}")
        self._p = dataclasses.replace(self._p, train_batch_size=int(train_batch_size),
                                      gradient_accumulation_steps=int(train_batch_size) // per_step)

    def set_train_micro_batch_size(self, micro_batch_size: int) -> None:
        """Change the micro-batch, keeping the accumulation steps (the global batch follows). The data loader
        built by ``initialize`` keeps its batch size, as DeepSpeed's."""
        p = self._p
        self._p = dataclasses.replace(p, micro_batch_size=int(micro_batch_size), train_batch_size=int(
            micro_batch_size) * p.gradient_accumulation_steps * p.topology.batch_world)

    # ---- data ---------------------------------------------------------------------------------------------
    @staticmethod
    def is_map_style_dataset(obj: Any) -> bool:
        return hasattr(obj, "__getitem__") and hasattr(obj, "__len__")

    @staticmethod
    def is_iterable_style_dataset(obj: Any) -> bool:
        return isinstance(obj, torch.utils.data.IterableDataset)

    def deepspeed_io(self, dataset, batch_size: Optional[int] = None, route: str = ROUTE_TRAIN,
                     pin_memory: bool = True, data_sampler=None, collate_fn=None,
                     num_local_io_workers: Optional[int] = None):
        """A loader giving this data-parallel rank its share of ``dataset`` in micro-batches (shuffled for
        ``route="train"``, in order for eval and predict), or batches of ``data_sampler``."""
        from .dataloader import build_dataloader

        if not (self.is_map_style_dataset(dataset) or self.is_iterable_style_dataset(dataset)):
            raise ShardspeedError("deepspeed_io: the data must be a torch Dataset")
        batch = int(batch_size or self._p.micro_batch_size)
        if data_sampler is not None or num_local_io_workers:
            return torch.utils.data.DataLoader(dataset, batch_size=batch, sampler=data_sampler,
                                               collate_fn=collate_fn, num_workers=num_local_io_workers or 0,
                                               drop_last=self.dataloader_drop_last(),
                                               pin_memory=pin_memory and self._p.topology.device.type == "cuda")
        return build_dataloader(dataset, batch, self._p.topology, collate_fn=collate_fn,
                                drop_last=self.dataloader_drop_last(), shuffle=route == ROUTE_TRAIN)

    # ---- memory ---------------------------------------------------------------------------------------------
    def empty_partition_cache(self) -> None:
        """ZeRO stage 3: release every gathered parameter (persistent ones too; gathered again at their next use)
        and return the freed blocks to the device."""
        if not self._p.zero.sharded:
            return
        self._p.zero.after_step()  # its "parameters changed": drops every gathered copy
        gc.collect()
        if self._p.topology.device.type == "cuda":
            torch.cuda.empty_cache()

    def offload_states(self, include: Optional[Container[Any]] = None, device: Any = "cpu", pin_memory: bool = True,
                       non_blocking: bool = False) -> None:
        """Move optimizer states, fp32 master weights and gradient buffers off the device (see
        :mod:`shardspeed.runtime.state_offload`); :meth:`reload_states` brings them back."""
        if self._plan().placement.params != "device":
            raise ShardspeedError("offload_states() with offload_param: the parameters are offloaded already; "
                                  "moving states is not supported then (as in DeepSpeed)")
        if self.optimizer is None:
            raise ShardspeedError("offload_states() needs an optimizer (this engine has none)")
        self._states.offload(self._p.master, self._p.zero, include, device, pin_memory, non_blocking)
        if self._p.topology.device.type == "cuda":
            torch.cuda.empty_cache()

    def reload_states(self, non_blocking: bool = False) -> None:
        """Bring back what :meth:`offload_states` moved, to where it was."""
        self._states.reload(self._p.master, non_blocking)

    # ---- compile, export ----------------------------------------------------------------------------------
    @property
    def is_compiled(self) -> bool:
        """Whether :meth:`compile` ran (DeepSpeed's property)."""
        return self._compiled.is_compiled

    @property
    def compiled_blocks(self) -> CompiledBlocks:
        """What :meth:`compile` compiled (:class:`~shardspeed.runtime.compiled_blocks.CompiledBlocks`: its
        ``modules``, ``backend``, ``is_compiled``)."""
        return self._compiled

    def compile(self, backend: Any = "inductor", compile_kwargs: Optional[Dict[str, Any]] = None,
                schedule: Any = None, compiled_autograd_enabled: bool = False) -> None:
        """``torch.compile`` each transformer block's forward, the engine's hooks eager at the blocks'
        boundaries (DeepSpeed's signature; :func:`shardspeed.runtime.compiling.compile_engine_model`). A second
        call does nothing."""
        self._compiled.compile(self.module, self._p.topology.device, backend, compile_kwargs, schedule,
                               compiled_autograd_enabled)

    def save_fp16_model(self, save_dir: str, save_filename: str = "pytorch_model.bin") -> bool:
        """DeepSpeed's older name of ``save_16bit_model``."""
        return self.save_16bit_model(save_dir, save_filename)  # type: ignore[attr-defined]

    def _consolidated_16bit_state_dict(self, exclude_frozen_parameters: bool = False):
        """The full 16-bit state dict on rank 0 where the weights are partitioned (stage 3, tensor parallelism);
        a ValueError otherwise, as DeepSpeed's."""
        if self._p.zero_stage < 3 and self._p.topology.model_size == 1:
            raise ValueError("consolidated_16bit_state_dict is only applicable to cases where weights are "
                             "partitioned, including Zero Stage 3 and tensor parallelism.")
        return self._zero3_consolidated_16bit_state_dict(exclude_frozen_parameters)  # type: ignore[attr-defined]
