"""One job: the training engine, DeepSpeed's method names as thin orchestration over parts built once.

The engine never reads the config: :mod:`shardspeed.runtime.builder` decides which parts to assemble
(:class:`EngineParts`). What it reports on its steps is done by parts it calls (:mod:`.reporting`,
:mod:`.progress`, the monitors), handed a :class:`~shardspeed.monitor.step_snapshot.StepSnapshot`;
DeepSpeed's getters and members are its mixin :class:`~.deepspeed_members.DeepSpeedMembers`.
"""
from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Callable, Dict, List, Optional, Sequence, Type

import torch
import torch.nn as nn

from ..checkpoint import load_checkpoint, save_16bit_model, save_checkpoint
from ..checkpoint.export import gathered_state_dict
from ..checkpoint.stateful import CheckpointParts, LoaderPosition, RNGState, TrainingCounters, as_stateful
from ..comm.collectives import Collectives, CommsLogger
from ..compat.alias import module_getattr
from ..errors import ShardspeedError
from ..mesh.topology import Topology
from ..monitor.master import MonitorMaster
from ..monitor.step_snapshot import StepSnapshot
from ..monitor.timers import Timers
from ..zero.master import MasterWeights
from ..zero.root import ZeroRoot
from .deepspeed_members import DeepSpeedMembers, missing_member
from .parts import EngineParts, move_inputs, no_move_error
from .progress import ProgressSlot, make_progress
from .reporting import step_reports


