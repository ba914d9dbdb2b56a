"""``checkpoint(function, *args)`` and its configuration, the current engine's (DeepSpeed's module-level API).

A checkpoint runs ``function`` without keeping its intermediate activations and reruns it in backward:
``torch.utils.checkpoint.checkpoint(use_reentrant=False)`` underneath, which restores the CPU and device
RNG states for the recompute (dropout replays exactly); the model-parallel RNG tracker's states are
restored too. The saved inputs go through :class:`~.saved.SavedInputs` (partitioned, on the host,
contiguous: the settings say), and ``synchronize`` / ``profile`` wrap forward and backward.
"""
from __future__ import annotations

import contextlib
import logging
import time
from typing import TYPE_CHECKING, Any, Callable, ContextManager, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist
from torch.utils.checkpoint import checkpoint as torch_checkpoint

from ..comm.collectives import Collectives, CommsLogger
from ..errors import ConfigError
from ..mesh.current import CURRENT
from ..mesh.topology import Topology
from .policy import policy_contexts
from .rng import RNGStatesTracker, _generator, seed_tracker
from .saved import SavedInputs
from .settings import CheckpointSettings

if TYPE_CHECKING:
    from ..plan import CheckpointingPlan

logger = logging.getLogger("shardspeed.checkpointing")


