"""The current engine: the one piece of process-wide state shardspeed keeps (:data:`CURRENT`).

DeepSpeed's module-level functions take no engine: ``deepspeed.utils.groups.get_data_parallel_rank()``,
``deepspeed.checkpointing.checkpoint(block, x)``. They answer for the engine that is current in the process,
as torch.distributed's functions answer for the default process group. Everything else receives what it
needs explicitly (an engine holds its own topology, its own activation checkpointing), so engines with
different meshes live side by side; this module only says which of them the module-level functions speak for.

Each engine registers an :class:`EngineScope` when it is built (the builder) and removes it in
``engine.destroy()``: its topology and the parts the module-level functions act on (its
``ActivationCheckpointing``; the meshes it shares with the engines alive beside it, so that a later engine
of the same mesh reuses their process groups, also after the last engine alive is destroyed). The
current engine is the most recently built one not yet destroyed; ``with CURRENT.using(scope):`` selects
another for a block. With no engine alive, the functions act on the *before* scope: what a script sets up
before ``initialize`` (Megatron-style ``deepspeed.checkpointing.configure(...)``, a mesh built by
``sequence_parallel_mpu``), which the first engine built takes over. The ``zero.Init`` contexts open (for the
engine to be built) are kept here too, and two weak sets for DeepSpeed's functions that take a bare
parameter (``GatheredParameters``, ``safe_get_full_fp32_param``): the stage-3 roots and the engines alive,
which those functions ask whose parameter it is (nothing on a tensor points at its unit or engine).
"""
from __future__ import annotations

import contextlib
import weakref
from typing import TYPE_CHECKING, Any, Dict, Iterable, Iterator, List, Optional, Type, TypeVar, cast

if TYPE_CHECKING:  # pragma: no cover
    from .topology import Topology

T = TypeVar("T")


class EngineScope:
    """What DeepSpeed's module-level functions see of one engine: its topology (None: no engine, the
    *before* scope) and its parts they act on, one object per class."""

    def __init__(self, topology: Optional[Topology] = None, parts: Iterable[Any] = ()) -> None:
        self.topology = topology
        self._parts: Dict[type, Any] = {type(p): p for p in parts}

    def part(self, cls: Type[T]) -> T:
        """This scope's ``cls`` object, made (``cls()``) on first use."""
        if cls not in self._parts:
            self._parts[cls] = cls()
        return cast(T, self._parts[cls])

    def adopt(self, part: Any) -> None:
        """Hold ``part`` as this scope's object of its class, unless it has one."""
        self._parts.setdefault(type(part), part)

    def find(self, cls: Type[T]) -> Optional[T]:
        """This scope's ``cls`` object, or None when it has none."""
        return cast(Optional[T], self._parts.get(cls))

    def lasting(self) -> List[Any]:
        """The parts that outlive the engine (their class sets ``OUTLIVES_ENGINE``: the meshes' process groups,
        which a later engine reuses)."""
        return [p for p in self._parts.values() if getattr(p, "OUTLIVES_ENGINE", False)]

    def close(self) -> None:
        """The engine is destroyed: the module-level functions no longer answer for it (``engine.destroy()``)."""
        CURRENT.unregister(self)


class CurrentEngine:
    """Which engine DeepSpeed's module-level functions answer for: the engines alive (registered, not
    destroyed) in build order, the last one current; the *before* scope while none is alive."""

    def __init__(self) -> None:
        self._alive: List[EngineScope] = []
        self._before = EngineScope()
        #: the ``zero.Init`` contexts open, innermost last: DeepSpeed's ``zero.Init`` is the engine-to-be's
        #: module-level context (a parameter created inside is sharded, whichever engine will hold it)
        self.inits: List[Any] = []
        #: the stage-3 roots alive (:class:`~shardspeed.zero.root.ZeroRoot`): GatheredParameters asks them
        #: which one holds a parameter; a root leaves when it is closed or collected
        self.roots: weakref.WeakSet[Any] = weakref.WeakSet()
        #: the engines alive, for DeepSpeed's ``safe_get_*`` functions (:mod:`shardspeed.utils.tensor_fragment`)
        self.engines: weakref.WeakSet[Any] = weakref.WeakSet()

    def get(self) -> Optional[EngineScope]:
        """The current engine's scope; None when no engine is alive."""
        return self._alive[-1] if self._alive else None

    def scope(self) -> EngineScope:
        """The current engine's scope, else the *before* scope (set up before any engine)."""
        return self._alive[-1] if self._alive else self._before

    def alive(self) -> List[EngineScope]:
        """The scopes of the engines alive, most recent last."""
        return list(self._alive)

    def register(self, scope: EngineScope) -> None:
        """``scope``'s engine is built: it is current from now on. The first engine alive takes over what the
        *before* scope held (the builder gave its parts to it), which starts empty again."""
        if not self._alive:
            self._before = EngineScope()
        self._alive.append(scope)

    def unregister(self, scope: EngineScope) -> None:
        """``scope``'s engine is destroyed: the engine built before it (still alive) is current again; after the
        last one, the *before* scope keeps what outlives an engine (:meth:`EngineScope.lasting`). Idempotent."""
        if not any(s is scope for s in self._alive):
            return
        self._alive = [s for s in self._alive if s is not scope]
        if not self._alive:
            for part in scope.lasting():
                self._before.adopt(part)

    @contextlib.contextmanager
    def using(self, scope: EngineScope) -> Iterator[EngineScope]:
        """``scope`` is current in the block; the current one before it again after."""
        self._alive.append(scope)
        try:
            yield scope
        finally:
            for i in range(len(self._alive) - 1, -1, -1):
                if self._alive[i] is scope:
                    del self._alive[i]
                    break


#: The process's current engine: the one holder of process-wide state in shardspeed (see the module's docstring).
CURRENT = CurrentEngine()
