"""A FlatParamUnit: parameters that live as views into one flat, padded, sharded buffer.

Stages 0-2 keep the full buffer (``full``) alive and each rank updates its chunk (``shard`` is a view of
it); stage 3 keeps only ``shard`` and materialises ``full`` while the unit is in use. Where the shard lives
(device, host, file) is the unit's :mod:`placement <.placement>`, given at construction.
"""
from __future__ import annotations

import enum
import functools
import warnings
from typing import TYPE_CHECKING, List, Optional, Sequence, Tuple

import torch
import torch.nn as nn

from ..precision.casting import COMM_DTYPE_ATTR
from .layout import FlatLayout, Piece
from .placement import DevicePlacement, ShardPlacement
from .tags import ZeroParamStatus, clear_init_shard, init_shard_of, mark_stage3, set_status  # zero.Init: sliced

if TYPE_CHECKING:
    from shardspeed.comm.collectives import Collectives, CommHandle


class UnitState(enum.Enum):
    SHARDED = "sharded"  # only this rank's chunk is held (stage 3, outside use)
    GATHERED = "gathered"  # the full buffer is held and the parameters view it


class FlatParamUnit:
    """Parameters of one unit, flattened into ``full`` (``layout.padded_numel`` elements).

    Creating a unit moves the parameters' data into the flat buffer: afterwards ``param.data`` is a view
    of ``full``; nothing else about the parameters changes (same objects, same ``requires_grad``).
    """

    #: the collectives of the group this unit is sharded and reduced over when it is not the engine's data
    #: group: an expert unit's expert-data group (its ``world`` and ``rank`` are that group's); None: the
    #: reducer's and parameter manager's own
    comm: Optional[Collectives] = None

    def __init__(self, params: Sequence[nn.Parameter], world: int, rank: int, index: int = 0, align: int = 1):
        if not params:
            raise ValueError("a unit needs at least one parameter")
        dtypes = {p.dtype for p in params}
        devices = {p.device for p in params}
        if len(dtypes) != 1 or len(devices) != 1:
            raise ValueError(f"unit {index}: parameters mix dtypes {dtypes} or devices {devices}")
        self.index = index
        self.params: List[nn.Parameter] = list(params)
        self.shapes = [p.shape for p in self.params]
        self.layout = FlatLayout.of([p.numel() for p in self.params], world, align)
        self.rank = rank
        self.dtype = dtypes.pop()
        self.device = devices.pop()
        full = torch.zeros(self.layout.padded_numel, dtype=self.dtype, device=self.device)
        for p, off, n in zip(self.params, self.layout.offsets, self.layout.numels):
            full[off : off + n].copy_(p.detach().reshape(-1))
        self.full: Optional[torch.Tensor] = full  # None while a stage-3 unit is sharded
        self._point_params_at_full()
        lo, hi = self.layout.chunk_range(rank)
        self.placement: ShardPlacement = DevicePlacement()  # the shard is a view of the full buffer
        self.placement.hold(self.full[lo:hi], self.device)
        self.state = UnitState.GATHERED
        self.grad_params = [i for i, p in enumerate(self.params) if p.requires_grad]

    @property
    def numel(self) -> int:
        return self.layout.numel

    @functools.cached_property
    def wire_dtype(self) -> Optional[torch.dtype]:
        """``torch_autocast``: the dtype every parameter of this unit reduces its gradient in (DeepSpeed's
        ``comm_dtype`` tag on the parameters of lower-precision-safe modules); None when they differ or none is
        tagged (the reduce policy's dtype)."""
        tags = {getattr(p, COMM_DTYPE_ATTR, None) for p in self.params}
        return tags.pop() if len(tags) == 1 else None

    @property
    def shard(self) -> torch.Tensor:
        """This rank's chunk: the stored tensor, or where the placement is a file a fresh host copy (writes
        into it are not stored: use :meth:`write_shard`)."""
        return self.placement.read()

    def shard_on_device(self) -> torch.Tensor:
        """This rank's chunk on the compute device, for a collective: the shard itself, or a fresh device
        copy of a host or file shard (asynchronous from pinned memory)."""
        return self.placement.to_device_for_gather()

    def write_shard(self, t: torch.Tensor, lo: int = 0) -> None:
        """Store ``t`` as elements ``[lo, lo + t.numel())`` of this rank's chunk (cast to the unit's dtype).
        Code that changes the shard goes through here, so a file placement writes the file."""
        self.placement.write(t, lo)

    @property
    def pieces(self) -> List[Piece]:
        return self.layout.pieces(self.rank)

    def param_view(self, buffer: torch.Tensor, index: int) -> torch.Tensor:
        """The flattened slice of a full-size ``buffer`` that belongs to parameter ``index``."""
        off = self.layout.offsets[index]
        return buffer[off : off + self.layout.numels[index]]

    def _point_params_at_full(self) -> None:
        full = self.full
        assert full is not None
        for p, off, n, shape in zip(self.params, self.layout.offsets, self.layout.numels, self.shapes):
            p.data = full[off : off + n].view(shape)

    def __repr__(self) -> str:
        return (
            f"FlatParamUnit(index={self.index}, params={len(self.params)}, numel={self.numel}, "
            f"padded={self.layout.padded_numel}, state={self.state.value})"
        )