class ActivationCheckpointing:
    """Everything activation checkpointing keeps between calls, in one object.

    DeepSpeed's ``deepspeed.checkpointing`` is a module-level API: ``configure`` once (or let the engine do
    it from its config), then ``checkpoint(block, x)`` anywhere in a model's forward with no handle passed.
    Its state lives here: the settings in force, the tensor-parallel group's collectives
    (``partition_activations`` splits over it) and rank, where the saved inputs go, the ``profile`` totals,
    and the model-parallel RNG tracker (``get_cuda_rng_tracker()``). Each engine owns one (in its
    :class:`~shardspeed.mesh.current.EngineScope`); this module's functions (``configure``,
    ``is_configured``, ``checkpoint``, ...) call the current engine's, or before any engine the one the
    first engine takes over (:func:`current`).
    """

    def __init__(self) -> None:
        self.settings = CheckpointSettings()
        self.comm: Optional[Collectives] = None  # the tensor-parallel group's collectives
        self.tp_rank = 0
        self.configured = False
        self.saved = SavedInputs(CheckpointSettings())
        self.totals: Dict[str, float] = {"forward_s": 0.0, "backward_s": 0.0, "calls": 0}
        self.tracker = RNGStatesTracker()

    # ---- configuration --------------------------------------------------------------------------------
    def apply(self, settings: CheckpointSettings, comm: Optional[Collectives] = None) -> None:
        """Make ``settings`` (and the tensor-parallel group's collectives ``comm``) the configuration."""
        self.reset()
        self.settings = settings
        self.comm = comm
        self.tp_rank = comm.topology.shard_rank if comm is not None else 0
        self.saved = SavedInputs(settings, comm)
        self.configured = True
        if settings.partition_activations and self.saved.comm is None:
            logger.info("partition_activations: the tensor-parallel group has one rank, so there is nothing to split")
        logger.debug("activation checkpointing: %s, tensor-parallel size %d", settings, self.saved.world)

    def configure(self, mpu_: Any, deepspeed_config: Any = None, partition_activations: Optional[bool] = None,
                  contiguous_checkpointing: Optional[bool] = None, num_checkpoints: Optional[int] = None,
                  checkpoint_in_cpu: Optional[bool] = None, synchronize: Optional[bool] = None,
                  profile: Optional[bool] = None) -> None:
        """See the module-level :func:`configure`."""
        base = CheckpointSettings()
        if deepspeed_config is not None:
            base = CheckpointSettings.from_plan(_plan_from_config(deepspeed_config))
        overrides = {"partition_activations": partition_activations, "contiguous_memory_optimization":
                     contiguous_checkpointing, "number_checkpoints": num_checkpoints, "cpu_checkpointing":
                     checkpoint_in_cpu, "synchronize": synchronize, "profile": profile}
        kwargs = {**base.__dict__, **{k: v for k, v in overrides.items() if v is not None}}
        comm = _mpu_comm(mpu_) if mpu_ is not None else self.comm
        self.apply(CheckpointSettings(**kwargs), comm)

    def replace(self, **changes: Any) -> None:
        """Apply the settings in force with ``changes``, over the same group."""
        kwargs = {**self.settings.__dict__, **changes}
        self.apply(CheckpointSettings(**kwargs), self.comm)

    def successor(self) -> ActivationCheckpointing:
        """A new engine's: this one's RNG tracker (the process's model-parallel streams, seeded once), and its
        settings and group when configured (a ``configure`` before ``initialize`` survives a config without
        the block, as one engine's does for the next)."""
        self.reset()  # the contiguous buffers: one engine's in use at a time, the current one's (as before)
        nxt = ActivationCheckpointing()
        nxt.tracker = self.tracker
        if self.configured:
            nxt.apply(self.settings, self.comm)
        return nxt

    def reset(self) -> None:
        """Drop the contiguous buffers."""
        if self.saved.contiguous is not None:
            self.saved.contiguous.release()

    # ---- the model-parallel RNG streams ---------------------------------------------------------------
    def seed(self, seed: int) -> None:
        """``model_parallel_cuda_manual_seed``: the default generator and the tracker's stream."""
        seed_tracker(self.tracker, int(seed), self.tp_rank)

    def reseed_tp(self, seed: int) -> None:
        """``model_parallel_reconfigure_tp_seed``: the tracker's stream only."""
        with self.tracker.fork():
            _generator().manual_seed(int(seed) + 2718 + self.tp_rank)

    # ---- checkpoint -----------------------------------------------------------------------------------
    def checkpoint_with(self, function: Callable, args: tuple, kwargs: Dict[str, Any],
                        policy: Optional[str] = None) -> Any:
        """See the module-level :func:`checkpoint_with`."""
        if kwargs:
            keys, n = tuple(kwargs), len(args)

            def call(*all_args: Any) -> Any:
                return function(*all_args[:n], **dict(zip(keys, all_args[n:])))

            args, run = args + tuple(kwargs.values()), call
        else:
            run = function
        if not torch.is_grad_enabled():
            return run(*args)  # no backward will need a recompute (torch's checkpoint does the same)
        st = self.settings
        boundary = _Boundary(st, self.tracker, self.totals)
        with self.saved.hooks():
            out = torch_checkpoint(run, *args, use_reentrant=False, preserve_rng_state=True,
                                   context_fn=_context_fn(boundary, policy or st.policy))
        boundary.after_backward([a for a in args if torch.is_tensor(a)])
        return out


def current() -> ActivationCheckpointing:
    """The activation checkpointing DeepSpeed's module-level functions act on: the current engine's, or with
    no engine alive the one set up before ``initialize`` (which the first engine takes over)."""
    return CURRENT.scope().part(ActivationCheckpointing)


# ---- configuration ------------------------------------------------------------------------------------

def apply(settings: CheckpointSettings, comm: Optional[Collectives] = None) -> None:
    """Make ``settings`` (and the tensor-parallel group's collectives ``comm``) the current configuration."""
    current().apply(settings, comm)


def model_group_comm(topology: Topology, log: Optional[CommsLogger] = None) -> Optional[Collectives]:
    """The collectives of ``topology``'s tensor-parallel (model) group; None when it has one rank."""
    if topology.model_size <= 1 or topology.model_group is None:
        return None
    return Collectives.over(topology.model_group, log)