class Engine(DeepSpeedMembers, nn.Module):
    """Wraps a module for training; create it with :func:`shardspeed.initialize`.

    An ``nn.Module`` as DeepSpeedEngine is: the model is the registered submodule ``module`` (what
    Lightning and accelerate's ``unwrap_model`` look for), so ``state_dict()`` / ``named_parameters()`` give
    its tensors under ``module.<name>`` as DeepSpeedEngine's do, ``engine(x)`` runs :meth:`forward`, and
    attributes the engine lacks are looked up on the module (DeepSpeedEngine's members it lacks fail with one
    line). Optimizer, schedule, loader: plain attributes; DeepSpeed's getters: :class:`DeepSpeedMembers`."""

    def __init__(self, parts: EngineParts):
        super().__init__()
        self._p = parts
        self._modules["module"] = parts.module  # registered: nn.Module methods recurse into it
        self.__dict__["module"] = parts.module  # and a plain attribute, so self.module skips __getattr__
        self.optimizer = parts.master.optimizer
        self.lr_scheduler = parts.lr_scheduler
        self.training_dataloader = parts.training_dataloader
        self.config = parts.config_dict  # the config dict given, as DeepSpeed's; the parsed one: shardspeed_config
        self.global_steps = self.global_samples = self.micro_steps = self.skipped_steps = 0
        self._grad_norm: Optional[float] = None
        self._boundary_override: Optional[bool] = None
        self._in_no_sync = False
        self._timers = parts.timers
        self._last_loss: Optional[torch.Tensor] = None
        self._memory, self._log, self._flops = step_reports(parts)  # the engine's reports, told of each step
        self._progress = ProgressSlot()  # the bar of progress(), refreshed after each optimizer step
        parts.zero.set_sync_policy(self._reduce_this_micro_step)
        # engine.monitor: DeepSpeed's MonitorMaster (write_events); the step's events come from parts.monitor
        self.monitor = parts.monitor.master if parts.monitor is not None else MonitorMaster()
        self._init_deepspeed_members()

    # ---- DeepSpeed-compatible properties ----------------------------------------------------------
    @property
    def device(self) -> torch.device:
        return self._p.topology.device

    @property
    def param_manager(self):
        """Stage 3's :class:`~shardspeed.zero.root.ZeroRoot` (its units, gather counts), else None."""
        return self._p.zero if self._p.zero.sharded else None

    @property
    def master_weights(self) -> MasterWeights:
        """This rank's :class:`~shardspeed.zero.master.MasterWeights` (``OffloadedMasterWeights`` when offloading):
        DeepSpeed's ZeRO optimizer wrapper; ``engine.optimizer`` is the torch optimizer it steps."""
        return self._p.master

    @property
    def reducer(self) -> ZeroRoot:
        """The :class:`~shardspeed.zero.root.ZeroRoot` that buckets and reduces gradients in backward."""
        return self._p.zero

    @property
    def comms_logger(self) -> CommsLogger:
        """The :class:`~shardspeed.comm.collectives.CommsLogger` counting this rank's collectives (``reset()``)."""
        return self._p.comms_logger

    @property
    def topology(self) -> Topology:
        """This rank's groups and coordinates in the mesh (passed explicitly to every part)."""
        return self._p.topology

    @property
    def data_collectives(self) -> Collectives:
        """The collectives over this rank's data-parallel group."""
        return self._p.collectives

    @property
    def train_dtype(self) -> torch.dtype:
        """The dtype the module computes in (fp16 / bf16 / fp32)."""
        return self._p.train_dtype

    def boundary_step(self, before_optimizer: Optional[Callable[[ZeroRoot], None]] = None) -> None:
        """The boundary's work for a driver running forward and backward itself (after record_step_loss):
        reduce what is pending, ``before_optimizer(reducer)`` (e.g. sum tied gradients), step, monitors."""
        with self._timers("step"):
            self._p.zero.reduce_pending()
            if before_optimizer is not None:
                before_optimizer(self._p.zero)
            done = self._optimizer_step()
        if self._p.monitor is not None:  # after the step timer stopped, as in step()
            self._p.monitor.after_step(done, self._timers)

    @property
    def last_loss(self) -> Optional[torch.Tensor]:
        """The last loss given to :meth:`backward` (a pipeline: the step's mean), not converted (no host sync)."""
        return self._last_loss

    def attach_progress(self, bar: Any) -> None:
        """``bar.on_optimizer_step()`` runs after each optimizer step (:meth:`progress` attaches its bar)."""
        self._progress.attach(bar)

    def detach_progress(self, bar: Any) -> None:
        self._progress.detach(bar)

    def record_step_loss(self, loss: torch.Tensor) -> None:
        """A driver's mean loss of the step it takes next (:meth:`boundary_step`): what its reports show."""
        self._last_loss = loss
        if self._p.monitor is not None:
            self._p.monitor.add_loss(loss)  # the step's mean loss (every rank has it)

    @property
    def timers(self) -> Timers:
        """The ``wall_clock_breakdown`` timers (``timers("forward")`` is a context manager)."""
        return self._timers

    def get_lr(self) -> List[float]:
        return [g["lr"] for g in self.optimizer.param_groups]

    def get_global_grad_norm(self) -> Optional[float]:
        return self._grad_norm

    @property
    def dp_world_size(self) -> int:
        return self._p.topology.batch_world  # the data dimension: SP ranks share samples

    @property
    def mpu(self):
        """DeepSpeed's group getters (`shardspeed.mesh.mpu.MeshMPU`), or the user's ``initialize(mpu=...)``."""
        from ..mesh.mpu import mpu_for

        return mpu_for(self._p.topology)

    @property
    def global_rank(self) -> int:
        return torch.distributed.get_rank()

    # ---- nn.Module behaviour ------------------------------------------------------------------------
    def __getattr__(self, name: str) -> Any:
        """Attributes the engine lacks come from the module (as DeepSpeedEngine), except private ones."""
        try:
            return super().__getattr__(name)
        except AttributeError:
            module, missing = self.__dict__.get("module"), missing_member(name)
            if missing is not None:  # a DeepSpeedEngine member the engine lacks: the one line, not the module's
                raise missing from None
            if module is not None and not name.startswith("_"):
                try:
                    return getattr(module, name)
                except AttributeError:
                    pass
            raise AttributeError(f"'{type(self).__name__}' object (nor its module) has no attribute '{name}'") from None

    def train(self, mode: bool = True) -> Engine:
        super().train(mode)  # the engine's and the module's (recursively) training flags
        return self

    def _sharded_placeholders(self) -> bool:
        """Stage 3 outside a gather: module parameters are empty placeholders of their shards."""
        return any(tuple(p.shape) != tuple(shape) for u in self._p.master.units for p, shape in zip(u.params, u.shapes))

    def state_dict(self, *args, **kwargs):
        """The module's tensors under ``module.<name>`` (DeepSpeedEngine's keys; ``module_state_dict()`` gives
        the module's own). Stage 3 raises unless the parameters are gathered (``GatheredParameters``)."""
        if self._sharded_placeholders():
            raise ShardspeedError(
                "state_dict() at ZeRO stage 3: the module's parameters are sharded (empty placeholders). Use "
                "save_checkpoint (sharded), save_16bit_model, or call it inside "
                "shardspeed.zero.GatheredParameters(list(engine.parameters()))")
        return super().state_dict(*args, **kwargs)

    def module_state_dict(self, *args, **kwargs):
        """The module's own ``state_dict`` (keys without ``module.``), as DeepSpeedEngine.module_state_dict."""
        if self._sharded_placeholders():
            return self.state_dict()  # raises the stage-3 error
        return self.module.state_dict(*args, **kwargs)

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        """Load weights into the module, then refresh the fp32 masters from them (so the next step continues
        from the loaded weights; optimizer state is kept). Keys as :meth:`state_dict` gives them
        (``module.<name>``) or the module's own. Every rank must load the same weights."""
        if assign:
            raise ShardspeedError("load_state_dict(assign=True) would replace parameters that are views of the "
                                  "engine's flat ZeRO buffers; load with assign=False")
        if self._sharded_placeholders():
            raise ShardspeedError(
                "load_state_dict() at ZeRO stage 3: the module's parameters are sharded. Use load_checkpoint, or "
                "load inside shardspeed.zero.GatheredParameters(list(engine.parameters()), modifier_rank=0)")
        keys = list(state_dict.keys())
        if keys and not any(k.startswith("module.") for k in keys):
            result = self.module.load_state_dict(state_dict, strict=strict)
        else:
            result = super().load_state_dict(state_dict, strict=strict)
        for ui in range(len(self._p.master.units)):
            self._p.master.refresh_from_shard(ui)
        return result

    def load_module_state_dict(self, state_dict, strict: bool = True):
        """DeepSpeedEngine's name for loading the module's own keys."""
        return self.load_state_dict(state_dict, strict=strict)

    def to(self, *args, **kwargs) -> Engine:
        """A no-op to the engine's own device and training dtype; anything else raises: parameters are views
        of flat ZeRO buffers, and the fp32 masters and optimizer state would not follow."""
        device, dtype, _, _ = torch._C._nn._parse_to(*args, **kwargs)
        same_device = device is None or (device.type == self.device.type
                                         and (device.index is None or device.index == self.device.index))
        if same_device and (dtype is None or dtype == self._p.train_dtype):
            return self
        raise self._no_move_error(f"to({', '.join(map(str, args))})")

    def cpu(self) -> Engine:
        return self.to("cpu")

    def cuda(self, device=None) -> Engine:
        return self.to(torch.device("cuda", device) if isinstance(device, int) else (device or "cuda"))

    def _apply(self, fn, recurse: bool = True):  # half(), float(), bfloat16(), double(), type(), ...
        raise self._no_move_error("half()/float()/bfloat16()/type() (casting or moving)")

    def _no_move_error(self, what: str) -> ShardspeedError:
        return no_move_error(what, self.device, self._p.train_dtype)

    # ---- accumulation boundary -------------------------------------------------------------------
    def is_gradient_accumulation_boundary(self) -> bool:
        if self._boundary_override is not None:
            return self._boundary_override
        return (self.micro_steps + 1) % self._p.gradient_accumulation_steps == 0

    def set_gradient_accumulation_boundary(self, is_boundary: bool) -> None:
        """Override the boundary decision (for loops whose accumulation is irregular)."""
        self._boundary_override = bool(is_boundary)

    @contextmanager
    def no_sync(self):
        """Accumulate gradients locally without reducing them (stages 0 and 1 only)."""
        if self._p.zero_stage >= 2:
            raise ShardspeedError(
                f"no_sync() is not possible at ZeRO stage {self._p.zero_stage}: gradients are partitioned as "
                f"they are produced. Use gradient_accumulation_steps instead, or stage 0/1."
            )
        prev, self._in_no_sync = self._in_no_sync, True
        try:
            yield
        finally:
            self._in_no_sync = prev

    def set_reshard_after_forward(self, reshard: bool, modules: Optional[List[nn.Module]] = None) -> None:
        """Stage 3: ``False`` keeps the parameters of ``modules`` (default: the whole model) gathered from
        their first use until the optimizer step, across every micro-batch (FSDP2's
        ``reshard_after_forward``), e.g. for a pipeline stage or gradients assigned by hand. Stages 0-2
        always hold whole parameters: nothing to do."""
        if self._p.zero.sharded:
            self._p.zero.set_reshard_after_forward(reshard, modules)

    def enable_activation_checkpointing(self, policy: Optional[str] = None,
                                        block_types: Optional[Sequence[Type[nn.Module]]] = None) -> int:
        """Checkpoint every transformer block of the module with ``shardspeed.checkpointing.checkpoint``:
        ``shardspeed.models.GPT``'s blocks, a Hugging Face model's layers (through its own
        ``gradient_checkpointing_enable``), the modules of ``block_types``, or else the repeated blocks of
        the model's largest ``ModuleList``. ``policy``: "full" (keep each block's input only) or "selective"
        (also matmul and attention outputs); None: the config's ``activation_checkpointing.policy``. Works
        at every ZeRO stage. Returns how many blocks are checkpointed. Config switch:
        ``activation_checkpointing.enabled``."""
        from ..checkpointing import checkpoint_blocks

        return len(checkpoint_blocks(self.module, policy=policy, block_types=block_types))

    def disable_activation_checkpointing(self) -> int:
        """Undo :meth:`enable_activation_checkpointing`; returns how many blocks were restored."""
        from ..checkpointing import uncheckpoint_blocks

        return uncheckpoint_blocks(self.module)

    # ---- the step ------------------------------------------------------------------------------------
    def forward(self, *args, **kwargs):
        self.tput_timer.start()
        with self._timers("forward"), self._flops.scope("forward", self.global_steps):
            args, kwargs = move_inputs((args, kwargs), self.device, self._p.train_dtype)
            if self._p.input_check is not None:
                self._p.input_check((args, kwargs))
            if self._p.autocast is not None:  # torch_autocast
                with torch.autocast(self.device.type, dtype=self._p.autocast):
                    return self.module(*args, **kwargs)
            return self.module(*args, **kwargs)

    def backward(self, loss: torch.Tensor, retain_graph: bool = False, scale_wrt_gas: bool = True) -> torch.Tensor:
        """Scale the loss (fp16) and divide it by the accumulation steps, then run autograd.

        ``scale_wrt_gas=False`` (DeepSpeed's keyword; the Hugging Face Trainer passes it, having scaled the
        loss itself) skips the division by the accumulation steps.

        The reduction needs nothing from here: gradient hooks and an end-of-backward callback reduce the
        gradients of any backward (see :class:`~shardspeed.zero.root.ZeroRoot`), so a plain
        ``loss.backward()`` followed by :meth:`step` trains the same (scale and divide the loss yourself
        then). Returns ``loss / gradient_accumulation_steps``, as DeepSpeed does.
        """
        if not torch.is_tensor(loss) or loss.dim() != 0:
            raise ShardspeedError("backward(loss) expects a scalar loss tensor (call .mean() or .sum() first)")
        self._last_loss = loss.detach()  # converted only when printed: no host sync per micro-step
        if self._p.monitor is not None:
            self._p.monitor.add_loss(loss)
        gas = self._p.gradient_accumulation_steps if scale_wrt_gas else 1
        scaled = loss * (self._p.loss_scaler.scale / gas) if self._p.loss_scaler.scale != 1.0 else loss / gas
        with self._timers("backward"), self._flops.scope("backward", self.global_steps):
            scaled.backward(retain_graph=retain_graph)
        return loss.detach() / gas

    def _reduce_this_micro_step(self) -> bool:
        """Asked by the reducer at the start of each backward: does this micro-step end with a reduction."""
        return self.is_gradient_accumulation_boundary() and not self._in_no_sync

    def step(self) -> None:
        """Optimizer step at the accumulation boundary; otherwise only counts the micro-step."""
        if self._in_no_sync:
            raise ShardspeedError("step() was called inside no_sync(): leave the context before stepping")
        self._step_applied = False
        boundary = self.is_gradient_accumulation_boundary()
        if boundary:
            profiled = self._flops.active(self.global_steps)
            with self._timers("step"), self._flops.scope("step", self.global_steps):
                self._p.zero.reduce_pending()  # .grad assigned by hand, backwards that did not reduce
                done = self._optimizer_step()
            if profiled:
                self._flops.report(done, self._p.micro_batch_size)
            if self._p.monitor is not None:  # after the step timer stopped, as DeepSpeed writes them
                self._p.monitor.after_step(done, self._timers)
            if self._p.profile_window is not None:  # a tuner's trial: may write its metrics and exit
                self._p.profile_window.after_step(self.global_steps, self.flops_per_step())
        self.micro_steps += 1
        self.tput_timer.stop(global_step=boundary)
        self._boundary_override = None

    def _optimizer_step(self) -> StepSnapshot:
        p = self._p
        self._before_update()  # a save in flight may still write the state this step changes; states offloaded?
        result = p.master.step(loss_scale=p.loss_scaler.scale, clip=p.gradient_clipping)
        p.zero.after_step()
        p.loss_scaler.update(result.overflow)
        self._record_overflow(result.overflow)
        self._grad_norm = None if result.overflow else result.grad_norm
        if result.overflow:
            self.skipped_steps += 1
            self._log.skipped(self.global_steps, result.grad_norm, self.skipped_steps, p.loss_scaler)
        elif self.lr_scheduler is not None:
            self.lr_scheduler.step()
        p.zero.zero_grads()
        self.global_steps += 1
        self.global_samples += p.train_batch_size
        done = StepSnapshot(self.global_steps, self.global_samples, p.train_batch_size, self._last_loss,
                            tuple(self.get_lr()), self.cur_scale, self._grad_norm)
        self._log.after_step(done)
        self._progress.after_step(done)
        return done

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Drop accumulated gradients (the engine also does this after every optimizer step)."""
        self._p.zero.zero_grads()
        for prm in self.module.parameters():
            prm.grad = None

    # ---- checkpoints (logic in shardspeed.checkpoint) -------------------------------------------------
    def checkpoint_parts(self) -> CheckpointParts:
        """The parts a checkpoint saves and restores, typed (see :mod:`shardspeed.checkpoint.stateful`)."""
        p = self._p
        counters = TrainingCounters(self)
        return CheckpointParts(
            module=self.module, master=p.master, collectives=p.collectives, zero_stage=p.zero_stage,
            train_dtype=p.train_dtype, counters=counters, lr_scheduler=as_stateful(self.lr_scheduler),
            loss_scaler=as_stateful(p.loss_scaler), dataloader=LoaderPosition(self.training_dataloader, counters),
            rng=RNGState(), param_manager=self.param_manager, async_saves=p.async_saves, tag_validation=p.tag_validation,
            gather_16bit_weights_on_save=p.gather_16bit_weights_on_save, coordination=p.world_collectives,
        )

    def save_checkpoint(self, save_dir: str, tag: Optional[str] = None, client_state: Optional[dict] = None,
                        save_latest: bool = True, async_save: Optional[bool] = None,
                        exclude_frozen_parameters: bool = False) -> str:
        """Save the full training state, sharded, under ``{save_dir}/{tag}`` (atomic); every rank calls it.
        ``async_save`` (None: ``checkpoint.async_save``): write and commit in the background (docs/checkpoints.md).
        ``exclude_frozen_parameters`` (DeepSpeed's; Lightning passes it): only False, the whole model is saved."""
        if exclude_frozen_parameters:
            from ..compat.alias import not_provided

            raise not_provided("deepspeed.DeepSpeedEngine.save_checkpoint(exclude_frozen_parameters=True)")
        return save_checkpoint(self, save_dir, tag=tag, client_state=client_state, save_latest=save_latest,
                               async_save=self._p.async_save if async_save is None else async_save)

    def load_checkpoint(self, load_dir: str, tag: Optional[str] = None, load_module_strict: bool = True,
                        load_optimizer_states: bool = True, load_lr_scheduler_states: bool = True,
                        load_module_only: bool = False, trust_pickles: bool = False, load_rng_state: bool = False):
        """Load a checkpoint saved at any world size and stage; returns ``(path, client_state)``.
        ``trust_pickles``: unpickle any class the checkpoint names (runs its code: only for files you trust).
        ``load_rng_state``: also restore every rank's RNG states (off: DeepSpeed's behaviour)."""
        self.wait_checkpoint()
        return load_checkpoint(self, load_dir, tag=tag, load_module_strict=load_module_strict,
                               load_optimizer_states=load_optimizer_states,
                               load_lr_scheduler_states=load_lr_scheduler_states, load_module_only=load_module_only,
                               trust_pickles=trust_pickles, load_rng_state=load_rng_state)

    def save_16bit_model(self, save_dir: str, save_filename: str = "pytorch_model.bin",
                         exclude_frozen_parameters: bool = False) -> bool:
        """Write the weights in the training dtype to ``save_dir/save_filename`` (.bin or .safetensors)."""
        return save_16bit_model(self, save_dir, save_filename, exclude_frozen_parameters)

    def wait_checkpoint(self) -> None:
        """Wait for the asynchronous save in flight, if any, and raise its error on every rank (all call it)."""
        self._p.async_saves.wait(self._p.world_collectives or self._p.collectives)

    def _zero3_consolidated_16bit_state_dict(self, exclude_frozen_parameters: bool = False):
        """The module's full state dict in the training dtype, on the CPU, on rank 0; None on the other ranks
        (DeepSpeedEngine's method, which accelerate's ``get_state_dict`` and the Hugging Face Trainer call).
        Every rank must call it: at stage 3 the units are gathered one at a time. Works at every stage."""
        return gathered_state_dict(self, exclude_frozen_parameters=exclude_frozen_parameters)

    # ---- reporting (logic in .reporting and shardspeed.profiling) ----------------------------------------
    def flops_per_step(self, measured: bool = False) -> Optional[int]:
        """FLOPs this rank computes in one optimizer step (every micro-batch), from the forward and backward
        counted at ``flops_profiler.profile_step``; None before then or when the profiler is off.

        Default: model FLOPs, 3 × the counted forward (DeepSpeed's "fwd+bwd = 3 × fwd flops", the MFU
        convention). ``measured=True``: forward + backward as counted (flash attention's score recompute and
        activation-checkpoint recomputation included, for HFU); a backward run outside :meth:`backward` is
        then estimated as (2 + recompute_fwd_factor) × forward, as DeepSpeed does."""
        return self._flops.per_step(measured)

    def peak_flops(self) -> Optional[float]:
        """Dense peak FLOP/s of this rank's device in the training dtype (``shardspeed.profiling.PEAK_TABLE``);
        None on CPU, in fp32, or for an unlisted device. MFU = flops_per_step / step seconds / peak_flops."""
        from ..profiling.peak import peak_flops

        return peak_flops(self.device, self._p.train_dtype)

    def set_tokens_per_sample(self, tokens: Optional[float]) -> None:
        """Tokens in one sample (e.g. the sequence length): the monitors then write ``tokens_per_sec``."""
        if self._p.monitor is not None:
            self._p.monitor.tokens_per_sample = tokens

    def set_flops_per_sample(self, flops: Optional[float]) -> None:
        """Training FLOPs (forward + backward) of one sample: the monitors then write ``tflops`` per device."""
        if self._p.monitor is not None:
            self._p.monitor.flops_per_sample = flops

    def set_peak_flops(self, flops_per_sec: Optional[float]) -> None:
        """One device's peak FLOP/s in the training dtype: with the FLOPs per sample, the monitors write ``mfu``."""
        if self._p.monitor is not None:
            self._p.monitor.peak_flops = flops_per_sec

    def progress(self, iterable: Any = None, total: Optional[int] = None, desc: Optional[str] = "train",
                 **tqdm_kwargs: Any):
        """A tqdm bar on global rank 0 whose postfix shows loss, LR and samples/s, refreshed by the engine
        after each optimizer step (from its own counters; the loss is read only when the bar redraws).

        Without ``iterable`` the bar counts optimizer steps (give ``total`` = the steps to run); with one,
        it wraps it (``for batch in engine.progress(loader): ...``) and counts its items. Off on other ranks
        and, as tqdm's ``disable=None``, when the output is not a TTY; ``disable=False`` forces it on rank 0.
        Other keyword arguments go to tqdm (``file``, ``initial``, ``mininterval``, ...)."""
        return make_progress(self._progress, self.global_rank, self.global_samples, iterable, total=total, desc=desc,
                             **tqdm_kwargs)

    def comms_summary(self) -> Dict[str, Dict[str, float]]:
        """Collectives issued so far on this rank: per op, count, bytes and seconds."""
        return self._p.comms_logger.summary()

    def memory_breakdown(self) -> Dict[str, int]:
        """Bytes of model states this rank holds, counted from the tensors themselves: on the training device
        (summed in ``total``) and, under ``offloaded_*``, in host memory (NVMe files are not counted)."""
        return self._memory.count()


DeepSpeedEngine = Engine  # DeepSpeed's name: isinstance(engine, deepspeed.DeepSpeedEngine) passes
__getattr__ = module_getattr(__name__)  # DeepSpeed's other names here: the one-line error
