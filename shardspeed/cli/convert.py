"""``shardspeed convert``: DeepSpeed's checkpoints (ZeRO 0-3, or its universal layout) to ours, and ours to
DeepSpeed's layout for a given world size and stage (:mod:`shardspeed.checkpoint.deepspeed_layout`).
Both directions stream: one tensor (or one rank's partition) in memory at a time."""

from __future__ import annotations

import argparse
import json
import os
import sys


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("convert", help="convert checkpoints between DeepSpeed's layout and shardspeed's",
                       description="SRC holding a DeepSpeed checkpoint (its 'latest', or --tag) is written as a "
                                   "shardspeed checkpoint under DST; a shardspeed checkpoint is written in "
                                   "DeepSpeed's layout for --world ranks at ZeRO --stage (loads under deepspeed).")
    p.add_argument("src", help="the checkpoint directory to read (the one holding 'latest')")
    p.add_argument("dst", help="the directory to write the converted checkpoint into")
    p.add_argument("--tag", default=None, help="the tag to read (default: SRC/latest)")
    p.add_argument("--out-tag", default=None, help="the tag to write (default: the tag read)")
    p.add_argument("--world", type=int, default=None, help="to DeepSpeed: its data-parallel world size")
    p.add_argument("--stage", type=int, default=None, choices=[0, 1, 2, 3], help="to DeepSpeed: its ZeRO stage")
    p.add_argument("--dtype", default=None, choices=["fp32", "bf16", "fp16"],
                   help="to DeepSpeed: the dtype it will train in (default: the one saved)")
    p.add_argument("--ds-config", default=None,
                   help="to DeepSpeed: the JSON config it will run with (its fp16 loss-scale settings and ZeRO-3 "
                        "sub_group_size shape the files; default: DeepSpeed's defaults)")
    p.add_argument("--trust-pickles", action="store_true",
                   help="unpickle any class SRC's pickles name (client state of your own classes). Unpickling runs "
                        "whatever code the files name: only for checkpoints you trust (default: an allowlist of "
                        "plain types, anything else refused)")
    p.set_defaults(func=run_args)


def run_args(args: argparse.Namespace) -> int:
    from ..checkpoint.commit import check_tag, read_latest
    from ..checkpoint.deepspeed_layout import is_deepspeed_dir
    from ..checkpoint.deepspeed_layout.export import export_deepspeed
    from ..checkpoint.deepspeed_layout.to_ours import import_deepspeed
    from ..errors import CheckpointError

    try:
        tag = read_latest(args.src) if args.tag is None else check_tag(args.tag, where="--tag")
        if tag is None:
            raise CheckpointError(f"{args.src} has no 'latest' file; pass --tag")
        if args.out_tag is not None:
            check_tag(args.out_tag, where="--out-tag")
        if is_deepspeed_dir(os.path.join(args.src, tag)):
            if args.world is not None or args.stage is not None:
                raise CheckpointError("--world and --stage are for converting to DeepSpeed's layout; a shardspeed "
                                      "checkpoint loads at any world size and stage")
            out = import_deepspeed(args.src, args.dst, tag=tag, out_tag=args.out_tag,
                                   trust_pickles=args.trust_pickles)
        else:
            if args.world is None or args.stage is None:
                raise CheckpointError("converting a shardspeed checkpoint to DeepSpeed's layout needs --world and "
                                      "--stage (DeepSpeed loads only at the layout it was saved for)")
            ds_config = None
            if args.ds_config:
                with open(args.ds_config) as f:
                    ds_config = json.load(f)
            out = export_deepspeed(args.src, args.dst, args.world, args.stage, tag=tag, out_tag=args.out_tag,
                                   dtype=args.dtype, ds_config=ds_config, trust_pickles=args.trust_pickles)
    except (CheckpointError, OSError, json.JSONDecodeError) as exc:  # a --ds-config unreadable or not JSON
        print(f"shardspeed convert: error: {exc}", file=sys.stderr)
        return 1
    print(out)
    return 0