def _mpu_comm(mpu: Any) -> Optional[Collectives]:
    for name in ("get_tensor_model_parallel", "get_model_parallel"):
        getter = getattr(mpu, f"{name}_group", None)
        if callable(getter):
            group = getter()
            if group is None or dist.get_world_size(group) <= 1:
                return None
            return Collectives.over(group)
    raise ConfigError(f"mpu_ must have get_tensor_model_parallel_group() or get_model_parallel_group() (a "
                      f"Megatron-style model-parallel unit); got {type(mpu).__name__}")


def _plan_from_config(deepspeed_config: Any) -> CheckpointingPlan:
    """The activation checkpointing ``decide`` makes of a config (dict, JSON path or ShardspeedConfig)."""
    from ..plan import checkpointing_of

    return checkpointing_of(deepspeed_config)


def configure(mpu_: Any, deepspeed_config: Any = None, partition_activations: Optional[bool] = None,
              contiguous_checkpointing: Optional[bool] = None, num_checkpoints: Optional[int] = None,
              checkpoint_in_cpu: Optional[bool] = None, synchronize: Optional[bool] = None,
              profile: Optional[bool] = None) -> None:
    """DeepSpeed's ``deepspeed.checkpointing.configure``: the settings of every later ``checkpoint``.

    ``mpu_``: a Megatron-style unit (or ``engine.mpu``) whose tensor-parallel group
    ``partition_activations`` splits over; None keeps the previous one. ``deepspeed_config``: a config
    (dict, JSON path or ShardspeedConfig) whose ``activation_checkpointing`` block is read first; the
    keyword arguments override it (None: keep the config's, else the default)."""
    current().configure(mpu_, deepspeed_config, partition_activations, contiguous_checkpointing,
                            num_checkpoints, checkpoint_in_cpu, synchronize, profile)


def partition_activations_in_checkpoint(partition_activation: bool) -> None:
    """Turn ``partition_activations`` on or off, keeping the other settings (DeepSpeed's function)."""
    current().replace(partition_activations=bool(partition_activation))


def set_num_layers(nlayers: int) -> None:
    """Set ``number_checkpoints`` (DeepSpeed's function)."""
    current().replace(number_checkpoints=int(nlayers))


def is_configured() -> bool:
    """True once ``configure`` (or an engine) has configured activation checkpointing."""
    return current().configured


def reset() -> None:
    """Drop the contiguous buffers (call it between forwards that have no backward, e.g. in evaluation)."""
    current().reset()


def settings() -> CheckpointSettings:
    """The settings in force."""
    return current().settings


def tensor_parallel_rank() -> int:
    return current().tp_rank


def get_cuda_rng_tracker() -> RNGStatesTracker:
    """The process's tracker (DeepSpeed's name)."""
    return current().tracker


def model_parallel_cuda_manual_seed(seed: int) -> None:
    """Seed the default device generator with ``seed`` and the tracker's "model-parallel-rng" state with
    ``seed + 2718 + tensor-parallel rank`` (DeepSpeed's function; call it after ``configure``)."""
    current().seed(seed)


def model_parallel_reconfigure_tp_seed(seed: int) -> None:
    """Reseed the "model-parallel-rng" state only (DeepSpeed's function)."""
    current().reseed_tp(seed)


def profile_totals() -> Dict[str, float]:
    """With ``profile``: seconds spent in checkpointed forwards and backwards (recompute included), and calls."""
    return dict(current().totals)


# ---- forward / recompute contexts ---------------------------------------------------------------------

def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()  # a host-device sync point: what synchronize_checkpoint_boundary asks for


