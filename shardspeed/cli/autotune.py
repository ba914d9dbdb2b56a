"""``shardspeed autotune`` (and ``shardspeed run --autotuning tune|run``): search the config of a script
(:mod:`shardspeed.autotune`), write autotuning_results/, and say which command trains with the winner."""

from __future__ import annotations

import argparse
import os
import sys
from typing import Optional, Sequence, Tuple

from .args import UsageError, build_torchrun_argv, canonical_option, positive_int, take_options, torchrun_option_arity

_AUTOTUNE_USAGE = """\
usage: shardspeed autotune [--nproc N] [--model SRC [--seq-len T]] script.py --deepspeed_config cfg.json [args ...]
       shardspeed run --autotuning tune|run [--nproc N] [--model SRC] script.py --deepspeed_config cfg.json [...]

Search ZeRO stage, micro-batch x gradient accumulation (the global batch is kept), offload, activation
checkpointing and bucket sizes for script.py on N local ranks, reading the config's "autotuning" block
(DeepSpeed's keys plus device_memory_budget, host_memory_budget, wall_time_budget, trial_timeout). Writes
autotuning_results/ (one directory per trial, summary.txt, ds_config_optimal.json, cmd_optimal.txt).
`run` then trains with the best config. See docs/autotuning.md.

--model SRC describes the script's model without allocating it (as `shardspeed estimate` takes it: a GPT
preset, pkg.module:function, or a Hugging Face config.json): its shape adds the tensor-parallel degree to
the search and the activation formulas to the memory prior. --seq-len T: the tokens per sample the script
trains on (default: the model's positions).
"""


def _describe_for_tuning(source: str, script_args: Sequence[str], seq_len: int | None):
    """The model named by ``--model``, described on the meta device for the script's config."""
    from ..autotune.search import find_config_arg
    from ..estimate.model import describe, read_json_config

    cfg = {k: v for k, v in read_json_config(find_config_arg(script_args)[1]).items() if k != "autotuning"}
    return describe(source, cfg, seq_len=seq_len, trace=False)


def tune(argv: Sequence[str]) -> Tuple[int, Optional[str]]:
    """``shardspeed autotune``: search, print the summary; (exit status, the results directory when a
    candidate won, else None)."""
    if not argv or argv[0] in ("-h", "--help"):
        print(_AUTOTUNE_USAGE)
        return (0 if argv else 2), None
    from ..autotune.search import Tuner
    from ..errors import ShardspeedError

    try:
        opts, argv = take_options(argv, ("--model", "--seq-len"))
        torchrun_argv = build_torchrun_argv(argv)
        nproc, i = 1, 0
        while i < len(torchrun_argv) and torchrun_argv[i].startswith("-"):
            name, eq, value = torchrun_argv[i].partition("=")
            if canonical_option(name) in ("--nproc-per-node",):
                value = value if eq else torchrun_argv[i + 1]
                if not value.isdigit():
                    raise UsageError(f"--nproc must be a number of local ranks, got {value!r}")
                nproc = int(value)
            elif canonical_option(name) == "--nnodes" and (value if eq else torchrun_argv[i + 1]) not in ("1", "1:1"):
                raise UsageError("autotuning runs on one node: drop --nnodes")
            i += 1 if eq or torchrun_option_arity().get(name, 0) == 0 else 2
        script, script_args = torchrun_argv[i], torchrun_argv[i + 1:]
        seq_len = positive_int(opts["--seq-len"], "--seq-len") if "--seq-len" in opts else None
        spec = _describe_for_tuning(opts["--model"], script_args, seq_len) if "--model" in opts else None
        result = Tuner(script, list(script_args), nproc=nproc, model_spec=spec, seq_len=seq_len).run()
    except UsageError as e:
        print(f"shardspeed autotune: error: {e}", file=sys.stderr)
        return 2, None
    except ShardspeedError as e:
        print(f"shardspeed autotune: error: {e}", file=sys.stderr)
        return 2, None
    with open(os.path.join(result.results_dir, "summary.txt")) as f:
        print(f.read())
    if result.best is None:
        print("shardspeed autotune: no candidate ran successfully within the budget; see summary.txt",
              file=sys.stderr)
        return 1, None
    print(f"optimal config: {os.path.join(result.results_dir, 'ds_config_optimal.json')}")
    return 0, result.results_dir


def optimal_run_argv(results_dir: str) -> list[str]:
    """``shardspeed run``'s arguments of the winner (``cmd_optimal.txt``: ``python -m shardspeed.cli run ...``)."""
    import shlex

    with open(os.path.join(results_dir, "cmd_optimal.txt")) as f:
        cmd = shlex.split(f.read())
    run_at = cmd.index("run")  # python -m shardspeed.cli run ...
    return cmd[run_at + 1:]


def add_parser(sub: argparse._SubParsersAction) -> None:
    # `autotune` is dispatched before argparse too (its arguments are torchrun's and the script's).
    sub.add_parser("autotune", help="search ZeRO stage, micro-batch, offload and buckets (model-guided trials)",
                   add_help=False)
