"""The ``shardspeed`` command: ``run`` (torchrun), ``env``, ``estimate``, ``consolidate`` (a sharded
checkpoint to fp32 safetensors: :mod:`shardspeed.checkpoint.consolidate`), ``plot`` (the CSV monitor's
loss, LR and throughput into a PNG: :mod:`shardspeed.monitor.csv_plot`), ``autotune`` (search the config:
:mod:`shardspeed.autotune`; also ``shardspeed run --autotuning tune|run``, DeepSpeed's flag).

``convert`` (DeepSpeed's checkpoints to ours and back: :mod:`.convert`).

``shardspeed run [--nproc N] [torchrun options] script.py [script args]`` is a thin wrapper over
torchrun: it builds the argv of ``torch.distributed.run`` and calls its ``main``. Every torchrun option
passes through unchanged; ``--nproc`` is short for ``--nproc-per-node``, and a single-node job with no
rendezvous or master address given gets ``--standalone`` (a free port, so concurrent jobs on one machine
do not collide on torchrun's default port 29500). See :mod:`.run` for restarts, the bootstrap and
``--full-tracebacks``.

One module per subcommand, each registering its own arguments (``add_parser``): :mod:`.run`, :mod:`.env`,
:mod:`.estimate`, :mod:`.consolidate`, :mod:`.convert`, :mod:`.plot`, :mod:`.autotune`; :mod:`.args` holds the command line
``run`` and ``autotune`` share (torchrun's options, :func:`build_torchrun_argv`). This module dispatches:
``run`` and ``autotune`` before argparse (their arguments are torchrun's and the script's), and
``run --autotuning run`` through the tuner and then ``run`` again with the winner's arguments.
"""

from __future__ import annotations

import argparse
import sys
from typing import Sequence

from . import autotune, consolidate, convert, env, estimate, plot, run
from .args import UsageError, build_torchrun_argv
from .estimate import parse_count
from .run import _wrap_in_bootstrap as _wrap_in_bootstrap  # tests call it from here

__all__ = ["main", "UsageError", "build_torchrun_argv", "parse_count"]


def _cmd_run(argv: Sequence[str]) -> int:
    """``shardspeed run``: ``--autotuning tune|run`` goes to the tuner, the rest to torchrun."""
    try:
        mode, argv = run.split_autotuning(argv)
    except UsageError as e:
        print(f"shardspeed run: error: {e}", file=sys.stderr)
        return 2
    if mode is not None:
        return _autotune(argv, then_run=mode == "run")
    return run.launch_command(argv)


def _autotune(argv: Sequence[str], then_run: bool = False) -> int:
    """``shardspeed autotune`` (and ``run --autotuning``): tune, then optionally train with the winner."""
    status, results_dir = autotune.tune(argv)
    if status or not then_run or results_dir is None:
        return status
    return _cmd_run(autotune.optimal_run_argv(results_dir))


def _build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="shardspeed", description="ZeRO-sharded training for PyTorch, drop-in for DeepSpeed configs."
    )
    sub = parser.add_subparsers(dest="command", metavar="{run,env,estimate,autotune,consolidate,convert,plot,deepspeed-path}")
    for command in (run, env, estimate, consolidate, convert, plot, autotune):
        command.add_parser(sub)
    env.add_path_parser(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``shardspeed`` command; returns the exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "run":
        return _cmd_run(argv[1:])
    if argv and argv[0] == "autotune":
        return _autotune(argv[1:])
    parser = _build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 2
    return args.func(args)