class ShardedParamUnit(FlatParamUnit):
    """Stage 3: only this rank's chunk is held; the full buffer exists while the unit is in use.

    ``gather`` / ``release`` are idempotent state transitions (SHARDED ⇄ GATHERED). While sharded, each
    parameter's ``.data`` is an empty placeholder, so stray use fails with a shape error instead of
    silently reading stale values. ``placement`` (default: the device) holds the shard from construction on.

    The gathered buffer is one tensor for the unit's life: :meth:`release` frees its storage (resizes it
    to zero bytes) and the next gather re-allocates and fills that same storage. Autograd may hold views
    of the parameters saved in forward; they see the storage freed after the unit's forward and filled
    again before its backward, so a saved graph costs no gathered memory in between (FSDP does the same).
    """

    def __init__(self, params: Sequence[nn.Parameter], world: int, rank: int, index: int = 0, align: int = 1,
                 group=None, placement: Optional[ShardPlacement] = None):
        # (buffer, CommHandle, source) of an asynchronous gather in flight
        self._pending: Optional[Tuple[torch.Tensor, CommHandle, torch.Tensor]] = None
        self._buffer: Optional[torch.Tensor] = None  # the gathered storage, kept (freed/refilled) for life
        self._secondary: Optional[torch.Tensor] = None  # hpZ: this rank's part of the unit within its node
        placement = placement if placement is not None else DevicePlacement()
        if not any(init_shard_of(p) is not None for p in params):
            super().__init__(params, world, rank, index, align)
            placement.hold(self.shard.clone(), self.device)  # own storage: the full buffer is about to go
            self.placement = placement
            self._buffer = self.full
            self._placeholder = torch.empty(0, dtype=self.dtype, device=self.device)
            mark_stage3(self.params, self.shapes, ZeroParamStatus.AVAILABLE)
            self.release()
            return
        # Assemble this rank's chunk one parameter at a time: peak memory is one whole parameter.
        self.index, self.params, self.rank = index, list(params), rank
        infos = [init_shard_of(p) for p in self.params]
        self.shapes = [i.shape if i is not None else p.shape for i, p in zip(infos, self.params)]
        self.layout = FlatLayout.of([i.numel if i is not None else p.numel() for i, p in zip(infos, self.params)],
                                    world, align)
        self.dtype, self.device = self.params[0].dtype, self.params[0].device
        shard = torch.zeros(self.layout.chunk_size, dtype=self.dtype, device=self.device)
        pieces = {pc.param_index: pc for pc in self.layout.pieces(rank)}
        for i, (p, info) in enumerate(zip(self.params, infos)):
            flat = (info.gather_full(group) if info is not None else p.detach()).reshape(-1)
            pc = pieces.get(i)
            if pc is not None:
                shard[pc.chunk_start : pc.chunk_start + pc.numel].copy_(flat[pc.param_start : pc.param_end])
            if info is not None:
                clear_init_shard(p)  # the slice is in this unit's shard now
        placement.hold(shard, self.device)
        self.placement = placement
        self.full = None
        self.grad_params = [i for i, p in enumerate(self.params) if p.requires_grad]
        self._placeholder = torch.empty(0, dtype=self.dtype, device=self.device)
        for p in self.params:
            p.data = self._placeholder
        self.state = UnitState.SHARDED
        mark_stage3(self.params, self.shapes, ZeroParamStatus.NOT_AVAILABLE)

    def release(self) -> None:
        """Drop the gathered parameters: placeholders in ``.data``, the buffer's storage freed (views that
        autograd saved stay valid objects and are filled again by the next gather)."""
        if self.state is UnitState.SHARDED:
            return
        for p in self.params:
            p.data = self._placeholder
        self.full = None
        if self._buffer is not None:
            self._buffer.untyped_storage().resize_(0)
        self.state = UnitState.SHARDED
        set_status(self.params, ZeroParamStatus.NOT_AVAILABLE)

    def _gather_buffer(self) -> torch.Tensor:
        """The unit's one gathered buffer, its storage (re-)allocated."""
        if self._buffer is None:
            self._buffer = torch.empty(self.layout.padded_numel, dtype=self.dtype, device=self.device)
        storage = self._buffer.untyped_storage()
        nbytes = self.layout.padded_numel * self._buffer.element_size()
        if storage.nbytes() != nbytes:
            storage.resize_(nbytes)
        return self._buffer

    def start_gather(self, comm, secondary=None) -> None:
        """Issue the all-gather (asynchronously); parameters become usable after :meth:`finish_gather`.

        ``comm``: anything with ``Collectives.all_gather``'s signature (a quantizing one for ZeRO++'s qwZ).
        ``secondary`` (hpZ): the collectives of this rank's node; while the unit holds a secondary part
        (:meth:`keep_secondary`), the gather runs there, from it."""
        if self.state is UnitState.GATHERED or self._pending is not None:
            return
        self._check_untouched()
        full = self._gather_buffer()
        set_status(self.params, ZeroParamStatus.INFLIGHT)
        if secondary is not None and self._secondary is not None:
            self._pending = (full, secondary.all_gather(full, self._secondary, async_op=True), self._secondary)
            return
        src = self.shard_on_device()  # offload_param: the host→device copy, kept alive until finish_gather
        self._pending = (full, comm.all_gather(full, src, async_op=True), src)

    def keep_secondary(self, part: int, parts: int) -> None:
        """hpZ: keep part ``part`` of ``parts`` of the gathered parameters (the values the forward used, so a
        backward sees the same weights) until :meth:`drop_secondary`; no-op when not gathered or kept."""
        if self.state is UnitState.GATHERED and self._secondary is None and self.full is not None:
            self._secondary = self.full.view(parts, -1)[part].clone()

    def write_shard(self, t: torch.Tensor, lo: int = 0) -> None:
        super().write_shard(t, lo)
        self._secondary = None  # the parameters changed

    def drop_secondary(self) -> None:
        """The parameters changed (an optimizer step, an edit): the secondary part is stale."""
        self._secondary = None

    @property
    def secondary_numel(self) -> int:
        return 0 if self._secondary is None else self._secondary.numel()

    def _check_untouched(self) -> None:
        """A sharded parameter whose ``.data`` was replaced was edited outside GatheredParameters."""
        for p in self.params:
            if p.data.numel() != 0:
                warnings.warn(
                    f"a ZeRO-3 parameter of shape {tuple(p.data.shape)} (unit {self.index}) was modified while it "
                    f"was sharded; the change is discarded. Edit parameters inside "
                    f"shardspeed.zero.GatheredParameters(params, modifier_rank=0).",
                    stacklevel=4,
                )
                p.data = self._placeholder

    def finish_gather(self) -> None:
        if self.state is UnitState.GATHERED:
            return
        if self._pending is None:
            raise RuntimeError(f"unit {self.index}: finish_gather without start_gather")
        full, handle, _ = self._pending
        handle.wait()
        self._pending = None
        self.full = full
        self._point_params_at_full()
        self.state = UnitState.GATHERED
        set_status(self.params, ZeroParamStatus.AVAILABLE)

    def gather(self, comm) -> None:
        self.start_gather(comm)
        self.finish_gather()

    @property
    def gathering(self) -> bool:
        return self._pending is not None
