"""One job: ``ShardspeedStrategy``, a ``LightningModule`` trained by shardspeed's engine under ``lightning.Trainer``.

    import shardspeed.integrations.lightning  # registers strategy="shardspeed" (and _stage_1/2/3)
    from shardspeed.integrations.lightning import ShardspeedStrategy

    trainer = lightning.Trainer(strategy=ShardspeedStrategy(config="ds_config.json"), accelerator="cpu", devices=2)
    trainer.fit(module)

A third-party strategy in the shape of Lightning's ``DeepSpeedStrategy``: it subclasses ``DDPStrategy`` for the
launcher and the process group, and replaces the DDP wrapper with the engine of :func:`shardspeed.initialize`,
built in :meth:`ShardspeedStrategy.setup` from the ``LightningModule`` and the optimizer of
``configure_optimizers`` (or the config's ``optimizer`` block). Its precision plugin
(:class:`ShardspeedPrecision`) sends backward through ``engine.backward`` and the optimizer step through
``engine.step``; checkpoints are the engine's sharded checkpoint directories; ``configure_model`` runs under
``shardspeed.zero.Init`` at stage 3. Gradient accumulation and clipping come from the config; a Trainer setting
that disagrees is refused. See docs/integrations.md.
"""
from __future__ import annotations

import json
import os
from contextlib import contextmanager
from datetime import timedelta
from types import MappingProxyType
from typing import Any, Callable, Dict, Generator, List, Mapping, Optional, Union

import torch
from torch import Tensor
from torch.optim import LBFGS, Optimizer

try:
    import lightning.pytorch as pl
    from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
    from lightning.pytorch.core.optimizer import _init_optimizers_and_lr_schedulers
    from lightning.pytorch.plugins.precision import Precision
    from lightning.pytorch.strategies import DDPStrategy, StrategyRegistry
    from lightning.pytorch.trainer.states import TrainerFn
    from lightning.pytorch.utilities import GradClipAlgorithmType
    from lightning.pytorch.utilities.exceptions import MisconfigurationException
    from lightning.pytorch.utilities.model_helpers import is_overridden
    from lightning.pytorch.utilities.rank_zero import rank_zero_warn
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise ImportError(
        "shardspeed.integrations.lightning needs Lightning: pip install 'lightning>=2.6' "
        "(or pip install -e '.[lightning]' in the shardspeed checkout)"
    ) from exc

from ..errors import CheckpointError, ConfigError

__all__ = ["ShardspeedStrategy", "ShardspeedPrecision"]

_PathLike = Union[str, "os.PathLike[str]"]

#: Trainer ``precision=`` values and the config block each one turns on ("32" leaves the config to decide).
_PRECISION_BLOCK = MappingProxyType({
    "32-true": None, "32": None,
    "bf16-mixed": "bf16", "bf16-true": "bf16", "bf16": "bf16",
    "16-mixed": "fp16", "16-true": "fp16", "16": "fp16",
})
_CHECKPOINT_TAG = "checkpoint"
# Keys of Lightning's checkpoint dict the engine's own checkpoint replaces (weights and optimizer state)
_ENGINE_KEYS = ("state_dict", "optimizer_states")


def _given(config: Mapping[str, Any], key: str) -> Any:
    """A config value the user set (None when absent or "auto")."""
    value = config.get(key)
    return None if value is None or value == "auto" else value


def _block_enabled(config: Mapping[str, Any], block: str) -> bool:
    b = config.get(block)
    return isinstance(b, Mapping) and bool(b.get("enabled", False))


