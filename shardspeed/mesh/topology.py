"""One job: which ranks work together: the mesh's sizes and names and the groups derived from them, built once
and passed explicitly (no global process groups).

A `Topology` is handed to every part that needs one. The meshes already built are kept by a
:class:`TopologyRegistry` that the engines alive share (a later engine of the same mesh reuses their
groups); which engine DeepSpeed's module-level ``deepspeed.utils.groups`` functions answer for is
:data:`shardspeed.mesh.current.CURRENT`'s to say.

The world is a device mesh whose dimensions are named by :data:`MESH_DIMS`, outermost first (DeepSpeed's
axis order; ``model`` innermost, so tensor-parallel peers are neighbouring ranks). Every mesh has pipe, data
and model (:data:`BASE_DIMS`: global rank ``= pipe_rank × data × model + data_rank × model + model_rank``);
expert and sequence join when larger than 1 or declared (:func:`mesh_dims`).

One word for each group of a `Topology`, its fields ``<word>_group``, ``<word>_rank``, ``<word>_size``:

- ``pipe``, ``data``, ``expert``, ``sequence``, ``model``: one mesh dimension each. ``model`` is tensor
  slicing (DeepSpeed's "slice parallel"): with ``tensor_parallel.autotp_size`` > 1 the builder splits the
  model's layers over it (:mod:`shardspeed.parallel.tp`); a model with no plan stays replicated there.
- ``shard``: data × expert × sequence, the ranks holding the same dense parameters. ZeRO shards over it and
  averages gradients over it (DeepSpeed's "sequence data parallel"; the plan's ``MeshPlan.shard_size``).
- ``expert_shard``: data × sequence, the ranks holding the same experts: ZeRO shards and reduces expert
  parameters over it (DeepSpeed's "expert data parallel"; ``MeshPlan.expert_shard_size``).
- ``batch``: data × expert, the ranks that read different samples (DeepSpeed's "data parallel",
  ``get_data_parallel_*``): global batch = micro × accumulation × ``batch_world`` (``_world``, as in the
  plan's ``MeshPlan.batch_world``: ``batch_size`` would read as a count of samples).
- ``pipe_model``: pipe × model, the ranks that together hold one model replica (DeepSpeed's "model
  parallel", ``get_model_parallel_*``; the model group when there is one stage).

With expert and sequence both 1, data, shard, expert_shard and batch are one group. The composite groups'
sizes are derived from the dimensions' (properties), except ``pipe_model_size``: a user's mpu may count only
tensor ranks there (Megatron's meaning). Names of groups in messages: :func:`describe_group`.
"""
from __future__ import annotations

import math
import weakref
from dataclasses import dataclass
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from ..errors import ConfigError, DistributedError
from .current import CURRENT
from .init import backend_options, group_timeout, local_device, new_group

#: The mesh's dimension names, outermost first: the one definition (the plan imports it).
MESH_DIMS: Tuple[str, ...] = ("pipe", "data", "expert", "sequence", "model")
#: The dimensions every device mesh has, even at size 1.
BASE_DIMS: Tuple[str, ...] = ("pipe", "data", "model")


def mesh_dims(sizes: Mapping[str, int], declared: Sequence[str] = ()) -> Tuple[str, ...]:
    """A device mesh's dimensions, in :data:`MESH_DIMS` order: the base ones, and expert and sequence when
    ``sizes`` has them larger than 1 or they are ``declared``."""
    return tuple(d for d in MESH_DIMS if d in BASE_DIMS or sizes.get(d, 1) > 1 or d in declared)


