"""Pure arithmetic of flat, padded, sharded parameter buffers (no process group, no tensors).

A *unit* flattens a list of parameters into one buffer: parameter i occupies ``[offset_i, offset_i +
numel_i)``. The buffer is padded so it splits into ``world`` equal chunks; rank r owns chunk r. A
parameter may straddle a chunk boundary: the part of it inside a rank's chunk is a :class:`Piece`.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import List, Sequence


@dataclass(frozen=True)
class Piece:
    """The part of parameter ``param_index`` that lies in one rank's chunk.

    ``param_start:param_end`` indexes the flattened parameter; ``chunk_start`` is where that part begins
    inside the rank's chunk.
    """

    param_index: int
    param_start: int
    param_end: int
    chunk_start: int

    @property
    def numel(self) -> int:
        return self.param_end - self.param_start


@dataclass(frozen=True)
class FlatLayout:
    """Offsets of ``numels`` in one flat buffer split into ``world`` equal chunks.

    ``align`` rounds each chunk up to a multiple of that many elements (e.g. for vectorised kernels).
    """

    numels: tuple
    world: int
    align: int = 1

    def __post_init__(self):
        if self.world < 1:
            raise ValueError(f"world must be >= 1, got {self.world}")
        if any(n < 0 for n in self.numels):
            raise ValueError("parameter sizes must be >= 0")

    @classmethod
    def of(cls, numels: Sequence[int], world: int, align: int = 1) -> FlatLayout:
        return cls(tuple(int(n) for n in numels), int(world), int(align))

    @property
    def offsets(self) -> List[int]:
        out, acc = [], 0
        for n in self.numels:
            out.append(acc)
            acc += n
        return out

    @property
    def numel(self) -> int:
        """Elements of real data (no padding)."""
        return sum(self.numels)

    @property
    def chunk_size(self) -> int:
        per_rank = -(-self.numel // self.world)  # ceil
        return -(-per_rank // self.align) * self.align

    @property
    def padded_numel(self) -> int:
        return self.chunk_size * self.world

    @property
    def padding(self) -> int:
        return self.padded_numel - self.numel

    def chunk_range(self, rank: int) -> tuple:
        return rank * self.chunk_size, (rank + 1) * self.chunk_size

    def pieces(self, rank: int) -> List[Piece]:
        """The parts of each parameter that fall inside ``rank``'s chunk, in buffer order."""
        lo, hi = self.chunk_range(rank)
        out = []
        for i, (off, n) in enumerate(zip(self.offsets, self.numels)):
            start, end = max(off, lo), min(off + n, hi)
            if start < end:
                out.append(Piece(i, start - off, end - off, start - lo))
        return out

    def owner_ranks(self, param_index: int) -> List[int]:
        """Ranks whose chunk holds part of parameter ``param_index``."""
        off, n = self.offsets[param_index], self.numels[param_index]
        if n == 0:
            return []
        cs = self.chunk_size
        return list(range(off // cs, (off + n - 1) // cs + 1))


def group_by_size(numels: Sequence[int], max_elements: int) -> List[List[int]]:
    """Split indices ``0..len-1`` (in order) into consecutive groups of at most ``max_elements`` elements.

    A single parameter larger than the limit gets a group of its own. Used to form gradient buckets.
    """
    if max_elements <= 0:
        raise ValueError(f"bucket size must be > 0, got {max_elements}")
    groups: List[List[int]] = []
    current: List[int] = []
    size = 0
    for i, n in enumerate(numels):
        if current and size + n > max_elements:
            groups.append(current)
            current, size = [], 0
        current.append(i)
        size += n
    if current:
        groups.append(current)
    return groups
