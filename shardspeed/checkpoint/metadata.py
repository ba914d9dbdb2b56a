"""The checkpoint's description, ``metadata.json``: its tensors, entries, files, checksum and versions.

Every stored tensor is an *entry*: a flat range ``[start, end)`` of one logical tensor (a parameter,
buffer, or one optimizer state of a parameter), held under ``key`` in ``file``. A loader at any world size
and ZeRO stage asks for the ranges it owns now and reassembles them from whichever entries overlap them:
this is what makes resharding need no conversion step (finding and reading those entries: :mod:`.ranges`).

Format version 2 adds, per entry, what tensor and pipeline parallelism will key on: ``layer`` (the global
layer index, :func:`layer_of`) and the entry's N-dimensional slice of the tensor's global shape
(``offsets`` and ``lengths`` per dimension, :func:`flat_range_to_box`; None when the flat range is not a
box). The flat range stays authoritative (docs/checkpoints.md). Version-1 checkpoints load: their entries
get the same derived fields when read.

Format version 3 makes every byte a load uses checked before use: ``metadata.json`` carries ``checksum``,
the SHA-256 of its own canonical body (:func:`canonical_body`), and each file's record carries
``header_crc32``, the CRC-32 of its safetensors length prefix and header. Versions 1 and 2 (which have
neither) still load, with a warning once per process.

Format version 4 adds, per entry, ``tp``: ``[dim, blocks, rank, size]`` when the entry holds a range of a
tensor-parallel rank's *slice* of the tensor (:mod:`.slices`; ``start``/``end`` then count in the slice and
``offsets``/``lengths`` give its box in the full tensor), None otherwise. Versions 1-3 have no such entries
and load unchanged.
"""
from __future__ import annotations

import functools
import hashlib
import json
import logging
import math
import os
from dataclasses import asdict, dataclass, field
from typing import Any, Dict, List, Optional, Sequence, Tuple

from ..errors import CheckpointError
from .slices import Spec, local_box_to_full, local_shape

FORMAT = "shardspeed.checkpoint"
VERSION = 4  # 4: tensor-parallel slices (Entry.tp); 3: metadata checksum, header CRCs; 2: entries carry layer, offsets, lengths; 1 and 2 still load
CHECKSUM_VERSION = 3  # the first version whose metadata.json must carry its checksum
METADATA_FILE = "metadata.json"
COMMON_FILE = "common.pt"
WEIGHT = ""  # the state name of a parameter's (or buffer's) value; optimizer states use their own key


logger = logging.getLogger("shardspeed")


@functools.lru_cache(maxsize=64)
def _warn_unverified(where: str, version: int) -> None:
    """Warn that ``where`` (format ``version``) has no checksums of its metadata and headers: once per file and
    version (``lru_cache`` is the log-once: a repeated call returns without logging)."""
    logger.warning("%s has format version %s, written before checksums of the metadata and file headers: those "
                   "are not verified (tensor data and common.pt are); save again to get format %d",
                   where, version, VERSION)


def canonical_body(d: Dict[str, Any]) -> bytes:
    """The bytes the metadata checksum covers: the parsed JSON without its ``checksum`` key, re-serialised
    with sorted keys and no spaces. Checking the parsed content (not the raw file) means any flipped byte
    that changes what a load would use (a digit of a number, a character of a name) changes this body;
    one that changes nothing (``e`` to ``E`` in an exponent) is harmless."""
    body = {k: v for k, v in d.items() if k != "checksum"}
    return json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=True).encode()


def metadata_checksum(d: Dict[str, Any]) -> str:
    return "sha256:" + hashlib.sha256(canonical_body(d)).hexdigest()


def rank_file(rank: int) -> str:
    return f"rank{rank:05d}.safetensors"


@dataclass
class TensorInfo:
    shape: List[int]
    dtype: str  # of the stored weights (fp32 for trainable parameters: their master copy)
    kind: str  # "param" (trained, sharded), "frozen" (parameter outside the optimizer), "buffer"

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= int(s)
        return n


