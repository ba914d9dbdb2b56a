"""Pure arithmetic: how this rank's master chunks are cut into tiles for the host step (no tensors).

A *tile* is a contiguous range ``[lo, hi)`` of one unit's chunk whose elements all belong to one param
group (so one set of hyper-parameters applies) and that holds at most ``tile_elems`` elements. Padding
at the end of a chunk belongs to no parameter and is in no tile. Tiles are the unit of everything the
offload pipeline moves: a gradient copy to the host, a read/write of optimizer state from/to disk, a
kernel call, the copy of the updated weights back.

Placement (``ratio``): whole units are offloaded in order until the offloaded elements reach
``ratio`` of the total; the other units keep their master and state on the device.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import List, Sequence, Tuple


@dataclass(frozen=True)
class Tile:
    index: int  # position in the plan (also the order of the step)
    unit: int  # unit index
    lo: int  # start inside the unit's chunk
    hi: int  # end inside the unit's chunk
    group: int  # position of the param group in the optimizer's param_groups
    offset: int  # start of this tile in the rank's flat state space of its placement (files, host arrays)

    @property
    def numel(self) -> int:
        return self.hi - self.lo


def runs_of(pieces: Sequence[Tuple[int, int, int]]) -> List[Tuple[int, int, int]]:
    """Merge ``(chunk_start, numel, group)`` pieces into maximal contiguous runs of one group."""
    out: List[List[int]] = []
    for start, n, g in sorted(pieces):
        if n <= 0:
            continue
        if out and out[-1][1] == start and out[-1][2] == g:
            out[-1][1] = start + n
        else:
            out.append([start, start + n, g])
    return [(a, b, g) for a, b, g in out]


def plan_tiles(unit_pieces: Sequence[Sequence[Tuple[int, int, int]]], tile_elems: int,
               units: Sequence[int]) -> List[Tile]:
    """Tiles of the given units (in that order), each run cut into pieces of at most ``tile_elems``."""
    if tile_elems < 1:
        raise ValueError(f"tile_elems must be >= 1, got {tile_elems}")
    tiles: List[Tile] = []
    offset = 0
    for u in units:
        for lo, hi, g in runs_of(unit_pieces[u]):
            for a in range(lo, hi, tile_elems):
                b = min(a + tile_elems, hi)
                tiles.append(Tile(len(tiles), u, a, b, g, offset))
                offset += b - a
    return tiles


def split_by_ratio(unit_numels: Sequence[int], ratio: float) -> Tuple[List[int], List[int]]:
    """(offloaded units, device units): units in order go to the host until ``ratio`` of the elements
    are there. ratio 1 offloads every unit, 0 none."""
    total = sum(unit_numels)
    off, dev, acc = [], [], 0
    for u, n in enumerate(unit_numels):
        if ratio >= 1.0 or (total > 0 and acc < ratio * total):
            off.append(u)
            acc += n
        else:
            dev.append(u)
    return off, dev


def total_elems(tiles: Sequence[Tile]) -> int:
    return sum(t.numel for t in tiles)