class _Boundary:
    """Per checkpoint call: the tracker's states at the forward (restored for the recompute), device syncs
    and timings at the boundaries."""

    def __init__(self, st: CheckpointSettings, tracker: RNGStatesTracker, totals: Dict[str, float]):
        self.sync, self.profile = st.synchronize, st.profile
        self.tracker, self.totals = tracker, totals
        self.tracker_states: Dict[str, torch.Tensor] = {}
        self.t0 = 0.0

    def begin(self) -> None:
        if self.sync:
            _sync()
        self.t0 = time.perf_counter()

    def end(self, what: str) -> None:
        if self.sync:
            _sync()
        if self.profile:
            dt = time.perf_counter() - self.t0
            self.totals[f"{what}_s"] += dt
            if what == "forward":
                self.totals["calls"] += 1
            if not dist.is_initialized() or dist.get_rank() == 0:
                logger.info("checkpoint %s: %.3f ms", what, dt * 1e3)

    @contextlib.contextmanager
    def forward(self):
        self.begin()
        self.tracker_states = self.tracker.get_states()
        try:
            yield
        finally:
            self.end("forward")

    @contextlib.contextmanager
    def recompute(self):
        self.begin()  # the checkpoint's backward starts with its recompute
        tracker = self.tracker
        outer = tracker.get_states()
        tracker.set_states(dict(self.tracker_states))
        try:
            yield
        finally:
            tracker.set_states(outer)

    def after_backward(self, inputs: List[torch.Tensor]) -> None:
        """End the backward when the gradients of the inputs are in (or at once when none needs one)."""
        if not (self.sync or self.profile):
            return
        needing = [t for t in inputs if t.requires_grad]
        if needing:
            torch.autograd.graph.register_multi_grad_hook(needing, lambda grads: self.end("backward"), mode="any")


class _Both:
    """Enter several context managers as one (torch's context_fn returns one per phase)."""

    def __init__(self, *cms: ContextManager):
        self.cms = cms
        self.stack: Optional[contextlib.ExitStack] = None

    def __enter__(self):
        self.stack = contextlib.ExitStack()
        for cm in self.cms:
            self.stack.enter_context(cm)
        return self

    def __exit__(self, *exc):
        assert self.stack is not None
        return self.stack.__exit__(*exc)


def _context_fn(boundary: _Boundary, policy: str) -> Callable[[], Tuple[ContextManager, ContextManager]]:
    extra = policy_contexts(policy)

    def make() -> Tuple[ContextManager, ContextManager]:
        fwd: List[ContextManager] = [boundary.forward()]
        rec: List[ContextManager] = [boundary.recompute()]
        if extra is not None:
            f2, r2 = extra()
            fwd.append(f2)
            rec.append(r2)
        return _Both(*fwd), _Both(*rec)

    return make


# ---- checkpoint ---------------------------------------------------------------------------------------

def checkpoint_with(function: Callable, args: tuple, kwargs: Dict[str, Any], policy: Optional[str] = None) -> Any:
    """``function(*args, **kwargs)`` checkpointed under the configured settings and ``policy`` (default: the
    configured one). Tensors among ``kwargs`` are saved and differentiated as positional ones are."""
    return current().checkpoint_with(function, args, kwargs, policy)


def checkpoint(function: Callable, *args: Any, **kwargs: Any) -> Any:
    """Checkpoint ``function(*args, **kwargs)`` (DeepSpeed's ``deepspeed.checkpointing.checkpoint``): its
    activations are not kept but recomputed in backward, with the RNG states of the forward."""
    return checkpoint_with(function, args, kwargs)


class _PolicyCheckpoint:
    """``checkpoint`` with a fixed policy (a plain object: copied and pickled with the model)."""

    def __init__(self, policy: Optional[str]):
        if policy is not None:
            CheckpointSettings(policy=policy)  # validates the name
        self.policy = policy

    def __call__(self, function: Callable, *args: Any, **kwargs: Any) -> Any:
        return checkpoint_with(function, args, kwargs, self.policy)


#: DeepSpeed's name for its non-reentrant variant: ``checkpoint`` is non-reentrant here.
non_reentrant_checkpoint = checkpoint


def checkpoint_function(policy: Optional[str] = None) -> Callable[..., Any]:
    """A ``checkpoint``-like callable with a fixed ``policy`` ("full" or "selective"; None: the configured
    one), e.g. for a Hugging Face model's ``_gradient_checkpointing_func``."""
    return _PolicyCheckpoint(policy)
