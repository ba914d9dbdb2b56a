"""Export to and import from ``torch.distributed.checkpoint`` (DCP), the format of torchtitan's checkpoints.

:func:`save_dcp` writes a DCP directory (``.metadata`` and ``__{rank}_{n}.distcp`` files) that a torchtitan-style
``dcp.load(state_dict, checkpoint_id=dir)`` reads at any world size and sharding; :func:`load_dcp` reads one
(written by us, torchtitan, or any ``dcp.save`` of the same names) into a running engine at any world size
and ZeRO stage. Keys, by parameter name as ``model.state_dict()`` and ``get_optimizer_state_dict(...,
flatten_optimizer_state_dict=True)`` give them:

- ``{name}``: every parameter (fp32 masters for trained ones, frozen ones in their dtype; tied names each)
  and persistent buffer, at the top level as torchtitan's flattened model state;
- ``optimizer.state.{name}.{state}``: optimizer states (``exp_avg``, ``exp_avg_sq``, ``step``, ...);
- ``optimizer.param_groups.{name}.{key}``: each parameter's group hyper-parameters (``lr``, ``betas``, ...);
- ``shardspeed_state``: our counters, LR schedule, loss scaler and data-loader position (ignored by others).

Each rank writes what it owns without gathering: a ZeRO piece (a flat range of a parameter) is stored as
the few N-dimensional boxes that make it up (a partial row, whole rows, a partial row), DCP's chunks, and
DCP's resharding maps any saved boxes onto the ranges a loader owns. Not covered: tensor-parallel slices and
offloaded optimizer states (a :class:`~shardspeed.errors.CheckpointError`; use ``save_checkpoint``).
"""
from __future__ import annotations

import io
import math
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Tuple

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import create_default_global_save_plan
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import (
    LoadItemType,
    LoadPlan,
    LoadPlanner,
    ReadItem,
    SavePlan,
    SavePlanner,
    TensorWriteData,
    WriteItem,
    WriteItemType,
)
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

from ..errors import CheckpointError
from .engine_view import EngineView
from .unpickle import load_pickle

OPTIM = "optimizer"
STATE = "shardspeed_state"
Box = Tuple[Tuple[int, ...], Tuple[int, ...], int]  # (offsets, sizes, first flat index)


