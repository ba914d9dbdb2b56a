"""``shardspeed estimate`` with a model description: the per-rank peak table (called from shardspeed.cli)."""
from __future__ import annotations

import argparse
import json
from typing import Any, Dict

from ..errors import ConfigError
from .model import describe, read_json_config
from .table import OFFLOADS, format_rows, peak_rows, rows_json

_DTYPE_KEYS = {"bf16": {"bf16": {"enabled": True}}, "fp16": {"fp16": {"enabled": True}}, "fp32": {}}


def _base_config(args: argparse.Namespace) -> Dict[str, Any]:
    if args.config:
        base = read_json_config(args.config)
    else:
        base = dict(_DTYPE_KEYS[args.dtype])
    if args.micro_batch:
        base["train_micro_batch_size_per_gpu"] = args.micro_batch
        base.pop("train_batch_size", None)
    base.setdefault("train_micro_batch_size_per_gpu", base.get("train_micro_batch_size_per_gpu") or 1)
    return base


def wants_peak(args: argparse.Namespace) -> bool:
    """The peak table is printed when a micro-batch or a config is given, or the model is not a preset (a
    preset alone, or ``--params``, prints the model-state table)."""
    return bool(args.micro_batch or args.config or args.hf_config or (args.model and ":" in args.model))


def peak_command(args: argparse.Namespace) -> int:
    base = _base_config(args)
    mb = int(base["train_micro_batch_size_per_gpu"])
    if mb < 1 or (args.seq_len is not None and args.seq_len < 1):
        raise ConfigError("--micro-batch and --seq-len must be >= 1")
    source = args.hf_config or args.model or args.preset
    spec = describe(source, base, micro_batch=mb, seq_len=args.seq_len, checkpointing=args.checkpointing,
                    trace=not args.no_trace)
    stages = [args.stage] if args.stage is not None else [0, 1, 2, 3]
    offloads = OFFLOADS
    if args.offload_optimizer or args.offload_param:
        offloads = (("cpu", "cpu" if args.offload_param else "none"),)
    rows = peak_rows(spec, base, world_size=args.world, stages=stages, offloads=offloads, tp=args.tp, pp=args.pp,
                     micro_batch=mb, seq_len=args.seq_len, checkpointing=args.checkpointing,
                     zero_init=args.zero_init)
    if not rows:
        raise ConfigError(f"no stage/offload combination to estimate for stage {args.stage}")
    if args.json:
        print(json.dumps({"model": spec.name, "num_params": spec.num_params, "world_size": args.world,
                          "tp": args.tp, "pp": args.pp, "micro_batch": mb, "rows": rows_json(rows)}, indent=2,
                         default=str))
        return 0
    act = spec.activations
    how = (f"traced on fake tensors at micro-batch {act.micro_batch} x {act.seq_len} tokens" if act is not None
           else "Korthikanti formulas")
    print(f"Per-rank peak memory of a training step: {spec.name}, {spec.num_params:,} parameters, world "
          f"{args.world} (tp {args.tp}, pp {args.pp}), micro-batch {mb}"
          f"{', checkpointing' if args.checkpointing else ''}; activations {how}.")
    print("GB = 1e9 bytes, MB = 1e6. device: the training device; host: CPU memory (the same RAM on a CPU-only machine);"
          " nvme: files per rank.")
    print(format_rows(rows))
    return 0