@dataclass
class Entry:
    tensor: str
    state: str  # WEIGHT or an optimizer state key ("exp_avg", "step", ...)
    start: int
    end: int
    file: str
    key: str
    crc32: Optional[int] = None
    elementwise: bool = True  # False: a per-parameter value (e.g. Adam's step) valid for the whole range
    value: Any = None  # a non-tensor state value, stored here instead of in a file (file == "")
    layer: Optional[int] = None  # global layer index of the tensor (layer_of); None: not in a layer stack
    offsets: Optional[List[int]] = None  # the N-D slice [offsets, offsets + lengths) of the tensor's global
    lengths: Optional[List[int]] = None  # shape holding exactly [start, end); None when that range is no box
    tp: Optional[List[int]] = None  # [dim, blocks, rank, size]: the range is of this tensor-parallel slice

    @property
    def spec(self) -> Spec:
        return None if self.tp is None else (self.tp[0], self.tp[1], self.tp[2], self.tp[3])

    def locate(self, shape: Sequence[int]) -> None:
        """Fill ``layer`` and the N-D slice from the name and the tensor's global ``shape``."""
        self.layer = layer_of(self.tensor)
        box = flat_range_to_box(local_shape(shape, self.spec), self.start, self.end)
        if box is not None:
            box = local_box_to_full(shape, self.spec, *box)
        self.offsets, self.lengths = box if box is not None else (None, None)

    def to_json(self) -> list:
        return [self.tensor, self.state, self.start, self.end, self.file, self.key, self.crc32,
                int(self.elementwise), self.value, self.layer, self.offsets, self.lengths] + (
                    [] if self.tp is None else [self.tp])

    @classmethod
    def from_json(cls, x: list) -> Entry:
        """A version-2 entry (12 fields) or a version-1 one (9 fields: no layer or N-D slice)."""
        if not all(isinstance(x[i], str) for i in (0, 1, 4, 5)):
            raise TypeError(f"an entry's tensor, state, file and key must be strings: {x[:6]!r}")
        e = cls(x[0], x[1], int(x[2]), int(x[3]), x[4], x[5], x[6], bool(x[7]), x[8])
        if len(x) >= 12:
            e.layer = None if x[9] is None else int(x[9])
            e.offsets = None if x[10] is None else [int(v) for v in x[10]]
            e.lengths = None if x[11] is None else [int(v) for v in x[11]]
        if len(x) >= 13 and x[12] is not None:  # version 4: a tensor-parallel slice
            e.tp = [int(v) for v in x[12]]
        return e


def layer_of(name: str) -> Optional[int]:
    """The global layer index of a tensor: the first dotted component of its name that is an integer (the
    index in the first ``ModuleList``/``Sequential`` on its path: ``layers.3.attn.weight`` → 3,
    ``h.0.mlp.c_fc.weight`` → 0); None when there is none (embeddings, a final norm). With pipeline stages
    this is the index in the whole model, not in the stage."""
    for part in name.split("."):
        if part.isdigit():
            return int(part)
    return None