def flat_boxes(shape: Tuple[int, ...], start: int, end: int) -> List[Box]:
    """Elements ``[start, end)`` of a flattened tensor of ``shape`` as N-D boxes, in order; each box's elements
    are contiguous in the flat order, from its first flat index."""
    if start >= end:
        return []
    if not shape:
        return [((), (), 0)]
    inner = math.prod(shape[1:])
    r0, r1 = start // inner, (end - 1) // inner

    def row(r: int, lo: int, hi: int) -> List[Box]:
        return [((r,) + o, (1,) + z, r * inner + f) for o, z, f in flat_boxes(shape[1:], lo, hi)]

    if r0 == r1 and (start % inner or end % inner):
        return row(r0, start - r0 * inner, end - r0 * inner)
    out: List[Box] = []
    full0 = r0 + (1 if start % inner else 0)
    if start % inner:
        out += row(r0, start % inner, inner)
    if end // inner > full0:
        out.append(((full0,) + (0,) * (len(shape) - 1), (end // inner - full0,) + tuple(shape[1:]), full0 * inner))
    if end % inner:
        out += row(end // inner, 0, end % inner)
    return out


@dataclass
class Piece:
    """A flat range of one tensor of the checkpoint that this rank writes or fills: ``flat`` holds elements
    ``[start, start + flat.numel())`` of the flattened tensor ``fqn`` of ``shape``."""

    fqn: str
    shape: Tuple[int, ...]
    start: int
    flat: torch.Tensor

    def boxes(self) -> List[Tuple[Tuple[int, ...], Tuple[int, ...], torch.Tensor]]:
        """(offsets, sizes, the view of ``flat`` holding the box) of each box of this range."""
        out = []
        for offs, sizes, first in flat_boxes(self.shape, self.start, self.start + self.flat.numel()):
            lo = first - self.start
            out.append((offs, sizes, self.flat[lo : lo + math.prod(sizes)].view(sizes)))
        return out


def _check_supported(view: EngineView, what: str) -> None:
    if view.offloaded:
        raise CheckpointError(f"{what}: an engine with offload_optimizer keeps its optimizer state in the offload "
                              f"store, which the DCP export does not read yet; use save_checkpoint/load_checkpoint")
    if any(u.placement.in_file for u in view.units):
        raise CheckpointError(f"{what}: offload_param nvme keeps parameter shards in files, which the DCP export "
                              f"does not read yet; use save_checkpoint/load_checkpoint")
    if view.slices:
        raise CheckpointError(f"{what}: tensor-parallel slices are not mapped to DCP chunks yet; use "
                              f"save_checkpoint/load_checkpoint (which reshard across tensor-parallel sizes)")


def _weights(view: EngineView, load: bool = False) -> List[Piece]:
    """The model's tensors this rank writes: its pieces of trained parameters (fp32 masters) and of frozen
    ones, and (data rank 0) what every rank holds whole; tied names get a piece each (``state_dict``'s keys).
    ``load``: everything this rank holds (a replicated tensor is filled on every rank), under first names."""
    shape = {n: view.full_shape(n, s) for n, s, _ in view.unit_params()}
    also: Dict[str, List[str]] = {}
    for alias, first in view.aliases.items():
        also.setdefault(first, []).append(alias)

    def names(name: str) -> List[str]:
        return [name] if load else [name] + also.get(name, [])

    out: List[Piece] = []
    for unit, pieces, frozen in zip(view.units, view.pieces(), view.frozen_pieces()):
        if load or view.writes_unit(unit):
            ranges = [(pc.name, pc.start, pc.master) for pc in pieces] + [(n, s, t) for n, s, _, t in frozen]
            out += [Piece(n, shape[name], start, t.view(-1)) for name, start, t in ranges for n in names(name)]
    if load or view.data_rank == 0:
        out += [Piece(n, tuple(t.shape), 0, t.detach().view(-1)) for name, t in view.other_params() + view.buffers()
                for n in names(name)]
    return out


def _hyper(group: Dict[str, Any]) -> Dict[str, Any]:
    return {k: v for k, v in group.items() if k not in ("params", "param_names")}


def _optimizer(view: EngineView) -> Tuple[List[Piece], Dict[str, Any]]:
    """This rank's optimizer states: elementwise ones as pieces; the others (``step``) and each parameter's
    group hyper-parameters as whole values, from the rank holding the parameter's first element."""
    pieces: List[Piece] = []
    values: Dict[str, Any] = {}
    groups = dict(zip(view.master.group_indices, view.optimizer.param_groups))
    shape = {n: view.full_shape(n, s) for n, s, _ in view.unit_params()}
    for unit, owned in zip(view.units, view.pieces()):
        if not view.writes_unit(unit):
            continue
        for pc in owned:
            if not view.writes_param(pc.name):
                continue
            first = pc.start == 0
            for sk, sv in view.optimizer.state.get(pc.master, {}).items():
                key = f"{OPTIM}.state.{pc.name}.{sk}"
                if torch.is_tensor(sv) and sv.dim() >= 1 and sv.numel() == pc.master.numel():
                    pieces.append(Piece(key, shape[pc.name], pc.start, sv.view(-1)))
                elif first and torch.is_tensor(sv):  # Adam's 0-dim step: a whole tensor, as torch saves it
                    pieces.append(Piece(key, tuple(sv.shape), 0, sv.detach().reshape(-1)))
                elif first:
                    values[key] = sv
            if first:
                for k, v in _hyper(groups.get(pc.group, {})).items():
                    values[f"{OPTIM}.param_groups.{pc.name}.{k}"] = v
    return pieces, values


class _SavePlanner(SavePlanner):
    """Writes the given pieces (as their boxes: DCP's ``SHARD`` items) and values (``BYTE_IO`` items)."""

    def __init__(self, pieces: List[Piece], values: Dict[str, Any]):
        self.values = values
        self.tensors: Dict[Tuple[str, Tuple[int, ...]], torch.Tensor] = {}
        self.items: List[WriteItem] = []
        for p in pieces:
            for offs, sizes, t in p.boxes():
                self.tensors[(p.fqn, offs)] = t
                chunk = ChunkStorageMetadata(offsets=torch.Size(offs), sizes=torch.Size(sizes))
                data = TensorWriteData(chunk=chunk, properties=TensorProperties(dtype=t.dtype),
                                       size=torch.Size(p.shape))
                self.items.append(WriteItem(index=MetadataIndex(p.fqn, offs), type=WriteItemType.SHARD,
                                            tensor_data=data))
        self.items += [WriteItem(index=MetadataIndex(k), type=WriteItemType.BYTE_IO) for k in values]

    def set_up_planner(self, state_dict, storage_meta=None, is_coordinator: bool = False) -> None:
        pass

    def create_local_plan(self) -> SavePlan:
        return SavePlan(self.items)

    def create_global_plan(self, all_plans: List[SavePlan]) -> Tuple[List[SavePlan], Metadata]:
        return create_default_global_save_plan(all_plans, rewrite_index_hints=False)

    def finish_plan(self, new_plan: SavePlan) -> SavePlan:
        return new_plan

    def resolve_data(self, write_item: WriteItem):
        if write_item.type == WriteItemType.BYTE_IO:
            buf = io.BytesIO()
            torch.save(self.values[write_item.index.fqn], buf)
            buf.seek(0)
            return buf
        offset = tuple(write_item.index.offset) if write_item.index.offset is not None else ()
        return self.tensors[(write_item.index.fqn, offset)]


def _group_kwargs(view: EngineView) -> Dict[str, Any]:
    """DCP's process group: the checkpoint's coordination group (None: no process group at one rank)."""
    if view.coord.world == 1:
        return {"no_dist": True}
    return {"process_group": view.coord.group}


def save_dcp(engine, checkpoint_dir: str) -> str:
    """Write the engine's model and optimizer state (and ``shardspeed_state``) as a DCP checkpoint in
    ``checkpoint_dir``; every rank calls it. Waits for an asynchronous :meth:`save_checkpoint` first."""
    view = EngineView(engine, "save_dcp")
    if view.parts.async_saves is not None:
        view.parts.async_saves.wait(view.coord)
    _check_supported(view, "save_dcp")
    opt_pieces, values = _optimizer(view)
    if view.rank == 0:
        values[STATE] = view.common_state()
    dcp.save({}, checkpoint_id=checkpoint_dir, planner=_SavePlanner(_weights(view) + opt_pieces, values),
             **_group_kwargs(view))
    return checkpoint_dir


class _LoadPlanner(LoadPlanner):
    """Fills the given pieces from whichever saved chunks overlap their boxes, and collects values."""

    def __init__(self, checkpoint_dir: str, view: EngineView, module_only: bool, trust_pickles: bool = False):
        self.dir, self.view, self.module_only = checkpoint_dir, view, module_only
        self.trust_pickles = trust_pickles
        self.tensors: Dict[Tuple[str, Tuple[int, ...]], torch.Tensor] = {}
        self.values: Dict[str, Any] = {}
        self.states: Dict[int, Dict[str, Any]] = {}  # id(master piece) -> its optimizer state (as read)
        self.md: Optional[Metadata] = None

    def set_up_planner(self, state_dict, metadata: Optional[Metadata] = None, is_coordinator: bool = False) -> None:
        self.md = metadata

    def _saved(self, fqn: str, shape: Tuple[int, ...]) -> TensorStorageMetadata:
        assert self.md is not None
        md = self.md.state_dict_metadata.get(fqn)
        if not isinstance(md, TensorStorageMetadata):
            raise CheckpointError(f"DCP checkpoint {self.dir}/.metadata has no tensor {fqn!r}")
        if tuple(md.size) != tuple(shape):
            raise CheckpointError(f"DCP checkpoint {self.dir}/.metadata: {fqn!r} has shape {list(md.size)}, the "
                                  f"model's is {list(shape)}")
        return md

    def _reads(self, p: Piece) -> List[ReadItem]:
        md = self._saved(p.fqn, p.shape)
        chunks = []
        for offs, sizes, t in p.boxes():
            self.tensors[(p.fqn, offs)] = t
            chunks.append(ChunkStorageMetadata(offsets=torch.Size(offs), sizes=torch.Size(sizes)))
        return create_read_items_for_chunk_list(p.fqn, md, chunks)

    def _value(self, key: str) -> List[ReadItem]:
        index = MetadataIndex(key)
        return [ReadItem(type=LoadItemType.BYTE_IO, dest_index=index, dest_offsets=torch.Size((0,)),
                         storage_index=index, storage_offsets=torch.Size((0,)), lengths=torch.Size((0,)))]

    def _optimizer_reads(self) -> List[ReadItem]:
        """New tensors for every optimizer state saved for this rank's pieces, and the values to read."""
        assert self.md is not None
        view, saved, items = self.view, self.md.state_dict_metadata, []
        shape = {n: view.full_shape(n, s) for n, s, _ in view.unit_params()}
        for pc in (pc for pieces in view.pieces() for pc in pieces):
            state = self.states.setdefault(id(pc.master), {})
            prefix = f"{OPTIM}.state.{pc.name}."
            for key in (k for k in saved if k.startswith(prefix)):
                md = saved[key]
                if isinstance(md, BytesStorageMetadata):
                    items += self._value(key)
                    continue
                elementwise = tuple(md.size) == tuple(shape[pc.name])
                t = torch.empty(pc.master.numel() if elementwise else tuple(md.size), dtype=md.properties.dtype)
                state[key[len(prefix):]] = t.view(pc.master.shape) if elementwise else t
                items += self._reads(Piece(key, tuple(md.size), pc.start if elementwise else 0, t.view(-1)))
            hyper = f"{OPTIM}.param_groups.{pc.name}."
            items += [i for k in saved if k.startswith(hyper) for i in self._value(k)]
        return items

    def create_local_plan(self) -> LoadPlan:
        assert self.md is not None
        items: List[ReadItem] = []
        for p in _weights(self.view, load=True):
            items += self._reads(p)
        if not self.module_only:
            items += self._optimizer_reads()
            if STATE in self.md.state_dict_metadata:
                items += self._value(STATE)
        return LoadPlan(items)

    def create_global_plan(self, global_plan: List[LoadPlan]) -> List[LoadPlan]:
        return global_plan

    def finish_plan(self, central_plan: LoadPlan) -> LoadPlan:
        return central_plan

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        fqn = read_item.dest_index.fqn
        self.values[fqn] = load_pickle(value.getvalue(), f"{self.dir} item {fqn!r}", self.trust_pickles)

    def resolve_tensor(self, read_item: ReadItem) -> torch.Tensor:
        index = read_item.dest_index
        t = self.tensors[(index.fqn, tuple(index.offset) if index.offset is not None else ())]
        for dim, (lo, n) in enumerate(zip(read_item.dest_offsets, read_item.lengths)):
            t = t.narrow(dim, lo, n)
        return t

    def commit_tensor(self, read_item: ReadItem, tensor: torch.Tensor) -> None:
        pass  # resolve_tensor gave a view of the destination: the bytes are in place


def _apply_optimizer(view: EngineView, planner: _LoadPlanner) -> None:
    """The read states and group hyper-parameters into the optimizer (``load_state_dict`` by position)."""
    names = {id(pc.master): pc.name for pieces in view.pieces() for pc in pieces}
    state: Dict[int, Dict[str, Any]] = {}
    groups: List[Dict[str, Any]] = []
    idx = 0
    for g in view.optimizer.param_groups:
        ids, hyper = [], _hyper(g)
        for t in g["params"]:
            name = names.get(id(t))
            st = dict(planner.states.get(id(t), {}))
            if name is not None:
                for key, v in planner.values.items():
                    if key.startswith(f"{OPTIM}.state.{name}."):
                        st.setdefault(key[len(f"{OPTIM}.state.{name}.") :], v)
                    elif key.startswith(f"{OPTIM}.param_groups.{name}.") and key.rsplit(".", 1)[1] in hyper:
                        hyper[key.rsplit(".", 1)[1]] = v
            if st:
                state[idx] = st
            ids.append(idx)
            idx += 1
        groups.append(dict(hyper, params=ids))
    view.optimizer.load_state_dict({"state": state, "param_groups": groups})


@torch.no_grad()
def load_dcp(engine, checkpoint_dir: str, load_module_only: bool = False, trust_pickles: bool = False) -> Optional[dict]:
    """Load a DCP checkpoint (:func:`save_dcp`'s keys) into the engine at any world size and ZeRO stage;
    every rank calls it. Returns what ``shardspeed_state`` held (None when the checkpoint has none, e.g.
    torchtitan's). A missing or misshapen tensor is a CheckpointError on every rank before anything is read;
    an I/O error while reading leaves the engine partially loaded. Its pickled values load through an
    allowlist of plain types (:func:`~.unpickle.load_pickle`; ``trust_pickles``: anything, running its code)."""
    view = EngineView(engine, "load_dcp")
    if view.parts.async_saves is not None:
        view.parts.async_saves.wait(view.coord)
    _check_supported(view, "load_dcp")
    planner = _LoadPlanner(checkpoint_dir, view, load_module_only, trust_pickles)
    try:
        dcp.load({}, checkpoint_id=checkpoint_dir, planner=planner, **_group_kwargs(view))
    except CheckpointException as exc:  # every rank's failures, the same on every rank
        raise CheckpointError("; ".join(sorted({str(f[0] if isinstance(f, tuple) else f)
                                                 for f in exc.failures.values()}))) from None
    for unit, frozen in zip(view.units, view.frozen_pieces()):
        view.store_frozen(unit, [f[3] for f in frozen])
    if not load_module_only:
        _apply_optimizer(view, planner)
    common = planner.values.get(STATE)
    if common is not None and not load_module_only:
        view.load_common_state(common)
    view.write_back_masters()
    return common