class ShardspeedPrecision(Precision):
    """Precision plugin of :class:`ShardspeedStrategy`: the engine does the precision work.

    The dtype is the config's (``bf16``/``fp16`` blocks, filled in from ``Trainer(precision=...)`` by the
    strategy); the engine casts the inputs of its forward to it, scales the loss under fp16 and clips. This
    plugin routes ``backward`` to ``engine.backward`` and the optimizer step to ``engine.step``.
    """

    def __init__(self, precision: str = "32-true") -> None:
        if str(precision) not in _PRECISION_BLOCK:
            raise ValueError(f"ShardspeedStrategy supports precision {sorted(set(_PRECISION_BLOCK))}, got "
                             f"{precision!r}")
        self.precision = str(precision)  # type: ignore[assignment]

    @staticmethod
    def _engine(model: pl.LightningModule) -> Any:
        engine = getattr(model.trainer.strategy, "engine", None)
        if engine is None:
            raise MisconfigurationException("ShardspeedPrecision is used without a ShardspeedStrategy engine "
                                            "(only ShardspeedStrategy can use it)")
        return engine

    def backward(  # type: ignore[override]
        self, tensor: Tensor, model: pl.LightningModule, optimizer: Optional[Any], *args: Any, **kwargs: Any
    ) -> None:
        if is_overridden("backward", model):
            rank_zero_warn("LightningModule.backward is overridden, but ShardspeedStrategy runs the backward "
                           "through the engine (engine.backward): the override is not called")
        engine = self._engine(model)
        strategy = model.trainer.strategy
        in_step = isinstance(strategy, ShardspeedStrategy) and strategy._in_optimizer_step
        if model.automatic_optimization:
            # Lightning decides where an accumulation window ends (every accumulate_grad_batches batches, which
            # the strategy sets to the config's gradient_accumulation_steps, and at the end of an epoch): it
            # calls optimizer_step there and only the closure elsewhere. The engine follows that decision.
            if not in_step:
                engine.set_gradient_accumulation_boundary(False)
            # Lightning already divided the loss by accumulate_grad_batches; engine.backward divides by the
            # engine's accumulation steps (the same number) again
            gas = engine.gradient_accumulation_steps()
            if gas > 1:
                tensor = tensor * gas
        engine.backward(tensor, *args, **kwargs)
        if model.automatic_optimization and not in_step:
            engine.step()  # off the boundary: counts the micro-step, steps nothing

    def optimizer_step(  # type: ignore[override]
        self, optimizer: Any, model: pl.LightningModule, closure: Callable[[], Any], **kwargs: Any
    ) -> Any:
        if isinstance(optimizer, LBFGS):
            raise MisconfigurationException("ShardspeedStrategy does not support LBFGS (its step re-evaluates "
                                            "the closure)")
        engine = self._engine(model)
        strategy = model.trainer.strategy
        assert isinstance(strategy, ShardspeedStrategy)
        if model.automatic_optimization:
            engine.set_gradient_accumulation_boundary(True)  # Lightning steps here: this backward reduces
        strategy._in_optimizer_step = True
        try:
            closure_result = closure()
        finally:
            strategy._in_optimizer_step = False
        self._after_closure(model, optimizer)
        if model.automatic_optimization and closure_result is None:
            raise MisconfigurationException("returning None from training_step (skipping the backward) is not "
                                            "supported by ShardspeedStrategy: every rank must run the backward")
        engine.step()
        return closure_result

    def clip_gradients(
        self,
        optimizer: Optimizer,
        clip_val: Union[int, float] = 0.0,
        gradient_clip_algorithm: GradClipAlgorithmType = GradClipAlgorithmType.NORM,
    ) -> None:
        """The engine clips by the global norm (the config's ``gradient_clipping``) inside ``engine.step``."""


