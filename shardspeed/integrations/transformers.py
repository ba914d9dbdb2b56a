"""One job: a Hugging Face ``PreTrainedModel`` trained by the ``Trainer`` through a shardspeed engine.

    from shardspeed.integrations.transformers import ShardspeedTrainer

    trainer = ShardspeedTrainer(model=model, args=TrainingArguments(...), train_dataset=ds,
                                shardspeed_config="ds_config.json")   # DeepSpeed JSON, "auto" values allowed
    trainer.train()                       # or train(resume_from_checkpoint="out/checkpoint-3")
    trainer.save_model("out/final")       # consolidated (stage 3 too): from_pretrained loads it

- :func:`fill_auto` fills a DeepSpeed config's ``"auto"`` values from ``TrainingArguments`` (and the model's
  hidden size, and the number of training steps) exactly as transformers' ``HfTrainerDeepSpeedConfig`` does,
  for users with their own loop; values that are not ``"auto"`` but disagree with the arguments raise
  ``ValueError`` as there.
- :func:`save_pretrained` writes ``engine.module`` with ``save_pretrained`` from the gathered weights (every
  rank calls it; rank 0 writes), at every ZeRO stage.

How the Trainer is driven (transformers 5.x; the hooks overridden, all documented ``Trainer`` methods or
the ones its DeepSpeed path itself goes through): ``create_optimizer`` builds the engine (the config filled
with ``self.state.max_steps`` as the total steps) and returns an optimizer whose ``step``/``zero_grad`` do
nothing (the engine steps); ``create_scheduler`` returns a scheduler whose ``step`` does nothing and whose
``get_last_lr`` is the LR of the last step; ``_wrap_model`` returns the engine (so accelerate never wraps
it in DDP); ``training_step`` runs the Trainer's own ``compute_loss`` through the engine, then
``engine.backward(loss, scale_wrt_gas=False)`` and ``engine.step()`` with the accumulation boundary taken
from ``accelerator.sync_gradients`` (what accelerate does for DeepSpeed; accelerate's ``sync_each_batch``
is switched on so the Trainer does not enter ``no_sync`` between boundaries); ``_clip_grad_norm`` /
``_get_grad_norm`` report the engine's global grad norm; ``_save_optimizer_and_scheduler`` is
``engine.save_checkpoint(checkpoint-N)``; ``_load_from_checkpoint`` / ``_load_optimizer_and_scheduler``
load it with ``engine.load_checkpoint`` once the engine exists; ``save_model`` saves the engine's gathered
16-bit state dict through the Trainer's ``_save``. Everything else (data loading and sharding, loss
scaling for accumulation, logging, callbacks, RNG state, ``trainer_state.json``, rotation) is the
Trainer's own code.
"""
from __future__ import annotations

import copy
import os
from typing import Any, Dict, List, Optional, Union

import torch
import torch.distributed as dist
from transformers import Trainer

from ..utils.safe_files import replacing

__all__ = ["ShardspeedTrainer", "fill_auto", "save_pretrained"]

ConfigLike = Union[str, "os.PathLike[str]", Dict[str, Any]]

_HIDDEN_SIZE_KEYS = (
    "zero_optimization.reduce_bucket_size",
    "zero_optimization.stage3_prefetch_bucket_size",
    "zero_optimization.stage3_param_persistence_threshold",
)


def _read_config(config: ConfigLike) -> Dict[str, Any]:
    if isinstance(config, dict):
        return copy.deepcopy(config)
    from ..config.loader import read_json

    return read_json(config)


class _AutoFiller:
    """The "auto" filling of transformers' ``HfTrainerDeepSpeedConfig`` (``trainer_config_process`` then
    ``trainer_config_finalize``), on a plain dict."""

    def __init__(self, config: Dict[str, Any]):
        self.config = config
        self.mismatches: List[str] = []

    def node(self, key: str):
        cfg: Any = self.config
        *path, leaf = key.split(".")
        for name in path:
            cfg = cfg.get(name) if isinstance(cfg, dict) else None
            if cfg is None:
                return None, leaf
        return cfg, leaf

    def get(self, key: str, default: Any = None) -> Any:
        cfg, leaf = self.node(key)
        return default if cfg is None else cfg.get(leaf, default)

    def is_auto(self, key: str) -> bool:
        return self.get(key) == "auto"

    def is_true(self, key: str) -> bool:
        value = self.get(key)
        return False if value is None else bool(value)

    def fill(self, key: str, value: Any, arg_name: Optional[str] = None, must_match: bool = True) -> None:
        cfg, leaf = self.node(key)
        if cfg is None:
            return
        if cfg.get(leaf) == "auto":
            cfg[leaf] = value
            return
        if must_match and cfg.get(leaf) is not None and cfg.get(leaf) != value:
            self.mismatches.append(f"- ds {key}={cfg.get(leaf)} vs hf {arg_name}={value}")


