"""``shardspeed estimate``: per-rank memory, the ZeRO paper's model states (``--params``, a preset) or the
training peak of a described model (:mod:`shardspeed.estimate.cli`)."""

from __future__ import annotations

import argparse
import json
import re
import sys
from types import MappingProxyType

_SUFFIXES = MappingProxyType({"": 1, "k": 1e3, "m": 1e6, "b": 1e9, "g": 1e9, "t": 1e12})


def parse_count(text: str) -> int:
    """``"1.3B"``, ``"125M"``, ``"7.5e9"``, ``"350000"`` → an int. Raises ValueError."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([kKmMbBgGtT]?)\s*", text)
    if not m:
        raise ValueError(f"not a parameter count: {text!r} (e.g. 1.3B, 125M, 7.5e9)")
    return int(round(float(m.group(1)) * _SUFFIXES[m.group(2).lower()]))


def _cmd_estimate(args: argparse.Namespace) -> int:
    from shardspeed.errors import ConfigError
    from shardspeed.memory_estimate import estimate_model_state_memory

    if args.params is None:
        from shardspeed.estimate.cli import long_context_command, peak_command, wants_long_context, wants_peak

        try:
            if wants_long_context(args):
                return long_context_command(args)
            if wants_peak(args):
                return peak_command(args)
        except ConfigError as e:
            print(f"shardspeed estimate: error: {e}", file=sys.stderr)
            return 2
    if args.params is not None:
        try:
            n = parse_count(args.params)
        except ValueError as e:
            print(f"shardspeed estimate: error: {e}", file=sys.stderr)
            return 2
        source = f"{n:,} parameters"
        if args.expert_params is not None:
            from shardspeed.estimate.cli import moe_command

            try:
                return moe_command(args, n, parse_count(args.expert_params))
            except (ConfigError, ValueError) as e:
                print(f"shardspeed estimate: error: {e}", file=sys.stderr)
                return 2
    else:
        import torch

        from shardspeed.models import GPT, GPTConfig

        try:
            cfg = GPTConfig.preset(args.model or args.preset)
        except ValueError as e:
            print(f"shardspeed estimate: error: {e}", file=sys.stderr)
            return 2
        with torch.device("meta"):  # shapes only, no memory
            n = GPT(cfg).num_params()
        source = f"GPT preset {args.model or args.preset!r}: {n:,} parameters"
    stages = [args.stage] if args.stage is not None else [0, 1, 2, 3]
    rows = []
    try:
        for s in stages:
            if args.stage is None:  # the table of all stages: offload wherever the stage allows it
                oo, op = args.offload_optimizer and s >= 1, args.offload_param and s == 3
            else:  # one stage asked for: an impossible combination is an error
                oo, op = args.offload_optimizer, args.offload_param
            rows.append((s, oo, op, estimate_model_state_memory(n, args.world, s, args.dtype, oo, op)))
    except ConfigError as e:
        print(f"shardspeed estimate: error: {e}", file=sys.stderr)
        return 2

    if args.json:
        print(json.dumps([
            {"stage": s, "world_size": args.world, "dtype": args.dtype, "num_params": n,
             "offload_optimizer": oo, "offload_param": op,
             "params_device": m.params_device, "grads_device": m.grads_device,
             "optimizer_device": m.optimizer_device, "params_host": m.params_host,
             "optimizer_host": m.optimizer_host, "device": m.device, "host": m.host}
            for s, oo, op, m in rows], indent=2))
        return 0

    gb = 1e9
    print(f"Model-state memory per rank ({source}, {args.world} data-parallel ranks, {args.dtype}, Adam)")
    print("GB = 1e9 bytes; activations, buffers and fragmentation come on top.")
    header = ("stage", "offload", "params", "grads", "optim", "device/rank", "host/rank")
    print("{:<6}{:<12}{:>10}{:>10}{:>10}{:>13}{:>12}".format(*header))
    for s, oo, op, m in rows:
        offload = "+".join(x for x, on in (("optim", oo), ("param", op)) if on) or "-"
        print("{:<6}{:<12}{:>10.2f}{:>10.2f}{:>10.2f}{:>13.2f}{:>12.2f}".format(  # noqa: UP032 (a table row)
            s, offload, (m.params_device + m.params_host) / gb, (m.grads_device + m.grads_host) / gb,
            (m.optimizer_device + m.optimizer_host) / gb, m.device / gb, m.host / gb))
    return 0


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("estimate", help="per-rank memory: model states, or the training peak with activations",
                       description="Without --micro-batch: model states per rank for each ZeRO stage. With "
                                   "--micro-batch (or a --config that sets train_micro_batch_size_per_gpu): the "
                                   "per-rank PEAK of a training step (model states, gradient buckets, stage-3 "
                                   "gathered units, activations traced on fake tensors, start-up) by stage x "
                                   "offload. Nothing is allocated: models are built on the meta device.")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--params", help="number of parameters, e.g. 1.3B, 125M, 7.5e9 (model states only)")
    src.add_argument("--model", help="a GPT preset (tiny, small, gpt2-50m, gpt2-1.3b) or a factory pkg.module:function")
    src.add_argument("--preset", help="a GPT preset: tiny, small, gpt2-50m, gpt2-1.3b")
    src.add_argument("--hf-config", help="a Hugging Face config.json (or its directory); needs transformers")
    p.add_argument("--config", help="a DeepSpeed/shardspeed JSON config: its precision, ZeRO and offload settings, "
                                    "buckets and micro-batch are used (stage and offload vary over the table)")
    p.add_argument("--world", type=int, default=1, help="ranks (default 1)")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel degree (default 1)")
    p.add_argument("--pp", type=int, default=1, help="pipeline stages (default 1)")
    p.add_argument("--stage", type=int, choices=[0, 1, 2, 3], help="one ZeRO stage (default: all)")
    p.add_argument("--dtype", choices=["bf16", "fp16", "fp32"], default="bf16",
                   help="training dtype when no --config says (default bf16)")
    p.add_argument("--micro-batch", type=int, help="samples per rank per micro-step: estimate the training peak")
    p.add_argument("--seq-len", type=int, help="tokens per sample (default: the model's positions)")
    p.add_argument("--checkpointing", action="store_true", help="activation checkpointing of every block")
    p.add_argument("--zero-init", action="store_true", help="the model is built under shardspeed.zero.Init")
    p.add_argument("--no-trace", action="store_true", help="activations from the formulas, not a traced step")
    p.add_argument("--offload-optimizer", action="store_true", help="optimizer states in host memory")
    p.add_argument("--offload-param", action="store_true", help="parameters in host memory (stage 3)")
    p.add_argument("--sp", type=int, help="sequence-parallel degree: per-rank long-context memory (needs --seq-len)")
    p.add_argument("--ring", action="store_true", help="with --sp: ring attention instead of Ulysses")
    p.add_argument("--kv-heads", type=int, help="with --sp: key/value heads (GQA; default: the attention heads)")
    p.add_argument("--tiles", type=int, help="tiled MLP and fused loss with this many sequence tiles")
    p.add_argument("--offload-activations", action="store_true", help="checkpointed activations in host memory")
    moe = p.add_argument_group("mixture of experts (with --params)")
    moe.add_argument("--expert-params", help="the experts' share of --params (all experts): model states per rank "
                                             "by stage at --ep")
    moe.add_argument("--ep", type=int, default=1, help="expert-parallel size (divides --world; default 1)")
    moe.add_argument("--experts", type=int, help="experts per MoE layer (with --hidden, --tokens, --moe-layers: the "
                                                 "all-to-all bytes per step)")
    moe.add_argument("--hidden", type=int, help="the MoE layers' hidden size")
    moe.add_argument("--tokens", type=int, help="tokens per rank per MoE layer call (micro-batch x sequence)")
    moe.add_argument("--moe-layers", type=int, help="MoE layers in the model")
    moe.add_argument("--top-k", type=int, default=1, help="experts per token (default 1)")
    moe.add_argument("--capacity-factor", type=float, default=1.0, help="capacity factor (default 1.0)")
    p.add_argument("--json", action="store_true", help="print bytes as JSON instead of a table")
    p.set_defaults(func=_cmd_estimate)