class ShardspeedStrategy(DDPStrategy):
    """ZeRO data parallelism through :func:`shardspeed.initialize` for ``lightning.Trainer``.

    Args:
        config: a DeepSpeed-format config (dict or path to a JSON file). Without one, ``{"zero_optimization":
            {"stage": stage}}``; batch sizes, accumulation and clipping are then taken from the Trainer and the
            train data loader, and the optimizer from ``configure_optimizers``.
        stage: ZeRO stage (0-3) when ``config`` has none (default 2); refused when it disagrees with the config.
        precision_plugin: leave None; only :class:`ShardspeedPrecision` works with this strategy.
        Other arguments are ``DDPStrategy``'s (launcher, cluster environment, process group).
    """

    strategy_name = "shardspeed"

    def __init__(
        self,
        config: Optional[Union[_PathLike, Dict[str, Any]]] = None,
        stage: Optional[int] = None,
        accelerator: Optional[pl.accelerators.Accelerator] = None,
        parallel_devices: Optional[List[torch.device]] = None,
        cluster_environment: Optional[Any] = None,
        precision_plugin: Optional[Precision] = None,
        process_group_backend: Optional[str] = None,
        timeout: Optional[timedelta] = default_pg_timeout,
        start_method: str = "popen",
    ) -> None:
        if precision_plugin is None:
            precision_plugin = ShardspeedPrecision()
        super().__init__(accelerator=accelerator, parallel_devices=parallel_devices,
                         cluster_environment=cluster_environment, precision_plugin=precision_plugin,
                         process_group_backend=process_group_backend, timeout=timeout,
                         start_method=start_method)  # type: ignore[arg-type]
        self.config: Dict[str, Any] = self._load_config(config)
        zero = self.config.setdefault("zero_optimization", {})
        if not isinstance(zero, dict):
            raise ConfigError("zero_optimization must be an object ({...})")
        if stage is not None:
            if "stage" in zero and zero["stage"] != stage:
                raise ConfigError(f"ShardspeedStrategy(stage={stage}) but the config's zero_optimization.stage is "
                                  f"{zero['stage']}; give one")
            zero["stage"] = stage
        zero.setdefault("stage", 2)
        self.engine: Any = None  # the shardspeed engine, once setup() built it
        self._in_optimizer_step = False  # set by ShardspeedPrecision.optimizer_step around its closure

    @property
    def precision_plugin(self) -> Precision:
        return self._precision_plugin if self._precision_plugin is not None else ShardspeedPrecision()

    @precision_plugin.setter
    def precision_plugin(self, plugin: Optional[Precision]) -> None:
        """The Trainer hands ``strategy="shardspeed"`` Lightning's plugin for ``precision=``: keep its
        precision, do the work in :class:`ShardspeedPrecision`. Any other plugin class is refused."""
        if plugin is not None and not isinstance(plugin, ShardspeedPrecision):
            flag = str(getattr(plugin, "precision", ""))
            if type(plugin).__name__ not in ("Precision", "MixedPrecision", "HalfPrecision") or \
                    flag not in _PRECISION_BLOCK:
                raise MisconfigurationException(
                    f"ShardspeedStrategy does its precision in the engine (the config's bf16/fp16 blocks); the "
                    f"precision plugin {type(plugin).__name__} cannot be used with it")
            plugin = ShardspeedPrecision(flag)
        self._precision_plugin = plugin

    # ---- config ------------------------------------------------------------------------------------
    @staticmethod
    def _load_config(config: Optional[Union[_PathLike, Dict[str, Any]]]) -> Dict[str, Any]:
        if config is None:
            return {}
        if isinstance(config, (str, os.PathLike)):
            if not os.path.isfile(config):
                raise ConfigError(f"ShardspeedStrategy(config={str(config)!r}): no such file")
            with open(config) as f:
                loaded = json.load(f)
            if not isinstance(loaded, dict):
                raise ConfigError(f"{config}: the config must be a JSON object")
            return loaded
        if not isinstance(config, Mapping):
            raise ConfigError(f"ShardspeedStrategy(config=...) takes a dict or a path, got {type(config).__name__}")
        return json.loads(json.dumps(config))  # a deep copy; the user's dict is left as given

    @property
    def zero_stage(self) -> int:
        return int(self.config["zero_optimization"]["stage"])

    def _train_batch_size_of_loader(self, trainer: pl.Trainer) -> int:
        source = trainer.fit_loop._data_source
        if source.is_defined():
            loader = source.dataloader()
            bs = getattr(getattr(loader, "batch_sampler", None), "batch_size", None)
            if isinstance(bs, int):
                return bs
        return 1

    def _resolve_config(self, trainer: pl.Trainer) -> Dict[str, Any]:
        """The config the engine is built from: the user's, with what the Trainer decides filled in, and a
        clear error where the two disagree."""
        from ..config.batch import resolve_batch_sizes

        cfg = json.loads(json.dumps(self.config))
        # precision: Trainer(precision=...) turns on the config's block; the config may not say otherwise
        flag = str(getattr(trainer._accelerator_connector, "_precision_flag", "32-true"))
        if flag not in _PRECISION_BLOCK:
            raise MisconfigurationException(f"Trainer(precision={flag!r}) is not supported by ShardspeedStrategy; "
                                            f"use one of {sorted(set(_PRECISION_BLOCK))}")
        block = _PRECISION_BLOCK[flag]
        if block is not None:
            other = "fp16" if block == "bf16" else "bf16"
            if _block_enabled(cfg, other):
                raise MisconfigurationException(f"Trainer(precision={flag!r}) but the config enables {other}; "
                                                f"make them agree")
            section = cfg.setdefault(block, {})
            if isinstance(section, dict) and section.get("enabled") is False:
                raise MisconfigurationException(f"Trainer(precision={flag!r}) but the config sets "
                                                f"{block}.enabled false; make them agree")
            section["enabled"] = True
        assert isinstance(self.precision_plugin, ShardspeedPrecision)
        self.precision_plugin.precision = flag  # type: ignore[assignment]

        # clipping: the config's gradient_clipping; the Trainer's value fills it in, and must agree
        if trainer.gradient_clip_algorithm == GradClipAlgorithmType.VALUE:
            raise MisconfigurationException("ShardspeedStrategy clips by the global norm only: "
                                            "Trainer(gradient_clip_algorithm='value') is not supported")
        clip_cfg = _given(cfg, "gradient_clipping")
        clip_tr = trainer.gradient_clip_val
        if clip_cfg is None:
            if clip_tr is not None:
                cfg["gradient_clipping"] = float(clip_tr)
        elif clip_tr is not None and float(clip_tr) != float(clip_cfg):
            raise MisconfigurationException(
                f"Trainer(gradient_clip_val={clip_tr}) disagrees with the config's gradient_clipping {clip_cfg}; "
                f"set it in one place (the config's value is what the engine uses)")
        if is_overridden("configure_gradient_clipping", trainer.lightning_module, pl.LightningModule):
            rank_zero_warn("LightningModule.configure_gradient_clipping is overridden, but the engine clips by the "
                           "config's gradient_clipping inside engine.step: the hook does not clip")

        # batch sizes and accumulation: the config's; the Trainer's accumulate_grad_batches fills gas in
        for key in ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps"):
            if key in cfg and cfg[key] == "auto":
                del cfg[key]
        acc_tr = int(trainer.accumulate_grad_batches)
        if "train_batch_size" not in cfg and "train_micro_batch_size_per_gpu" not in cfg:
            cfg["train_micro_batch_size_per_gpu"] = self._train_batch_size_of_loader(trainer)
        if "gradient_accumulation_steps" not in cfg and not (
                "train_batch_size" in cfg and "train_micro_batch_size_per_gpu" in cfg):
            cfg["gradient_accumulation_steps"] = acc_tr
        _, _, gas = resolve_batch_sizes(cfg.get("train_batch_size"), cfg.get("train_micro_batch_size_per_gpu"),
                                        cfg.get("gradient_accumulation_steps"), self.world_size)
        if acc_tr not in (1, gas):
            raise MisconfigurationException(
                f"Trainer(accumulate_grad_batches={acc_tr}) disagrees with the config's gradient accumulation "
                f"({gas} steps); set it in the config only")
        trainer.accumulate_grad_batches = gas  # Lightning then steps (and counts global_step) per optimizer step
        return cfg

    # ---- set-up ------------------------------------------------------------------------------------
    @property
    def restore_checkpoint_after_setup(self) -> bool:
        return True  # the engine must exist to load its checkpoint

    @property
    def lightning_restore_optimizer(self) -> bool:
        return False  # the engine's checkpoint holds the (sharded) optimizer state

    @contextmanager
    def tensor_init_context(self, empty_init: Optional[bool] = None) -> Generator[None, None, None]:
        if self.zero_stage == 3:
            if empty_init is False:
                raise NotImplementedError("empty_init=False is not possible at ZeRO stage 3 (parameters are "
                                          "sharded as they are built)")
            yield
            return
        with super().tensor_init_context(empty_init=empty_init):
            yield

    @contextmanager
    def model_sharded_context(self) -> Generator[None, None, None]:
        """``configure_model`` runs in here: under ``shardspeed.zero.Init`` at stage 3, so every rank keeps
        only its shard of each parameter as it is built."""
        from ..zero import Init

        with Init(enabled=self.zero_stage == 3):
            yield

    def setup(self, trainer: pl.Trainer) -> None:
        from ..zero.tags import init_shard_of

        assert self.accelerator is not None
        self.accelerator.setup(trainer)
        module = self.lightning_module
        assert module is not None
        if self.engine is not None and self.engine.module is module:
            self.model = self.engine  # fit, then validate/test/predict with the same trainer
        elif trainer.state.fn == TrainerFn.FITTING:
            self._build_engine(trainer, module)
        elif any(init_shard_of(p) is not None for p in module.parameters()):
            # evaluation of a module built sharded (configure_model at stage 3): an engine gathers its
            # parameters layer by layer; its optimizer never steps
            self._build_engine(trainer, module, evaluation=True)
        else:
            self.model_to_device()
        self.setup_precision_plugin()
        self.barrier()

    def _build_engine(self, trainer: pl.Trainer, module: pl.LightningModule, evaluation: bool = False) -> None:
        import shardspeed

        cfg = self._resolve_config(trainer)
        optimizer: Any = None
        sched_cfg = None
        if evaluation:
            cfg.pop("optimizer", None)
            cfg.pop("scheduler", None)
            optimizer = torch.optim.SGD([p for p in module.parameters() if p.requires_grad], lr=0.0)
        elif "optimizer" not in cfg:
            optimizers, schedulers = _init_optimizers_and_lr_schedulers(module)
            if len(optimizers) != 1 or len(schedulers) > 1:
                raise MisconfigurationException(
                    f"ShardspeedStrategy supports one optimizer and at most one LR scheduler from "
                    f"configure_optimizers; got {len(optimizers)} and {len(schedulers)}")
            optimizer = optimizers[0]
            sched_cfg = schedulers[0] if schedulers else None
        elif is_overridden("configure_optimizers", module, pl.LightningModule):
            rank_zero_warn("the config has an optimizer block: configure_optimizers is not called")
        engine, engine_optimizer, _, engine_scheduler = shardspeed.initialize(
            model=module, optimizer=optimizer, lr_scheduler=sched_cfg.scheduler if sched_cfg else None, config=cfg)
        if sched_cfg is not None:
            # Lightning steps the scheduler of configure_optimizers (interval, frequency, monitor) and saves
            # it with its checkpoint; the engine's own copy of the hook is turned off
            engine.lr_scheduler = None
            sched_cfg.scheduler = engine_scheduler
            self.lr_scheduler_configs = [sched_cfg]
        else:
            self.lr_scheduler_configs = []  # a config 'scheduler' block stays with the engine (and its checkpoint)
        self.optimizers = [] if evaluation else [engine_optimizer]
        self.engine = engine
        self.model = engine

    @contextmanager
    def block_backward_sync(self) -> Generator[None, None, None]:
        """Nothing to block: inside an accumulation window the engine's backward does not reduce (the
        precision plugin tells it where the window ends)."""
        yield

    def setup_optimizers(self, trainer: pl.Trainer) -> None:
        """Optimizers are made in :meth:`setup` with the engine."""

    def model_to_device(self) -> None:
        if self.engine is not None and self.model is self.engine:
            return  # the engine placed its parameters
        super().model_to_device()

    def lightning_module_state_dict(self) -> Dict[str, Any]:
        """Empty: the weights are in the engine's sharded checkpoint (a stage-3 module holds only placeholders)."""
        if self.engine is None:
            return super().lightning_module_state_dict()
        return {}

    def optimizer_state(self, optimizer: Optimizer) -> Dict[str, Tensor]:
        """Empty: the engine's checkpoint holds each rank's shard of the optimizer state."""
        return {}

    # ---- checkpoints -------------------------------------------------------------------------------
    def save_checkpoint(self, checkpoint: Dict[str, Any], filepath: _PathLike,
                        storage_options: Optional[Any] = None) -> None:
        """Write the engine's sharded checkpoint into the directory ``filepath`` (every rank writes its shard);
        Lightning's own state (loops, callbacks, LR schedulers, hyper-parameters) goes into its client state."""
        if storage_options is not None:
            raise TypeError("ShardspeedStrategy.save_checkpoint: storage_options is not supported (the engine "
                            "writes its own files, no CheckpointIO)")
        if self.engine is None:
            raise CheckpointError("ShardspeedStrategy.save_checkpoint before setup(): there is no engine yet")
        filepath = self.broadcast(str(filepath))
        client_state = {k: v for k, v in checkpoint.items() if k not in _ENGINE_KEYS}
        self.engine.save_checkpoint(filepath, tag=_CHECKPOINT_TAG, client_state=client_state)

    def load_checkpoint(self, checkpoint_path: _PathLike, weights_only: Optional[bool] = None) -> Dict[str, Any]:
        """Restore the engine from the checkpoint directory (weights, and when fitting the optimizer state, the
        engine's counters and RNG) and give Lightning back its state (loops, callbacks, LR schedulers).
        ``weights_only=False`` (Lightning's opt-in to arbitrary pickles) is the engine's ``trust_pickles``."""
        path = self.broadcast(str(checkpoint_path))
        if not os.path.isdir(path):
            raise CheckpointError(
                f"{path} is not a ShardspeedStrategy checkpoint (a directory written by the engine); a single-file "
                f"Lightning checkpoint cannot be loaded into the engine: load its state_dict into the module "
                f"before fit instead")
        if self.engine is None:
            raise CheckpointError("ShardspeedStrategy.load_checkpoint before setup(): there is no engine yet")
        module = self.lightning_module
        assert module is not None
        fitting = module.trainer.state.fn == TrainerFn.FITTING
        loaded, client_state = self.engine.load_checkpoint(
            path, load_module_strict=module.strict_loading, load_optimizer_states=fitting,
            load_lr_scheduler_states=fitting, load_module_only=not fitting, trust_pickles=weights_only is False,
            load_rng_state=fitting)  # Lightning keeps no RNG state of its own: dropout resumes exactly
        if loaded is None or client_state is None:
            raise CheckpointError(f"{path} holds no checkpoint (no 'latest' file)")
        return dict(client_state)

    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        """Nothing: :meth:`load_checkpoint` loaded the weights into the engine."""

    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        """Nothing: :meth:`load_checkpoint` loaded the optimizer state into the engine."""

    # ---- teardown ----------------------------------------------------------------------------------
    def teardown(self) -> None:
        """Leave the engine's parameters and optimizer state where they are (they are views of its flat
        buffers: moving them to the CPU, as other strategies do, would detach them from the engine)."""
        self.precision_plugin.teardown()
        assert self.accelerator is not None
        self.accelerator.teardown()
        self.checkpoint_io.teardown()

    @classmethod
    def register_strategies(cls, strategy_registry: Any) -> None:
        strategy_registry.register("shardspeed", cls, description="shardspeed ZeRO (stage from the config, default 2)")
        for stage in (1, 2, 3):
            strategy_registry.register(f"shardspeed_stage_{stage}", cls, description=f"shardspeed ZeRO stage {stage}",
                                       stage=stage)


if "shardspeed" not in StrategyRegistry:
    ShardspeedStrategy.register_strategies(StrategyRegistry)