def _hidden_size(model) -> Optional[int]:
    cfg = getattr(model, "config", None)
    if cfg is None:
        return None
    if hasattr(cfg, "hidden_size"):
        return cfg.hidden_size
    if hasattr(cfg, "hidden_sizes"):
        return max(cfg.hidden_sizes)
    text = getattr(cfg, "text_config", None)
    if text is not None and hasattr(text, "hidden_size"):
        return text.hidden_size
    if text is not None and hasattr(text, "hidden_sizes"):
        return max(text.hidden_sizes)
    return None


def fill_auto(config: ConfigLike, training_args, model=None, num_training_steps: Optional[int] = None,
              auto_find_batch_size: bool = False) -> Dict[str, Any]:
    """A copy of the DeepSpeed ``config`` (dict or JSON path) with its ``"auto"`` values filled as the Hugging
    Face Trainer fills them for DeepSpeed:

    - from ``training_args``: ``train_micro_batch_size_per_gpu`` (per_device_train_batch_size),
      ``gradient_accumulation_steps``, ``train_batch_size`` (world_size × micro × accumulation),
      ``gradient_clipping`` (max_grad_norm), ``optimizer.params`` ``lr``, ``betas`` ([adam_beta1,
      adam_beta2]), ``eps`` (adam_epsilon), ``weight_decay``, ``scheduler.params`` ``warmup_min_lr`` (0) and
      ``warmup_max_lr`` (learning_rate), ``fp16.enabled`` (fp16 or fp16_full_eval), ``bf16.enabled`` (bf16 or
      bf16_full_eval); ``save_on_each_node`` sets ``checkpoint.use_node_local_storage``;
    - from ``model`` (its ``config.hidden_size``, the largest of ``hidden_sizes``, or the text config's):
      ``zero_optimization.reduce_bucket_size`` = hidden², and at stage 3 ``stage3_prefetch_bucket_size`` =
      int(0.9·hidden²) and ``stage3_param_persistence_threshold`` = 10·hidden;
    - from ``num_training_steps``: ``scheduler.params.total_num_steps`` and ``warmup_num_steps``
      (``training_args.get_warmup_steps``, at least 1).

    Keys absent from the config stay absent. Without ``model`` (or ``num_training_steps``) the values that
    need it are left as they are. A value given (not ``"auto"``) that differs from the arguments raises
    ``ValueError`` listing every mismatch, as transformers does.
    """
    args = training_args
    f = _AutoFiller(_read_config(config))
    world = int(getattr(args, "world_size", 1))
    f.fill("train_micro_batch_size_per_gpu", args.per_device_train_batch_size, "per_device_train_batch_size",
           not auto_find_batch_size)
    f.fill("gradient_accumulation_steps", args.gradient_accumulation_steps, "gradient_accumulation_steps")
    f.fill("train_batch_size", world * args.per_device_train_batch_size * args.gradient_accumulation_steps,
           "train_batch_size (calculated)", not auto_find_batch_size)
    f.fill("gradient_clipping", args.max_grad_norm, "max_grad_norm")
    f.fill("optimizer.params.lr", args.learning_rate, "learning_rate")
    f.fill("optimizer.params.betas", [args.adam_beta1, args.adam_beta2], "adam_beta1+adam_beta2")
    f.fill("optimizer.params.eps", args.adam_epsilon, "adam_epsilon")
    f.fill("optimizer.params.weight_decay", args.weight_decay, "weight_decay")
    f.fill("scheduler.params.warmup_min_lr", 0, must_match=False)
    f.fill("scheduler.params.warmup_max_lr", args.learning_rate, "learning_rate")
    if getattr(args, "save_on_each_node", False):
        f.config["checkpoint"] = f.config.get("checkpoint", {})
        f.config["checkpoint"]["use_node_local_storage"] = True
    f.fill("fp16.enabled", bool(args.fp16 or getattr(args, "fp16_full_eval", False)), "fp16|fp16_full_eval")
    f.fill("bf16.enabled", bool(args.bf16 or getattr(args, "bf16_full_eval", False)), "bf16|bf16_full_eval")

    auto_hidden = [k for k in _HIDDEN_SIZE_KEYS if f.is_auto(k)]
    if auto_hidden and model is not None:
        hidden = _hidden_size(model)
        if hidden is None:
            raise ValueError(
                f"the model's config has neither `hidden_size` nor `hidden_sizes`, so these \"auto\" entries "
                f"cannot be filled: {auto_hidden}; give them integer values in the config")
        f.fill("zero_optimization.reduce_bucket_size", hidden * hidden, must_match=False)
        if f.get("zero_optimization.stage", -1) == 3:
            f.fill("zero_optimization.stage3_prefetch_bucket_size", int(0.9 * hidden * hidden), must_match=False)
            f.fill("zero_optimization.stage3_param_persistence_threshold", 10 * hidden, must_match=False)
    if num_training_steps is not None:
        f.fill("scheduler.params.total_num_steps", num_training_steps, "num_training_steps (calculated)")
        f.fill("scheduler.params.warmup_num_steps", max(1, args.get_warmup_steps(num_training_steps)),
               "warmup_steps")
    if f.mismatches:
        raise ValueError("these DeepSpeed config values disagree with the TrainingArguments:\n"
                         + "\n".join(f.mismatches) + "\nset them to \"auto\" (or make them equal)")
    return f.config