def mesh_sizes(world: int, pipe: int = 1, model: int = 1, sequence: int = 1, expert: int = 1) -> Tuple[int, int, int]:
    """``(pipe, data, model)`` for ``world`` ranks: data = world / (pipe × expert × sequence × model), which
    must divide."""
    for name, value in (("pipeline.stages", pipe), ("tensor_parallel.autotp_size", model),
                        ("sequence_parallel_size", sequence), ("expert_parallel.autoep_size", expert)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ConfigError(f"{name} must be a positive integer, got {value!r}")
    if world % (pipe * model * sequence * expert):
        seq = f" × sequence_parallel_size {sequence}" if sequence > 1 else ""
        seq += f" × expert size {expert}" if expert > 1 else ""
        raise ConfigError(f"world {world} is not divisible by pipeline.stages {pipe} × "
                          f"tensor_parallel.autotp_size {model}{seq} = {pipe * model * sequence * expert}")
    return pipe, world // (pipe * model * sequence * expert), model


def mesh_ranks(pipe: int, data: int, model: int) -> List[List[List[int]]]:
    """The global rank at each ``[pipe][data][model]`` coordinate (row-major, model innermost)."""
    return [[[(p * data + d) * model + m for m in range(model)] for d in range(data)] for p in range(pipe)]


@dataclass(frozen=True)
class Topology:
    """This rank's groups (the module docstring names each), its device, and the mesh they came from.

    Each group's rank field is this rank's place in it. A group of None means the whole world for
    ``shard_group`` (torch's convention) and "not created" for the others. Frozen: built once (collective),
    then passed to every part that needs it.
    """

    shard_group: Optional[dist.ProcessGroup]
    shard_rank: int
    device: torch.device
    data_size: int = 1
    mesh: Any = None  # torch.distributed.device_mesh.DeviceMesh, when built from a mesh
    #: The Megatron-style object passed to ``initialize(mpu=...)``, when the groups came from one.
    user_mpu: Any = None
    data_group: Optional[dist.ProcessGroup] = None
    data_rank: int = 0
    pipe_group: Optional[dist.ProcessGroup] = None
    pipe_rank: int = 0
    pipe_size: int = 1
    model_group: Optional[dist.ProcessGroup] = None
    model_rank: int = 0
    model_size: int = 1
    sequence_group: Optional[dist.ProcessGroup] = None
    sequence_rank: int = 0
    sequence_size: int = 1
    expert_group: Optional[dist.ProcessGroup] = None
    expert_rank: int = 0
    expert_size: int = 1
    expert_shard_group: Optional[dist.ProcessGroup] = None
    expert_shard_rank: int = 0
    pipe_model_group: Optional[dist.ProcessGroup] = None
    pipe_model_rank: int = 0
    pipe_model_size: int = 1

    @property
    def dims(self) -> Tuple[str, ...]:
        """The device mesh's dimension names (:func:`mesh_dims`); the base ones without a mesh."""
        return tuple(self.mesh.mesh_dim_names) if self.mesh is not None else BASE_DIMS

    @property
    def shard_size(self) -> int:
        """data × expert × sequence: ZeRO's ranks."""
        return self.data_size * self.expert_size * self.sequence_size

    @property
    def expert_shard_size(self) -> int:
        """data × sequence: the ranks holding the same experts."""
        return self.data_size * self.sequence_size

    @property
    def batch_group(self) -> Optional[dist.ProcessGroup]:
        """The ranks that read different samples: the shard group, or the data dimension when sequence > 1
        (with expert > 1 too, no data × expert group is built: the data dimension alone, not batch_world)."""
        return self.data_group if self.sequence_size > 1 else self.shard_group

    @property
    def batch_rank(self) -> int:
        return self.data_rank if self.sequence_size > 1 else self.shard_rank

    @property
    def batch_world(self) -> int:
        """data × expert: the data-parallel degree of the batch arithmetic."""
        return self.data_size * self.expert_size

    @classmethod
    def data_parallel(cls, group: Optional[dist.ProcessGroup] = None) -> Topology:
        """All ranks of ``group`` (default: the world) form one data-parallel group; no mesh, no other
        groups are created (for tests and tools that drive ZeRO parts directly)."""
        rank = dist.get_rank(group)
        return cls(shard_group=group, shard_rank=rank, device=local_device(), data_size=dist.get_world_size(group),
                   data_group=group, data_rank=rank, expert_shard_group=group, expert_shard_rank=rank)

    @classmethod
    def from_mesh(cls, pipe: int = 1, model: int = 1, registry: Optional[TopologyRegistry] = None,
                  dims: Sequence[str] = BASE_DIMS, sequence: int = 1, expert: int = 1) -> Topology:
        """The ``(pipe, data, model)`` device mesh of the world; data = world / (pipe × model).

        Collective: every rank must call it with the same sizes. Creates each group in the same order on
        every rank (the mesh's own groups, then the pipe × model groups when both are > 1). A second call
        with the same sizes in the same process group returns the first's Topology, groups and all (no new
        groups per engine): ``registry`` keeps them (default: the current engine's, shared by the engines
        alive; before any engine, the one the first engine takes over: :mod:`shardspeed.mesh.current`).
        """
        registry = registry if registry is not None else CURRENT.scope().part(TopologyRegistry)
        return registry.mesh(pipe, model, dims, sequence, expert)

    @classmethod
    def build_mesh(cls, sizes: Tuple[int, int, int], device: torch.device,
                   dims: Sequence[str] = BASE_DIMS, sequence: int = 1, expert: int = 1) -> Topology:
        """A new Topology of the ``(pipe, data, model)`` mesh ``sizes`` (new groups; collective); what
        :meth:`TopologyRegistry.mesh` builds once per mesh. ``dims``: the device mesh's dimensions, in the
        plan's order (:func:`mesh_dims`). ``sequence`` or ``expert`` > 1 make the shard group data × expert
        × sequence and the expert_shard group data × sequence (one more group per coordinate of the other
        dimensions each). Every group gets the world group's timeout
        (:func:`~shardspeed.mesh.init.group_timeout`)."""
        from torch.distributed.device_mesh import init_device_mesh

        p, d, m = sizes
        known = dict(pipe=p, data=d, model=m, sequence=sequence, expert=expert)
        if expert > 1 and "expert" not in dims:
            raise ConfigError(f"an expert size of {expert} needs a mesh with an expert dimension, got {dims}")
        if sequence > 1 and "sequence" not in dims:
            raise ConfigError(f"sequence_parallel_size {sequence} needs a mesh with a sequence dimension, got {dims}")
        shape = tuple(known.get(n, 1) for n in dims)
        mesh = init_device_mesh(device.type, shape, mesh_dim_names=tuple(dims),
                                backend_override=_timeout_overrides(dims, shape) or None)
        groups = {name: mesh.get_group(name) for name in dims}
        ranks = {name: mesh.get_local_rank(name) for name in dims}
        pm_group: Optional[dist.ProcessGroup]
        if p == 1:
            pm_group = groups["model"]
        elif m == 1:
            pm_group = groups["pipe"]
        else:
            pm_group = _new_groups([[r for plane in mesh_ranks(p, d, m) for r in plane[di]] for di in range(d)],
                                   desc="pipe_model")
        shard_group: Optional[dist.ProcessGroup] = groups["data"]
        shard_rank = ranks["data"]
        if sequence > 1:
            shard_group = _new_groups(_shard_rank_lists(mesh.mesh, list(dims)), desc="data_sequence")
            shard_rank = dist.get_rank(shard_group)
        es_group, es_rank = shard_group, shard_rank  # the expert-shard group: data × sequence
        if expert > 1:
            shard_group = _new_groups(_shard_rank_lists(mesh.mesh, list(dims), ("data", "expert", "sequence")),
                                      desc="data_expert")
            shard_rank = dist.get_rank(shard_group)
        return cls(
            shard_group=shard_group, shard_rank=shard_rank, device=device, data_size=d, mesh=mesh,
            data_group=groups["data"], data_rank=ranks["data"],
            pipe_group=groups["pipe"], pipe_rank=ranks["pipe"], pipe_size=p,
            model_group=groups["model"], model_rank=ranks["model"], model_size=m,
            sequence_group=groups.get("sequence"), sequence_rank=ranks.get("sequence", 0), sequence_size=sequence,
            expert_group=groups.get("expert"), expert_rank=ranks.get("expert", 0), expert_size=expert,
            expert_shard_group=es_group, expert_shard_rank=es_rank,
            pipe_model_group=pm_group, pipe_model_rank=dist.get_rank(pm_group), pipe_model_size=p * m,
        )

    @classmethod
    def from_mpu(cls, mpu: Any) -> Topology:
        """The groups of a user's Megatron-style model-parallel unit (``initialize(mpu=...)``).

        The data-parallel group is ``mpu.get_data_parallel_group()`` (as DeepSpeed takes it); model,
        tensor and pipeline groups are read where the object has them. Collective: checks on every rank
        that the groups cover the world consistently and raises the same one-line `ConfigError` on all.
        """
        if not callable(getattr(mpu, "get_data_parallel_group", None)):
            raise ConfigError(f"mpu= must have get_data_parallel_group() (a Megatron-style model-parallel unit); "
                              f"got {type(mpu).__name__}")
        dp_group = mpu.get_data_parallel_group()
        dp_rank, dp_size = _rank_size(dp_group)
        tp_group, tp_rank, tp_size = _read(mpu, ("get_tensor_model_parallel", "get_slice_parallel",
                                                 "get_model_parallel"))
        pp_group, pp_rank, pp_size = _read(mpu, ("get_pipe_parallel", "get_pipeline_model_parallel"))
        mp_group, mp_rank, mp_size = _read(mpu, ("get_model_parallel",))
        report = (dist.get_rank(), _members(dp_group, dp_size), _claimed(mpu, "get_data_parallel", dp_rank, dp_size),
                  mp_size, tp_size, pp_size)
        check_user_groups(_gather_reports(report))
        return cls(
            shard_group=dp_group, shard_rank=dp_rank, device=local_device(), data_size=dp_size, user_mpu=mpu,
            data_group=dp_group, data_rank=dp_rank, expert_shard_group=dp_group, expert_shard_rank=dp_rank,
            pipe_group=pp_group, pipe_rank=pp_rank, pipe_size=pp_size,
            model_group=tp_group, model_rank=tp_rank, model_size=tp_size,
            pipe_model_group=mp_group, pipe_model_rank=mp_rank, pipe_model_size=mp_size,
        )

    @property
    def mesh_shape(self) -> Tuple[int, int, int]:
        """``(pipe, shard, model)`` sizes: the extents of :func:`mesh_ranks`' layout of the world (the
        ranks between pipe and model, data × expert × sequence, counted as one)."""
        return self.pipe_size, self.shard_size, self.model_size

    def dim_of(self, group: Optional[dist.ProcessGroup]) -> Optional[str]:
        """The word for this rank's group ``group`` in this topology (the module docstring's): ``"data"``
        for the shard group when it is the data dimension, else ``"shard"``; then ``"pipe"``, ``"model"``,
        ``"sequence"``, ``"expert"``, ``"pipe_model"``; the first in that order where one group is several
        (a dimension of the whole world, pipe_model of one dimension). None where ``group`` is none of
        them. For error messages."""
        shard = "data" if self.expert_size == self.sequence_size == 1 else "shard"
        named = ((shard, self.shard_group), ("pipe", self.pipe_group), ("model", self.model_group),
                 ("sequence", self.sequence_group), ("expert", self.expert_group),
                 ("pipe_model", self.pipe_model_group))
        for i, (name, g) in enumerate(named):
            if g is group and (g is not None or i == 0):  # None: the world for shard_group only
                return name
        return None


class TopologyRegistry:
    """The meshes built so far, kept for the engines that come later (no new groups per engine).

    The Topology of each ``(pipe, data, model)`` mesh built over the current default process group, by sizes
    and device: a later engine of the same mesh gets the same object, so a mesh's process groups
    (connections under gloo, communicators and their device buffers under NCCL) are created once, not once
    per engine; hpZ's node groups likewise. A new default group (torch.distributed re-initialised) drops
    them: their groups died with the old one.

    No registry is the process's: the engines alive share one (their :class:`~.current.EngineScope` holds
    it; the first engine takes over the one built before it or kept after the last engine was destroyed),
    and ``Topology.from_mesh(..., registry=TopologyRegistry())`` shares nothing.
    """

    #: kept after the last engine alive is destroyed, for the next (:meth:`~.current.EngineScope.lasting`)
    OUTLIVES_ENGINE = True

    def __init__(self) -> None:
        self._default: Optional[weakref.ref] = None  # the default group the meshes were built in
        self._meshes: Dict[Tuple[Tuple[int, int, int], torch.device, Tuple[str, ...], int, int], Topology] = {}
        self._levels: Dict[Tuple[Tuple[int, ...], int], Optional[dist.ProcessGroup]] = {}  # node_group's

    def mesh(self, pipe: int = 1, model: int = 1, dims: Sequence[str] = BASE_DIMS, sequence: int = 1,
             expert: int = 1) -> Topology:
        """The Topology of the ``(pipe, data, model)`` mesh of the world (times ``sequence``), its device mesh
        over ``dims`` (built on first use: collective)."""
        sizes = mesh_sizes(dist.get_world_size(), pipe, model, sequence, expert)
        device = local_device()
        self._forget_dead_groups()
        key = (sizes, device, tuple(dims), sequence, expert)
        if key not in self._meshes:
            self._meshes[key] = Topology.build_mesh(sizes, device, dims, sequence, expert)
        return self._meshes[key]

    def _forget_dead_groups(self) -> None:
        default = dist.distributed_c10d._get_default_group()
        if self._default is None or self._default() is not default:
            self._meshes.clear()  # torch.distributed was re-initialised: the old groups are gone
            self._levels.clear()
            self._default = weakref.ref(default)

    def node_group(self, topology: Topology, size: int) -> Optional[dist.ProcessGroup]:
        """hpZ's level of the data dimension: this rank's block of ``size`` consecutive ranks of
        ``topology``'s ZeRO group (a node, where ranks are numbered node by node as torchrun numbers them).
        Collective over the world on first use (every rank creates every block's group, in the same order,
        with the world's timeout); kept like the meshes."""
        self._forget_dead_groups()
        key = (tuple(group_ranks(topology.shard_group)), size)
        if key not in self._levels:
            self._levels[key] = _node_group(topology.shard_group, size)
        return self._levels[key]

    def meshes(self) -> List[Topology]:
        """The meshes kept (those of the current default group), in the order they were built."""
        return list(self._meshes.values())


def check_user_groups(reports: Sequence[Any]) -> None:
    """Check what every rank read from a user's mpu (one report per global rank, in rank order):
    ``(global rank, data-group members, (rank, size) the mpu claims, model-parallel size, tensor size,
    pipe size)``. Raises one `ConfigError` naming the first disagreement; identical on every rank."""
    world = len(reports)
    for rank, members, (claimed_rank, claimed_size), *_sizes in reports:
        if members is None or rank not in members:
            raise ConfigError(f"mpu: rank {rank} is not in its own data-parallel group "
                              f"(mpu.get_data_parallel_group() on rank {rank} returned a group of ranks "
                              f"{members})")
        if claimed_size is not None and claimed_size != len(members):
            raise ConfigError(f"mpu: on rank {rank} get_data_parallel_world_size() says {claimed_size} but its "
                              f"data-parallel group has {len(members)} ranks")
        if claimed_rank is not None and claimed_rank != members.index(rank):
            raise ConfigError(f"mpu: on rank {rank} get_data_parallel_rank() says {claimed_rank} but the rank is "
                              f"number {members.index(rank)} of its data-parallel group {members}")
    for rank, members, _claims, mp_size, _tp, pp_size in reports:
        for other in members:
            if reports[other][1] != members:
                raise ConfigError(f"mpu: data-parallel groups disagree: rank {rank} is in {members}, rank {other} "
                                  f"in {reports[other][1]}")
        dp = len(members)
        # DeepSpeed's grid counts pipe × tensor as "model parallel"; Megatron counts tensor only
        if dp * mp_size != world and dp * mp_size * pp_size != world:
            pipe = f" (× pipe {pp_size} = {dp * mp_size * pp_size})" if pp_size > 1 else ""
            raise ConfigError(f"mpu: data-parallel size {dp} × model-parallel size {mp_size} = {dp * mp_size}"
                              f"{pipe} ranks on rank {rank}, but the world has {world}")
    sizes = {len(r[1]) for r in reports}
    if len(sizes) > 1:
        raise ConfigError(f"mpu: data-parallel groups of different sizes {sorted(sizes)} across the world")


def _gather_reports(report: Any) -> List[Any]:
    """Every rank's ``report`` in rank order (one object all-gather over the world; the collectives of
    :mod:`.comms` build on a Topology, so the mesh's own setup talks to torch.distributed directly)."""
    reports: List[Any] = [None] * dist.get_world_size()
    try:
        dist.all_gather_object(reports, report)
    except RuntimeError as exc:  # gloo/nccl: a peer gone or the timeout
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise DistributedError(f"all_gather_object(world) of the mpu's groups failed: {first}; every rank must "
                               f"call shardspeed.initialize(mpu=...)") from exc
    return reports


def _new_groups(rank_lists: List[List[int]], desc: Optional[str] = None) -> Optional[dist.ProcessGroup]:
    """Create one group per rank list (every rank creates every group, in order, each with the world
    group's timeout); return this rank's."""
    me, mine = dist.get_rank(), None
    for ranks in rank_lists:
        group = new_group(ranks, desc)
        if me in ranks:
            mine = group
    return mine


def _node_group(shard_group: Optional[dist.ProcessGroup], size: int) -> Optional[dist.ProcessGroup]:
    """Every ZeRO group's blocks of ``size`` consecutive ranks, created on every rank; this rank's."""
    groups: List[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(groups, group_ranks(shard_group))
    blocks = sorted({tuple(r[i : i + size]) for r in groups for i in range(0, len(r), size)})
    return _new_groups([list(b) for b in blocks], desc="data_node")


def _shard_rank_lists(ranks: torch.Tensor, dims: List[str],
                      shard_dims: Sequence[str] = ("data", "sequence")) -> List[List[int]]:
    """ZeRO's groups when the sequence (or expert) dimension is > 1: the global ranks of each plane of
    ``shard_dims`` (those in ``dims``) of the device mesh's rank tensor ``ranks`` (one list per coordinate
    of the other dimensions)."""
    ds = [dims.index(d) for d in shard_dims if d in dims]
    rest = [i for i in range(len(dims)) if i not in ds]
    planes = ranks.permute(*rest, *ds).reshape(-1, math.prod(ranks.shape[i] for i in ds))
    return [sorted(int(r) for r in row) for row in planes.tolist()]


def _timeout_overrides(dims: Sequence[str], shape: Sequence[int]) -> Dict[Any, Any]:
    """``init_device_mesh``'s ``backend_override``: the world group's timeout for each dimension torch
    creates groups for. A dimension of the whole world reuses the world group itself (torch's rule in
    ``DeviceMesh._init_one_process_group``: unless the world group is gloo on a machine with CUDA), so it
    is left out and keeps that group. Empty for a backend other than gloo and NCCL."""
    world, timeout = dist.get_world_size(), group_timeout()
    reuses_world = not (torch.cuda.is_available() and dist.get_backend() == "gloo")
    out: Dict[Any, Any] = {}
    for name, size in zip(dims, shape):
        if size == world and reuses_world:
            continue
        opts = backend_options(timeout)  # one object per dimension: torch keeps it in the groups
        if opts is None:
            return {}
        out[name] = opts
    return out


def describe_group(group: Optional[dist.ProcessGroup], topology: Optional[Topology] = None) -> str:
    """How an error message names ``group`` (None: the world): its name in ``topology``, else in the current
    engine's topology, the other engines' alive and their meshes (:meth:`Topology.dim_of`,
    :mod:`shardspeed.mesh.current`), else its description (``"mesh_pipe"`` → pipe, a tie group's); then its
    global ranks. E.g. ``"the data group (global ranks [1, 3])"``."""
    name = None
    for topo in (topology, *_known_topologies()):
        if topo is not None and name is None:
            name = topo.dim_of(group)
    if name is None:
        desc = str(getattr(group, "group_desc", "") or "")
        default = group is None or group is dist.distributed_c10d._get_default_group()
        if default:
            name = "world"
        elif desc.startswith("mesh_"):
            name = desc[len("mesh_"):]
        elif desc and desc not in ("undefined", "default_pg"):
            name = desc
    return f"the {name or 'process'} group (global ranks {group_ranks(group)})"


def _known_topologies() -> List[Topology]:
    """The topologies of the engines alive (the current one first) and of the meshes they keep."""
    scopes = [CURRENT.scope(), *reversed(CURRENT.alive())]
    known = [s.topology for s in scopes if s.topology is not None]
    for scope in scopes:
        registry = scope.find(TopologyRegistry)
        known += registry.meshes() if registry is not None else []
    return known


def group_ranks(group: Optional[dist.ProcessGroup]) -> List[int]:
    """The global ranks of ``group`` (None: the world); [] where torch cannot say (not a member)."""
    try:
        return list(range(dist.get_world_size())) if group is None else list(dist.get_process_group_ranks(group))
    except (RuntimeError, ValueError):
        return []


def _rank_size(group: Any) -> Tuple[int, int]:
    if group is not None and group is dist.GroupMember.NON_GROUP_MEMBER:
        return -1, 0
    return dist.get_rank(group), dist.get_world_size(group)


def _members(group: Any, size: int) -> Optional[List[int]]:
    if size == 0:
        return None
    if group is None:
        return list(range(dist.get_world_size()))
    return list(dist.get_process_group_ranks(group))


def _claimed(mpu: Any, prefix: str, rank: int, size: int) -> Tuple[Optional[int], Optional[int]]:
    """The (rank, world size) the mpu's own getters report (None where it has none)."""
    get_rank, get_size = getattr(mpu, f"{prefix}_rank", None), getattr(mpu, f"{prefix}_world_size", None)
    return (int(get_rank()) if callable(get_rank) else None, int(get_size()) if callable(get_size) else None)


def _read(mpu: Any, prefixes: Sequence[str]) -> Tuple[Optional[dist.ProcessGroup], int, int]:
    """(group, rank, size) from the first ``<prefix>_group/_rank/_world_size`` the mpu has; (None, 0, 1)
    when it has none."""
    for prefix in prefixes:
        get_group = getattr(mpu, f"{prefix}_group", None)
        get_rank, get_size = getattr(mpu, f"{prefix}_rank", None), getattr(mpu, f"{prefix}_world_size", None)
        if not any(callable(f) for f in (get_group, get_rank, get_size)):
            continue
        group = get_group() if callable(get_group) else None
        rank = int(get_rank()) if callable(get_rank) else (dist.get_rank(group) if group is not None else 0)
        size = int(get_size()) if callable(get_size) else (dist.get_world_size(group) if group is not None else 1)
        return group, rank, size
    return None, 0, 1
