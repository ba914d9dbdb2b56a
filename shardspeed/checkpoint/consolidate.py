"""Export a sharded checkpoint as one fp32 state dict in safetensors files, split by size.

The output is what Hugging Face writes: ``model.safetensors``, or ``model-0000i-of-0000n.safetensors`` plus
``model.safetensors.index.json`` (``{"metadata": {"total_size": ...}, "weight_map": {name: file}}``). It
loads with ``model.load_state_dict(load_consolidated(out_dir))`` into the plain model: tied parameters are
written under each of their names. One tensor is in memory at a time (assembled from the ranks' pieces).

Also the ``shardspeed consolidate CKPT_DIR OUT [--tag T] [--max-shard-size 5GB]`` command: :func:`main`.
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import re
import sys
from types import MappingProxyType
from typing import Any, Dict, List, Optional, Sequence, Tuple, Union

import torch

from ..errors import CheckpointError
from ..utils.safe_files import replacing
from .commit import read_latest, resolve
from .format import NAME_TO_DTYPE, LazyTensor, ShardReader, fsync_dir, write_bytes_atomic, write_safetensors
from .metadata import METADATA_FILE, WEIGHT, CheckpointMetadata
from .metadata_checks import check_files, check_stored
from .ranges import EntryIndex, entries_for, read_range

logger = logging.getLogger("shardspeed")

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
_UNITS = MappingProxyType({"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12, "KIB": 2**10, "MIB": 2**20,
          "GIB": 2**30, "TIB": 2**40})


def parse_size(size: Union[int, str]) -> int:
    """``5GB`` (10^9, as Hugging Face counts), ``500MiB``, or a number of bytes."""
    if isinstance(size, int):
        return size
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([A-Za-z]*)\s*", str(size))
    if not m or m.group(2).upper() not in _UNITS:
        raise CheckpointError(f"cannot read the size {size!r}: write e.g. 5GB, 500MB, 2GiB or a number of bytes")
    return int(float(m.group(1)) * _UNITS[m.group(2).upper()])


def find_checkpoint(ckpt_dir: str, tag: Optional[str] = None) -> str:
    """A checkpoint directory itself, or a save directory (its ``latest`` unless ``tag`` is given)."""
    if tag is not None:
        return resolve(ckpt_dir, tag)
    if os.path.isfile(os.path.join(ckpt_dir, METADATA_FILE)):
        return ckpt_dir
    latest = read_latest(ckpt_dir)
    if latest is None:
        raise CheckpointError(f"{ckpt_dir} is neither a checkpoint (no {METADATA_FILE}) nor a save directory "
                              f"with a 'latest' file; pass the checkpoint's directory or tag=")
    return resolve(ckpt_dir, latest)


def _out_dtype(stored: torch.dtype) -> torch.dtype:
    return torch.float32 if stored.is_floating_point else stored


def _check_before_writing(meta: CheckpointMetadata, index: EntryIndex, reader: ShardReader, path: str) -> None:
    """Everything the export will read, before its first byte is written: every alias names a stored tensor,
    every tensor's weights are covered by entries whose stored tensors (their files' headers) match them in
    length and dtype (:func:`~.metadata_checks.check_stored`); with ``check_files``' bound on the tensor table, the
    output is no larger than what the checkpoint holds (in fp32)."""
    for alias, src in sorted(meta.aliases.items()):
        if src not in meta.tensors:
            raise CheckpointError(f"{os.path.join(path, METADATA_FILE)}: the tied name {alias!r} points at {src!r}, "
                                  f"which is not a saved tensor; the metadata is corrupt or crafted")
    for name, info in meta.tensors.items():
        check_stored(reader, entries_for(index, name, WEIGHT, 0, info.numel), meta.tensors)


def consolidate(ckpt_dir: str, out_dir: str, tag: Optional[str] = None, max_shard_size: Union[int, str] = "5GB",
                verify: bool = True) -> List[str]:
    """Write the checkpoint's model as fp32 safetensors in ``out_dir``; returns the files written."""
    path = find_checkpoint(ckpt_dir, tag)
    meta = CheckpointMetadata.read(path)
    check_files(meta, path)
    limit = parse_size(max_shard_size)
    reader = ShardReader(path, verify=verify, header_crc32=meta.header_crc32())
    index = EntryIndex(meta.entries, meta.shapes)  # shapes: tensor-parallel slices map into full tensors
    _check_before_writing(meta, index, reader, path)

    # every output name: the stored tensors, then tied names (a copy each: safetensors cannot alias)
    names: List[Tuple[str, str]] = [(n, n) for n in meta.tensors] + sorted(meta.aliases.items())
    plan: List[List[Tuple[str, str]]] = [[]]
    size = 0
    total = 0
    for out_name, src in names:
        info = meta.tensors[src]
        nbytes = info.numel * torch.empty((), dtype=_out_dtype(NAME_TO_DTYPE[info.dtype])).element_size()
        if plan[-1] and size + nbytes > limit:
            plan.append([])
            size = 0
        plan[-1].append((out_name, src))
        size += nbytes
        total += nbytes

    def lazy(src: str) -> LazyTensor:
        info = meta.tensors[src]
        dt = _out_dtype(NAME_TO_DTYPE[info.dtype])

        def make() -> torch.Tensor:
            flat = read_range(reader, index, src, WEIGHT, 0, info.numel, dtype=dt)
            return flat.view(info.shape)

        return LazyTensor(info.shape, dt, make)

    os.makedirs(out_dir, exist_ok=True)
    n = len(plan)
    files = [SINGLE_FILE] if n == 1 else [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
    weight_map: Dict[str, str] = {}
    for fname, group in zip(files, plan):
        items = [(out_name, lazy(src)) for out_name, src in group]
        # written in a private folder, then moved into place: a corrupt checkpoint or a full disk leaves no
        # half-written file behind, and a link planted in a shared out_dir is replaced, never written through
        with replacing(os.path.join(out_dir, fname), sync=False) as staged:  # (write_safetensors fsyncs)
            write_safetensors(staged, items, metadata={"format": "pt"})
        weight_map.update({out_name: fname for out_name, _ in group})
    if n > 1:
        index_json = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
        write_bytes_atomic(os.path.join(out_dir, INDEX_FILE), json.dumps(index_json, indent=2).encode())
    fsync_dir(out_dir)
    reader.close()
    logger.info("consolidated %s into %d file(s) in %s (%.1f MB)", path, n, out_dir, total / 2**20)
    return [os.path.join(out_dir, f) for f in files]


def fp32_state_dict(save_dir: str, tag: Optional[str] = None,
                    exclude_frozen_parameters: bool = False) -> Dict[str, torch.Tensor]:
    """The model of checkpoint ``save_dir/tag`` (``latest`` when ``tag`` is None) in memory, floating-point tensors
    in fp32 (the master copy of trained parameters), buffers included, tied names sharing one tensor: ours or
    DeepSpeed's (ZeRO 0-3, universal), as DeepSpeed's ``zero_to_fp32.get_fp32_state_dict_from_zero_checkpoint``
    gives it. ``exclude_frozen_parameters``: leave out parameters that were not trained."""
    from .deepspeed_layout import is_deepspeed_dir, open_deepspeed

    tag = tag if tag is not None else read_latest(save_dir)
    if tag is None:
        raise CheckpointError(f"{save_dir} has no 'latest' file; pass tag= (the checkpoint's folder name)")
    reader: Any
    if is_deepspeed_dir(os.path.join(save_dir, tag)):
        src = open_deepspeed(save_dir, tag)
        assert src is not None
        meta, reader = src.meta, src.reader
    else:
        path = resolve(save_dir, tag)
        meta = CheckpointMetadata.read(path)
        check_files(meta, path)
        reader = ShardReader(path, verify=True, header_crc32=meta.header_crc32())
    index = EntryIndex(meta.entries, meta.shapes)
    out: Dict[str, torch.Tensor] = {}
    for name, info in meta.tensors.items():
        if exclude_frozen_parameters and info.kind == "frozen":
            continue
        dt = _out_dtype(NAME_TO_DTYPE[info.dtype])
        out[name] = read_range(reader, index, name, WEIGHT, 0, info.numel, dtype=dt).view(info.shape)
    out.update({alias: out[src_name] for alias, src_name in sorted(meta.aliases.items()) if src_name in out})
    reader.close()
    return out


def load_consolidated(out_dir: str) -> Dict[str, torch.Tensor]:
    """The state dict written by :func:`consolidate` (reads the index when the model was split)."""
    from safetensors.torch import load_file

    index = os.path.join(out_dir, INDEX_FILE)
    if os.path.isfile(index):
        with open(index) as f:
            files = sorted(set(json.load(f)["weight_map"].values()))
    else:
        files = [SINGLE_FILE]
    out: Dict[str, torch.Tensor] = {}
    for fname in files:
        out.update(load_file(os.path.join(out_dir, fname)))
    return out


def build_parser(parser: Optional[argparse.ArgumentParser] = None) -> argparse.ArgumentParser:
    p = parser or argparse.ArgumentParser(prog="shardspeed consolidate",
                                          description="Export a sharded shardspeed checkpoint as fp32 safetensors.")
    p.add_argument("ckpt_dir", help="a checkpoint directory, or the save directory (uses its 'latest')")
    p.add_argument("out_dir", help="where to write model.safetensors (or shards plus an index)")
    p.add_argument("--tag", default=None, help="checkpoint tag inside ckpt_dir (default: latest)")
    p.add_argument("--max-shard-size", default="5GB", help="largest output file, e.g. 5GB, 500MB (default 5GB)")
    p.add_argument("--no-verify", action="store_true", help="skip the per-tensor CRC checks")
    return p


def main(argv: Optional[Sequence[str]] = None) -> int:
    return run_args(build_parser().parse_args(argv))


def run_args(args: argparse.Namespace) -> int:
    try:
        files = consolidate(args.ckpt_dir, args.out_dir, tag=args.tag, max_shard_size=args.max_shard_size,
                            verify=not args.no_verify)
    except (CheckpointError, OSError) as exc:
        print(f"shardspeed consolidate: error: {exc}", file=sys.stderr)
        return 1
    for f in files:
        print(f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