def flat_range_to_box(shape: Sequence[int], start: int, end: int) -> Optional[Tuple[List[int], List[int]]]:
    """``(offsets, lengths)`` of the N-D slice of a tensor of ``shape`` whose elements are exactly the flat
    (row-major) range ``[start, end)``, or None when the range is not such a box (it starts or ends inside a
    row and spans more than one row). A whole tensor is ``([0, ...], shape)``. Pure arithmetic.

    The range is a box iff, at the outermost dimension ``k`` to whose stride (the product of the dimensions
    after ``k``) both ends are aligned, it does not cross an index of dimension ``k - 1``."""
    dims = [int(d) for d in shape]
    numel = math.prod(dims)
    if not 0 <= start <= end <= numel:
        return None
    if start == 0 and end == numel:
        return [0] * len(dims), dims
    if start == end:
        return None
    strides = [math.prod(dims[k + 1 :]) for k in range(len(dims))]
    for k, stride in enumerate(strides):
        if start % stride or end % stride:
            continue
        lo, hi = start // stride, end // stride  # in rows of dimension k
        if lo // dims[k] != (hi - 1) // dims[k]:
            return None  # the rows run across an index of an outer dimension
        offsets = [(start // strides[j]) % dims[j] for j in range(len(dims))]
        return offsets, [1] * k + [hi - lo] + dims[k + 1 :]
    return None


@dataclass
class FileInfo:
    rank: int
    bytes: int
    crc32: int  # of the whole file (common.pt: checked on every load; rank files: per tensor, see Entry)
    header_crc32: Optional[int] = None  # safetensors files, format 3: of the length prefix and JSON header


@dataclass
class CheckpointMetadata:
    tag: str
    world_size: int
    zero_stage: int
    train_dtype: str
    tensors: Dict[str, TensorInfo]
    aliases: Dict[str, str]  # tied parameter name -> the name it is stored under
    entries: List[Entry]
    files: Dict[str, FileInfo]
    optimizer: Optional[Dict[str, Any]] = None  # {"class": name, "param_groups": {group index: hyper}}
    rng: Dict[str, Any] = field(default_factory=dict)  # rank -> python/numpy RNG states (torch's are tensors)
    format: str = FORMAT
    version: int = VERSION

    # ---- (de)serialisation ----
    def to_json(self) -> str:
        d = {
            "format": self.format, "version": self.version, "tag": self.tag, "world_size": self.world_size,
            "zero_stage": self.zero_stage, "train_dtype": self.train_dtype,
            "tensors": {k: asdict(v) for k, v in self.tensors.items()}, "aliases": self.aliases,
            "files": {k: asdict(v) for k, v in self.files.items()}, "optimizer": self.optimizer, "rng": self.rng,
            "entries": [e.to_json() for e in self.entries],
        }
        d = json.loads(json.dumps(d))  # as a reader will parse it (tuples become lists, ...)
        d["checksum"] = metadata_checksum(d)
        return json.dumps(d, separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str, where: str = "") -> CheckpointMetadata:
        try:
            d = json.loads(text)
        except ValueError as exc:
            raise CheckpointError(f"{where}: metadata is not valid JSON ({exc}); the file is truncated or corrupt") from exc
        if not isinstance(d, dict):
            raise CheckpointError(f"{where}: metadata is not a JSON object; the file is corrupt")
        if "checksum" in d:  # checked before anything in it is used
            got = metadata_checksum(d)
            if got != d["checksum"]:
                raise CheckpointError(f"{where} fails its checksum ({got}, recorded {str(d['checksum'])[:80]}); "
                                      f"the file is corrupt")
        try:
            version = int(d.get("version", 0))
        except (TypeError, ValueError):
            raise CheckpointError(f"{where}: metadata has no valid format version; the file is corrupt") from None
        if version > VERSION and d.get("format") == FORMAT:
            raise CheckpointError(f"{where} has format version {version}; this shardspeed reads up to {VERSION}: "
                                  f"upgrade shardspeed")
        if "checksum" not in d and version >= CHECKSUM_VERSION:
            raise CheckpointError(f"{where} has format version {version} but no checksum; the file is corrupt")
        if "checksum" not in d and d.get("format") == FORMAT and version <= VERSION:
            _warn_unverified(where, version)
        if d.get("format") != FORMAT:
            raise CheckpointError(f"{where} is not a shardspeed checkpoint (format {d.get('format')!r})")
        if int(d.get("version", 0)) > VERSION:
            raise CheckpointError(f"{where} has format version {d['version']}; this shardspeed reads up to {VERSION}: "
                                  f"upgrade shardspeed")
        try:
            return cls._from_dict(d)
        except (KeyError, TypeError, ValueError, AttributeError, IndexError) as exc:
            raise CheckpointError(f"{where}: metadata is malformed ({type(exc).__name__}: {exc})") from exc

    @classmethod
    def _from_dict(cls, d: Dict[str, Any]) -> CheckpointMetadata:
        meta = cls(
            tag=d["tag"], world_size=int(d["world_size"]), zero_stage=int(d["zero_stage"]), train_dtype=d["train_dtype"],
            tensors={k: TensorInfo(**v) for k, v in d["tensors"].items()}, aliases=dict(d.get("aliases", {})),
            entries=[Entry.from_json(e) for e in d["entries"]],
            files={k: FileInfo(**v) for k, v in d["files"].items()}, optimizer=d.get("optimizer"),
            rng=d.get("rng", {}), format=d["format"], version=int(d["version"]),
        )
        if meta.version < 2:  # version 1: derive layer and N-D slice as a version-2 save records them
            meta.locate_entries()
        return meta

    @property
    def shapes(self) -> Dict[str, List[int]]:
        return {n: info.shape for n, info in self.tensors.items()}

    def locate_entries(self) -> None:
        """Fill every entry's layer index and N-D slice from the tensor table."""
        for e in self.entries:
            info = self.tensors.get(e.tensor)
            if info is not None:
                e.locate(info.shape)

    @classmethod
    def read(cls, ckpt_dir: str) -> CheckpointMetadata:
        path = os.path.join(ckpt_dir, METADATA_FILE)
        if not os.path.isfile(path):
            raise CheckpointError(f"{path} is missing: {ckpt_dir} is not a complete shardspeed checkpoint")
        with open(path, "rb") as f:
            raw = f.read()
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise CheckpointError(f"{path}: metadata is not valid UTF-8 ({exc}); the file is corrupt") from exc
        return cls.from_json(text, path)

    def header_crc32(self) -> Dict[str, Optional[int]]:
        """Per file, the recorded CRC-32 of its safetensors header (None before format 3)."""
        return {name: info.header_crc32 for name, info in self.files.items()}
