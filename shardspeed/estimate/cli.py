"""``shardspeed estimate`` with a model description: the per-rank peak table (called from shardspeed.cli)."""
from __future__ import annotations

import argparse
import json
from typing import Any, Dict

from ..errors import ConfigError
from .model import describe, read_json_config
from .planning import precision_keys
from .table import OFFLOADS, format_rows, peak_rows, rows_json


def _base_config(args: argparse.Namespace) -> Dict[str, Any]:
    if args.config:
        base = read_json_config(args.config)
    else:
        base = precision_keys(args.dtype)
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


def wants_long_context(args: argparse.Namespace) -> bool:
    """The long-context table is printed when a sequence-parallel degree, tiles or activation offload is given."""
    return bool(getattr(args, "sp", None) or getattr(args, "tiles", None) or getattr(args, "offload_activations", False))


def long_context_command(args: argparse.Namespace) -> int:
    """Per rank at ZeRO 3 over ``--world`` ranks (``--sp`` of them per sequence): the estimator's peak for one
    ``--seq-len`` sample (:func:`~.long_context.long_context_peak`: the long-context activations, ``--ring``,
    ``--tiles``, ``--offload-activations``, priced with the plan's model states, gathered units and buckets)."""
    from .long_context import long_context_peak

    if not args.seq_len:
        raise ConfigError("--sp/--tiles/--offload-activations need --seq-len (the tokens of one sample)")
    source = args.hf_config or args.model or args.preset
    sp, world, tiles = int(args.sp or 1), int(args.world), int(args.tiles or 1)
    if sp < 1 or world % sp:
        raise ConfigError(f"--sp {sp} must divide --world {world}")
    base = dict(_base_config(args))
    base["zero_optimization"] = dict(base.pop("zero_optimization", None) or {}, stage=3)  # the table is ZeRO 3's
    base["sequence_parallel_size"] = sp
    spec = describe(source, base, micro_batch=1, seq_len=args.seq_len, trace=False)
    e = 4 if args.dtype == "fp32" and not args.config else 2
    kv = int(getattr(args, "kv_heads", 0) or 0)
    est, act = long_context_peak(spec, base, world, args.seq_len, e, sp=sp, attention="ring" if args.ring else "ulysses",
                                 offload=args.offload_activations, mlp_tiles=tiles, loss_tiles=tiles, kv_heads=kv)
    terms = est.terms
    rows = {"model_states": sum(est.model_states.values()), "activations_device": act.device_peak,
            "activations_host": act.host_bytes,
            "stage3_buffers": sum(v for k, v in terms.items() if k.startswith(("gathered", "grad_buckets"))),
            "total": est.total}
    if args.json:
        print(json.dumps({"model": spec.name, "num_params": spec.num_params, "world_size": world, "sp": sp,
                          "seq_len": args.seq_len, "local_tokens": act.local_tokens, "phase": est.phase,
                          "bytes_per_rank": rows}, indent=2))
        return 0
    print(f"Long context per rank: {spec.name}, {spec.num_params:,} parameters, one sample of {args.seq_len:,} tokens "
          f"over SP {sp} ({act.local_tokens:,} tokens per rank), world {world}, ZeRO 3, checkpointing"
          f"{', ring attention' if args.ring else ''}{f', {tiles} tiles' if tiles > 1 else ''}"
          f"{', activations offloaded' if args.offload_activations else ''}; GB = 1e9 bytes; total: the peak "
          f"({est.phase}), model states as the optimizer step sees them")
    for k, v in rows.items():
        print(f"  {k:<20}{v / 1e9:>10.3f}")
    return 0


def moe_command(args: argparse.Namespace, total: int, expert: int) -> int:
    """``--params N --expert-params M [--ep EP]``: model states per rank by stage for a mixture of experts, and
    with ``--experts --hidden --tokens --moe-layers`` the capacity all-to-all bytes per step (DeepSpeed's layer)."""
    from .experts import moe_estimate

    shape = (args.experts, args.hidden, args.tokens, args.moe_layers)
    if any(v is not None for v in shape) and any(v is None for v in shape):
        raise ConfigError("the all-to-all needs all of --experts, --hidden, --tokens and --moe-layers")
    a2a = None
    if args.experts is not None:
        a2a = {"tokens": args.tokens, "hidden": args.hidden, "num_experts": args.experts, "k": args.top_k,
               "capacity_factor": args.capacity_factor, "layers": args.moe_layers,
               "dtype_bytes": 4 if args.dtype == "fp32" else 2}
    stages = [args.stage] if args.stage is not None else [0, 1, 2, 3]
    rows = moe_estimate(total, expert, args.world, args.ep, args.dtype, stages, a2a)
    if args.json:
        print(json.dumps({"num_params": total, "expert_params": expert, "world_size": args.world, "rows": rows},
                         indent=2))
        return 0
    print(f"Model-state memory per rank of a mixture of experts ({total:,} parameters, {expert:,} in experts), "
          f"world {args.world}, EP {args.ep}, {args.dtype}, Adam; GB = 1e9 bytes")
    print("{:<6}{:>5}{:>12}{:>10}{:>10}{:>10}{:>13}".format("stage", "EP", "expert-DP", "params", "grads", "optim",
                                                          "device/rank"))
    for r in rows:
        print("{:<6}{:>5}{:>12}{:>10.3f}{:>10.3f}{:>10.3f}{:>13.3f}".format(  # noqa: UP032 (a table row)
            r["stage"], r["ep"], r["expert_data"], r["params"] / 1e9, r["grads"] / 1e9, r["optimizer"] / 1e9,
            r["total"] / 1e9))
    if a2a is not None:
        print(f"all-to-all: {rows[0]['all_to_all_bytes_per_step']:,.0f} bytes sent per rank per step "
              f"({args.moe_layers} MoE layers, 4 exchanges each of experts x capacity x hidden, (EP-1)/EP leaving)")
    return 0
