"""A range of a stored tensor, found and read: which entries hold it, and its elements read from them.

A loader at any world size and ZeRO stage asks for the flat range ``[start, end)`` of a tensor (or of one of
its optimizer states) that it owns now; :class:`EntryIndex` finds the saved entries (:mod:`.metadata`) that
overlap it, :func:`plan_reads` or :func:`~.slices.copy_runs` (tensor-parallel slices) works out the copies,
and :func:`read_range` reads each entry once from its file (:class:`~.format.ShardReader`, CRC checked).
"""
from __future__ import annotations

import bisect
from typing import Dict, List, Mapping, Optional, Sequence, Tuple

import torch

from ..errors import CheckpointError
from .format import ShardReader
from .metadata import WEIGHT, Entry
from .slices import Spec, copy_runs


class EntryIndex:
    """Entries grouped by (tensor, state) and sorted by start, for range look-ups."""

    def __init__(self, entries: List[Entry], shapes: Optional[Mapping[str, Sequence[int]]] = None):
        #: full shapes of the tensors (needed to read tensor-parallel slices: ``CheckpointMetadata.shapes``)
        self.shapes: Dict[str, Sequence[int]] = dict(shapes or {})
        self._by: Dict[Tuple[str, str], List[Entry]] = {}
        for e in entries:
            self._by.setdefault((e.tensor, e.state), []).append(e)
        self._starts: Dict[Tuple[str, str], List[int]] = {}
        for k, lst in self._by.items():
            lst.sort(key=lambda e: e.start)
            self._starts[k] = [e.start for e in lst]

    def entries_of(self, tensor: str, state: str = WEIGHT) -> List[Entry]:
        return self._by.get((tensor, state), [])

    def sliced(self, tensor: str, state: str = WEIGHT) -> bool:
        """Whether some entry of ``tensor``'s ``state`` holds a range of a tensor-parallel slice."""
        return any(e.tp is not None for e in self._by.get((tensor, state), []))

    def states_of(self, tensor: str) -> List[str]:
        return sorted(s for (t, s) in self._by if t == tensor and s != WEIGHT)

    def has(self, tensor: str, state: str = WEIGHT) -> bool:
        return (tensor, state) in self._by

    def overlapping(self, tensor: str, state: str, start: int, end: int) -> List[Entry]:
        lst = self._by.get((tensor, state), [])
        i = max(bisect.bisect_right(self._starts.get((tensor, state), []), start) - 1, 0)
        out = []
        for e in lst[i:]:
            if e.start >= end:
                break
            if e.end > start or (e.start == e.end == start):
                out.append(e)
        return out


def plan_reads(entries: List[Entry], start: int, end: int) -> List[Tuple[Entry, int, int, int]]:
    """For a wanted range, (entry, offset in entry, offset in output, length) of each overlap; raises if the
    entries leave a hole. Pure arithmetic."""
    out = []
    covered = start
    for e in entries:
        lo, hi = max(e.start, start), min(e.end, end)
        if hi <= lo:
            continue
        if lo > covered:
            break
        out.append((e, lo - e.start, lo - start, hi - lo))
        covered = max(covered, hi)
    if covered < end:
        raise CheckpointError(f"elements [{covered}, {end}) of this range are in no checkpoint file")
    return out


def _sliced_runs(index: EntryIndex, tensor: str, state: str, start: int, end: int,
                 sl: Spec) -> List[Tuple[Entry, int, int, int]]:
    """:func:`~.slices.copy_runs` over the entries of ``tensor``'s ``state`` (grouped by entry)."""
    entries = index.entries_of(tensor, state)
    shape = index.shapes.get(tensor)
    if shape is None:
        raise CheckpointError(f"{tensor!r} ({state or 'weights'}): the checkpoint has no shape for it")
    try:
        runs = copy_runs(shape, sl, start, end, [(e.spec, e.start, e.end) for e in entries])
    except CheckpointError as exc:
        raise CheckpointError(f"{tensor!r} ({state or 'weights'}): {exc}") from exc
    return [(entries[k], dst, src, n) for k, dst, src, n in runs]


def entries_for(index: EntryIndex, tensor: str, state: str, start: int, end: int, sl: Spec = None) -> List[Entry]:
    """The entries a :func:`read_range` of the same arguments reads; raises if they leave a hole."""
    if sl is not None or index.sliced(tensor, state):
        out: List[Entry] = []
        for e, *_ in _sliced_runs(index, tensor, state, start, end, sl):
            if not out or out[-1] is not e:
                out.append(e)
        return out
    try:
        return [p[0] for p in plan_reads(index.overlapping(tensor, state, start, end), start, end)]
    except CheckpointError as exc:
        raise CheckpointError(f"{tensor!r} ({state or 'weights'}): {exc}") from exc


def read_range(reader: ShardReader, index: EntryIndex, tensor: str, state: str, start: int, end: int,
               out: Optional[torch.Tensor] = None, dtype: Optional[torch.dtype] = None,
               sl: Spec = None) -> torch.Tensor:
    """Elements ``[start, end)`` of the flattened ``tensor`` (or its optimizer ``state``), assembled from the
    files that hold them. Reads each overlapping entry once (bounded by one saved piece), verifying its CRC.

    ``sl``: the range counts in this tensor-parallel slice of the tensor (None: in the full tensor). When it
    is set or the saved entries are slices, elements are matched through their place in the full tensor."""
    if out is None:
        out = torch.empty(end - start, dtype=dtype or torch.float32)
    if sl is not None or index.sliced(tensor, state):
        flat = out.view(-1)
        held: Optional[Entry] = None
        t = torch.empty(0)
        for e, dst, src, n in _sliced_runs(index, tensor, state, start, end, sl):
            if e is not held:  # the runs are grouped by entry: one saved entry in memory at a time
                held, t = e, reader.read(e.file, e.key, e.crc32).reshape(-1)
            flat[dst : dst + n].copy_(t[src : src + n])
        return out
    entries = index.overlapping(tensor, state, start, end)
    try:
        plan = plan_reads(entries, start, end)
    except CheckpointError as exc:
        raise CheckpointError(f"{tensor!r} ({state or 'weights'}): {exc}") from exc
    if (len(plan) == 1 and plan[0][1] == 0 and plan[0][3] == out.numel() == plan[0][0].end - plan[0][0].start
            and out.is_contiguous() and out.device.type == "cpu"
            and reader.dtype_of(plan[0][0].file, plan[0][0].key) == out.dtype):
        e = plan[0][0]  # the entry is exactly the range wanted: read it in place (no temporary)
        reader.read(e.file, e.key, e.crc32, out=out)
        return out
    for e, src_off, dst_off, n in plan:
        t = reader.read(e.file, e.key, e.crc32).reshape(-1)
        out[dst_off : dst_off + n].copy_(t[src_off : src_off + n])
    return out