def _rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def _agree(error: Optional[str]) -> None:
    """Raise the same error on every rank when any rank (rank 0, the writer) failed."""
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        errors: List[Optional[str]] = [None] * dist.get_world_size()
        dist.all_gather_object(errors, error)
        error = next((e for e in errors if e), None)
    if error:
        raise RuntimeError(error)


def _write_safetensors(state_dict: Dict[str, torch.Tensor], path: str) -> None:
    from safetensors.torch import save_file

    seen, clean = set(), {}
    for k, v in state_dict.items():  # safetensors refuses aliased tensors: tied names get their own copy
        clean[k] = v.clone() if id(v) in seen else v.contiguous()
        seen.add(id(v))
    with replacing(path) as staged:  # never through a link planted at the final name
        save_file(clean, staged, metadata={"format": "pt"})


def save_pretrained(engine, save_directory: Union[str, os.PathLike[str]], exclude_frozen_parameters: bool = False,
                    **kwargs: Any) -> None:
    """Save ``engine.module`` so that ``from_pretrained`` loads it, at any ZeRO stage; every rank calls it.

    The weights are gathered (one unit at a time at stage 3: ``engine._zero3_consolidated_16bit_state_dict``)
    onto rank 0, which calls ``engine.module.save_pretrained(save_directory, state_dict=...)`` (config and
    safetensors; ``kwargs`` go there) or, for a module without ``save_pretrained``, writes
    ``model.safetensors``. Returns when the files are written; a failure on rank 0 raises on every rank."""
    state_dict = engine._zero3_consolidated_16bit_state_dict(exclude_frozen_parameters=exclude_frozen_parameters)
    error = None
    if _rank() == 0:
        try:
            module = engine.module
            if hasattr(module, "save_pretrained"):
                module.save_pretrained(save_directory, state_dict=state_dict, is_main_process=True, **kwargs)
            else:
                os.makedirs(save_directory, exist_ok=True)
                _write_safetensors(state_dict, os.path.join(os.fspath(save_directory), "model.safetensors"))
        except Exception as exc:  # reported on every rank below
            error = f"save_pretrained({os.fspath(save_directory)!r}) failed on rank 0: {type(exc).__name__}: {exc}"
    _agree(error)


class _EngineOptimizer:
    """What the Trainer holds as its optimizer: the engine's param groups and state, ``step`` and
    ``zero_grad`` do nothing (``engine.step`` steps, inside ``training_step``). Its state is saved and loaded
    with the engine's checkpoint, so ``state_dict`` is empty here."""

    def __init__(self, engine):
        self.engine = engine
        self.optimizer = engine.optimizer

    @property
    def param_groups(self):
        return self.optimizer.param_groups

    @property
    def state(self):
        return self.optimizer.state

    @property
    def defaults(self):
        return getattr(self.optimizer, "defaults", {})

    def step(self, closure=None):
        return None

    def zero_grad(self, set_to_none: bool = True) -> None:
        return None

    def state_dict(self) -> Dict[str, Any]:
        return {}

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        return None


