"""Where a unit's shard lives: one placement object per unit, chosen once by the builder.

A :class:`ShardPlacement` owns this rank's chunk of one unit between gathers and answers the questions
the rest of the library asks about it, so no caller branches on where the shard is:

- :class:`DevicePlacement`: in the training device's memory (stages 0-2: a view of the unit's full
  buffer; stage 3: its own buffer).
- :class:`HostPlacement`: in host memory (``offload_param: {"device": "cpu"}``), page-locked when CUDA is
  present; copied to the device only to be all-gathered.
- :class:`~shardspeed.offload.param_file.FilePlacement`: in a region of a file
  (``offload_param: {"device": "nvme"}``); every read is a fresh host copy.

The unit hands its shard to the placement once, when it is constructed (:meth:`ShardPlacement.hold`);
afterwards it reads and writes through :meth:`read` / :meth:`write` (``unit.shard`` / ``unit.write_shard``).
"""
from __future__ import annotations

from typing import Optional

import torch


class ShardPlacement:
    """Storage of one unit's shard. Subclasses set ``where`` and ``on_device`` and implement the methods."""

    where: str = "?"  # "device" | "host" | "file": for logs and memory_breakdown
    on_device = False  # the shard is stored in the training device's memory (a fp32 master may alias it)
    in_file = False  # :meth:`read` is a fresh copy: changes to it are kept only through :meth:`write`

    def hold(self, shard: torch.Tensor, device: torch.device) -> None:
        """Take this rank's chunk (on the training ``device``, which gathers use). Called once, by the unit
        being constructed; ``shard`` may be dropped by the caller afterwards."""
        raise NotImplementedError

    def read(self) -> torch.Tensor:
        """The shard: the stored tensor itself, or (``in_file``) a fresh host copy."""
        raise NotImplementedError

    def write(self, t: torch.Tensor, lo: int = 0) -> None:
        """Store ``t`` (cast to the shard's dtype) as elements ``[lo, lo + t.numel())`` of the shard."""
        raise NotImplementedError

    def to_device_for_gather(self) -> torch.Tensor:
        """The shard on the training device, as the source of an all-gather: the shard itself, or a device
        copy the caller keeps alive until the gather is done."""
        raise NotImplementedError

    def read_ahead(self) -> None:
        """A gather of this shard comes soon: start fetching it (a file: read it in the background), so that
        :meth:`to_device_for_gather` finds it read. No-op where the shard is in memory."""

    def resident(self) -> Optional[torch.Tensor]:
        """The tensor held in memory (device or host), or None when the shard is in a file."""
        return None

    def bytes_held(self) -> int:
        """Bytes of memory this placement holds for the shard (0 in a file)."""
        t = self.resident()
        return 0 if t is None else t.numel() * t.element_size()

    def aliases(self, t: torch.Tensor) -> bool:
        """Whether ``t`` shares the shard's storage (writing into ``t`` changes the shard)."""
        return False

    def close(self) -> None:
        """Free what garbage collection would not (files); the shard is gone afterwards."""


class _MemoryPlacement(ShardPlacement):
    """The shard is one tensor in memory; reads hand it out, writes copy into it."""

    def __init__(self) -> None:
        self._shard: Optional[torch.Tensor] = None
        self._device: Optional[torch.device] = None

    def _held(self) -> torch.Tensor:
        assert self._shard is not None, "placement used before hold()"
        return self._shard

    def read(self) -> torch.Tensor:
        return self._held()

    def write(self, t: torch.Tensor, lo: int = 0) -> None:
        self._held()[lo : lo + t.numel()].copy_(t.reshape(-1))

    def resident(self) -> Optional[torch.Tensor]:
        return self._shard

    def aliases(self, t: torch.Tensor) -> bool:
        return self._shard is not None and t.untyped_storage().data_ptr() == self._shard.untyped_storage().data_ptr()

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.bytes_held()} bytes)"


class DevicePlacement(_MemoryPlacement):
    """The shard in device memory, as given to :meth:`hold` (a view of the full buffer at stages 0-2)."""

    where = "device"
    on_device = True

    def hold(self, shard: torch.Tensor, device: torch.device) -> None:
        self._shard, self._device = shard, device

    def to_device_for_gather(self) -> torch.Tensor:
        return self._held()


class HostPlacement(_MemoryPlacement):
    """The shard in host memory (page-locked when ``pin_memory`` and CUDA is present). On a CPU-only
    machine this is still a separate buffer, so the same path runs."""

    where = "host"

    def __init__(self, pin_memory: bool = True) -> None:
        super().__init__()
        self.pin_memory = bool(pin_memory)

    def hold(self, shard: torch.Tensor, device: torch.device) -> None:
        host = torch.empty(shard.shape, dtype=shard.dtype, device="cpu",
                           pin_memory=self.pin_memory and torch.cuda.is_available())
        host.copy_(shard)
        self._shard, self._device = host, device

    def to_device_for_gather(self) -> torch.Tensor:
        # asynchronous from pinned memory: the caller keeps the copy alive until the gather is done
        return self._held().to(self._device, copy=True, non_blocking=True)
