"""``shardspeed consolidate``: a sharded checkpoint as fp32 safetensors (:mod:`shardspeed.checkpoint.consolidate`)."""

from __future__ import annotations

import argparse


def add_parser(sub: argparse._SubParsersAction) -> None:
    from ..checkpoint.consolidate import build_parser as _consolidate_parser, run_args as _consolidate_run

    p = sub.add_parser("consolidate", help="write a sharded checkpoint as one fp32 state dict (safetensors)",
                       description="Export a sharded shardspeed checkpoint as fp32 safetensors, split by size, "
                                   "with a Hugging Face style index; loads with model.load_state_dict.")
    _consolidate_parser(p)
    p.set_defaults(func=_consolidate_run)