class _EngineScheduler:
    """What the Trainer holds as its LR scheduler: the engine steps its own schedule; ``get_last_lr`` gives
    the LRs of the last optimizer step (what the plain Trainer logs), before the first step the current ones."""

    def __init__(self, trainer: ShardspeedTrainer):
        self.trainer = trainer

    def step(self, *args, **kwargs) -> None:
        return None

    def get_last_lr(self) -> List[float]:
        used = self.trainer._last_step_lr
        return list(used) if used is not None else self.trainer.engine.get_lr()

    def state_dict(self) -> Dict[str, Any]:
        return {}

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        return None


class ShardspeedTrainer(Trainer):
    """A ``transformers.Trainer`` that trains through a shardspeed engine built from ``shardspeed_config``
    (a DeepSpeed config dict or JSON path; ``"auto"`` values are filled by :func:`fill_auto`).

    Without an ``optimizer`` block the Trainer's own optimizer (``args.optim``, weight-decay groups) is
    moved into the engine, and without a ``scheduler`` block the Trainer's schedule (``lr_scheduler_type``,
    warm-up) runs on the engine's optimizer, as with DeepSpeed. Checkpoints (``checkpoint-N/``) hold the
    engine's sharded checkpoint (``global_stepN/``, ``latest``) next to the consolidated model and the
    Trainer's files; ``train(resume_from_checkpoint=...)`` loads them. Do not also pass
    ``TrainingArguments(deepspeed=...)``.
    """

    def __init__(self, *args: Any, shardspeed_config: Optional[ConfigLike] = None, **kwargs: Any):
        if shardspeed_config is None:
            raise TypeError("ShardspeedTrainer needs shardspeed_config= (a DeepSpeed config dict or JSON path)")
        super().__init__(*args, **kwargs)
        if self.is_deepspeed_enabled or getattr(self.args, "deepspeed", None):
            raise ValueError("ShardspeedTrainer trains through shardspeed: pass the DeepSpeed config as "
                             "shardspeed_config=, not TrainingArguments(deepspeed=...)")
        if self.is_fsdp_enabled:
            raise ValueError("ShardspeedTrainer shards with ZeRO itself: turn FSDP off in the TrainingArguments")
        self.shardspeed_config: Dict[str, Any] = _read_config(shardspeed_config)
        self.filled_config: Optional[Dict[str, Any]] = None  # the config the engine was built from
        self.engine: Any = None
        self._pending_resume: Optional[str] = None
        self._last_step_lr: Optional[List[float]] = None

    # ---- building the engine ---------------------------------------------------------------------------
    def create_optimizer(self, model=None):
        """Build the shardspeed engine (once) and return the Trainer-facing optimizer."""
        if self.engine is not None:
            return self.optimizer
        import shardspeed

        num_steps = self.state.max_steps if self.state is not None and self.state.max_steps else None
        config = fill_auto(self.shardspeed_config, self.args, model=self.model, num_training_steps=num_steps)
        client_optimizer = None
        if "optimizer" not in config:
            client_optimizer = super().create_optimizer(model)  # the Trainer's (args.optim), or the user's
        client_scheduler: Any = None
        if "scheduler" not in config:
            if self.lr_scheduler is not None:
                client_scheduler = self.lr_scheduler  # given with Trainer(optimizers=(..., scheduler))
            else:
                def client_scheduler(optimizer):  # the Trainer's schedule, on the engine's optimizer
                    shallow = copy.copy(self)
                    shallow.lr_scheduler = None
                    return Trainer.create_scheduler(shallow, num_training_steps=num_steps or 0, optimizer=optimizer)
        self.optimizer = None
        engine, _, _, _ = shardspeed.initialize(model=self.model, optimizer=client_optimizer,
                                                lr_scheduler=client_scheduler, config=config)
        self.engine, self.filled_config = engine, config
        # The engine decides per micro-step whether to reduce (the boundary set in training_step), as under
        # DeepSpeed: the Trainer must not wrap micro-steps in accelerator.no_sync (engine.no_sync is for stages
        # 0-1 and forbids stepping). accelerate's "sync_each_batch" is the Trainer's switch for that.
        state = self.accelerator.gradient_state
        state.plugin_kwargs = {**state.plugin_kwargs, "sync_each_batch": True}
        self.optimizer = _EngineOptimizer(engine)
        if self._pending_resume is not None:
            path, self._pending_resume = self._pending_resume, None
            self._load_engine_checkpoint(path)
        return self.optimizer

    def create_scheduler(self, num_training_steps: int, optimizer=None):
        if self.engine is None:
            return super().create_scheduler(num_training_steps, optimizer)
        if not isinstance(self.lr_scheduler, _EngineScheduler):
            self.lr_scheduler = _EngineScheduler(self)  # type: ignore[assignment]
        return self.lr_scheduler

    def _wrap_model(self, model, training: bool = True, dataloader=None):
        if self.engine is not None:
            return self.engine
        return super()._wrap_model(model, training=training, dataloader=dataloader)

    # ---- the step --------------------------------------------------------------------------------------
    def training_step(self, model, inputs, num_items_in_batch=None):
        """Forward and loss as the Trainer computes them, through the engine; then ``engine.backward`` (the
        loss scaled for accumulation by the Trainer, not again by the engine) and ``engine.step``."""
        engine = self.engine
        if engine is None:
            return super().training_step(model, inputs, num_items_in_batch)
        engine.train()
        inputs = self._prepare_inputs(inputs)
        with self.compute_loss_context_manager():
            loss = self.compute_loss(engine, inputs, num_items_in_batch=num_items_in_batch)
        del inputs
        scaled_for_ga = getattr(self, "loss_is_scaled_for_ga", None)
        if scaled_for_ga is None:
            scaled_for_ga = ((getattr(self, "model_accepts_loss_kwargs", False) and num_items_in_batch is not None)
                             or getattr(self, "compute_loss_func", None) is not None)
        if not scaled_for_ga:
            loss = loss / getattr(self, "current_gradient_accumulation_steps", self.args.gradient_accumulation_steps)
        boundary = bool(self.accelerator.sync_gradients)
        engine.set_gradient_accumulation_boundary(boundary)
        engine.backward(loss, scale_wrt_gas=False)
        if boundary:
            self._last_step_lr = engine.get_lr()
        engine.step()
        return loss.detach()

    def _clip_grad_norm(self, model):
        if self.engine is None:
            return super()._clip_grad_norm(model)
        return self.engine.get_global_grad_norm()  # the engine clipped (gradient_clipping = max_grad_norm)

    def _get_grad_norm(self, model, grad_norm=None):
        if self.engine is None:
            return super()._get_grad_norm(model, grad_norm)
        norm = self.engine.get_global_grad_norm()
        return norm.item() if torch.is_tensor(norm) else norm

    # ---- checkpoints -----------------------------------------------------------------------------------
    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        if self.engine is None:
            return super()._save_optimizer_and_scheduler(output_dir)
        self.engine.save_checkpoint(output_dir)  # every rank: sharded model, optimizer, schedule, counters

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model=None) -> None:
        if self.engine is None:  # train() calls this before the engine exists: load once it is built
            self._pending_resume = resume_from_checkpoint
            return
        self._load_engine_checkpoint(resume_from_checkpoint)

    def _load_optimizer_and_scheduler(self, checkpoint: Optional[str]) -> None:
        if self.engine is None:
            return super()._load_optimizer_and_scheduler(checkpoint)
        # loaded with the engine's checkpoint (create_optimizer)

    def _load_engine_checkpoint(self, path: str) -> None:
        if not os.path.isfile(os.path.join(path, "latest")):
            raise ValueError(f"Can't find a shardspeed checkpoint at {path} (no 'latest' file; was it saved with "
                             f"save_only_model=True?)")
        # no load_rng_state: the Trainer restores its own rng_state_{rank}.pth files (_load_rng_state)
        load_path, _ = self.engine.load_checkpoint(path, load_module_strict=True, load_optimizer_states=True,
                                                   load_lr_scheduler_states=True)
        if load_path is None:
            raise ValueError(f"failed to resume from checkpoint {path}")
        self._last_step_lr = None

    def save_model(self, output_dir: Optional[str] = None, _internal_call: bool = False) -> None:
        """Save the model for ``from_pretrained``: the engine's gathered weights (every rank takes part; stage 3
        gathers) written by the main process with the Trainer's ``_save`` (config, safetensors, args)."""
        if self.engine is None:
            return super().save_model(output_dir, _internal_call)
        if output_dir is None:
            output_dir = self.args.output_dir
        state_dict = self.engine._zero3_consolidated_16bit_state_dict()
        error = None
        if _rank() == 0:  # the gathered weights are there (should_save: the main process)
            try:
                self._save(output_dir, state_dict=state_dict)
            except Exception as exc:
                error = f"save_model({output_dir!r}) failed: {type(exc).__name__}: {exc}"
        _agree(error)
        if self.args.push_to_hub and not _internal_call:
            self.push_to_hub(commit_message="Model save", revision=self.args.hub_revision)
