"""The ``shardspeed`` command: ``run`` (torchrun), ``env``, ``estimate``, ``consolidate`` (a sharded
checkpoint to fp32 safetensors: :mod:`shardspeed.checkpoint.consolidate`), ``plot`` (the CSV monitor's
loss, LR and throughput into a PNG: :mod:`shardspeed.monitor.csv_plot`), ``autotune`` (search the config:
:mod:`shardspeed.autotune`; also ``shardspeed run --autotuning tune|run``, DeepSpeed's flag).

``shardspeed run [--nproc N] [torchrun options] script.py [script args]`` is a thin wrapper over
torchrun: it builds the argv of ``torch.distributed.run`` and calls its ``main``. Every torchrun option
passes through unchanged; ``--nproc`` is short for ``--nproc-per-node``, and a single-node job with no
rendezvous or master address given gets ``--standalone`` (a free port, so concurrent jobs on one machine
do not collide on torchrun's default port 29500). With ``--max-restarts`` > 0 it also sets
``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` (unless set): see :func:`_isolate_restarts`. The script runs
under :mod:`shardspeed.bootstrap`, which records a ShardspeedError instead of printing it on every rank;
the launcher prints one line per distinct error (:func:`_launch`). ``--full-tracebacks`` (or
``SHARDSPEED_TRACEBACK=1``) runs the script directly, as torchrun alone would.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import platform
import re
import sys
from typing import Sequence

_RUN_USAGE = """\
usage: shardspeed run [--nproc N] [--nnodes N] [--node-rank R] [--master-addr A] [--master-port P]
                      [--rdzv-endpoint H:P] [--max-restarts K] [--full-tracebacks] [other torchrun options]
                      [--] script.py [script args ...]

Launch script.py on N processes per node with torchrun (torch.distributed.run). Any torchrun option
is accepted before the script; everything after the script goes to the script. On a single node with
no --master-addr/--master-port/--rdzv-endpoint, --standalone is added (a free port is chosen).

A shardspeed error (ConfigError, ...) that stops the workers is printed once per distinct message, with
the number of ranks that raised it, and the tracebacks go to a log file whose path is printed; other
exceptions print their tracebacks as usual. --full-tracebacks (or SHARDSPEED_TRACEBACK=1): every rank
prints its own traceback, as under torchrun.
"""

# Options that mean the user chose the rendezvous themselves: then --standalone is not added.
_RENDEZVOUS_OPTIONS = {
    "--standalone",
    "--rdzv-endpoint",
    "--rdzv-backend",
    "--master-addr",
    "--master-port",
    "--node-rank",
}


class UsageError(ValueError):
    """A command line that cannot be turned into a torchrun command line."""


def _torchrun_option_arity() -> dict[str, int]:
    """Every option string torchrun accepts → how many values follow it (0 or 1)."""
    from torch.distributed.run import get_args_parser

    arity: dict[str, int] = {}
    for action in get_args_parser()._actions:  # argparse keeps no public list of its actions
        for opt in action.option_strings:
            arity[opt] = 0 if action.nargs == 0 else 1
    return arity


def _canonical(option: str) -> str:
    """``--nproc_per_node`` → ``--nproc-per-node`` (torchrun accepts both spellings)."""
    return "--" + option[2:].replace("_", "-") if option.startswith("--") else option


def build_torchrun_argv(argv: Sequence[str]) -> list[str]:
    """Turn ``shardspeed run``'s arguments into the argv for ``torch.distributed.run.main``.

    ``--nproc N`` becomes ``--nproc-per-node N``; other torchrun options are passed through as given;
    ``--`` may separate the options from the script; the script and its arguments follow unchanged.
    ``--standalone`` is added when the job is single-node and no rendezvous/master was given.
    Raises ``UsageError`` for an unknown option, an option missing its value, or no script.
    """
    arity = _torchrun_option_arity()
    arity["--nproc"] = 1
    head: list[str] = []
    seen: set[str] = set()
    nnodes: str | None = None
    i = 0
    args = list(argv)
    while i < len(args):
        tok = args[i]
        if tok == "--":
            i += 1
            break
        if not tok.startswith("-") or tok == "-":
            break  # the script
        if tok.startswith("--"):
            name, eq, value = tok.partition("=")
        elif len(tok) > 2:  # "-r3": short option with its value attached
            name, eq, value = tok[:2], "=", tok[2:]
        else:
            name, eq, value = tok, "", ""
        if name not in arity:
            raise UsageError(f"unknown torchrun option {name!r}; see `shardspeed run --help`")
        out_name = "--nproc-per-node" if name == "--nproc" else name
        seen.add(_canonical(out_name))
        if arity[name] == 0:
            if eq:
                raise UsageError(f"option {name} takes no value")
            head.append(out_name)
            i += 1
            continue
        if not eq:
            if i + 1 >= len(args):
                raise UsageError(f"option {name} needs a value")
            value = args[i + 1]
            i += 2
        else:
            i += 1
        if _canonical(name) == "--nnodes":
            nnodes = value
        head += [out_name, value]
    if i >= len(args):
        raise UsageError("no script given: shardspeed run [options] script.py [script args]")
    script, script_args = args[i], args[i + 1 :]
    single_node = nnodes is None or nnodes in ("1", "1:1")
    if single_node and not (seen & _RENDEZVOUS_OPTIONS):
        head.insert(0, "--standalone")
    return head + [script] + script_args


def _isolate_restarts(torchrun_argv: Sequence[str]) -> None:
    """Give every restarted worker group a store of its own.

    torch >= 2.5 shares the c10d rendezvous TCPStore with the workers (``env://`` connects to the agent's
    store) and never clears it between restarts; the process group's keys carry no attempt number, so a
    restarted gloo group can read the dead group's addresses ("Gloo connectFullMesh failed ... Connection
    refused" on every rank, about one restart in two here; pytorch/pytorch#135712 for NCCL).
    ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` makes rank 0 host a fresh store for each attempt, as torchrun
    did before 2.5. Only when restarts were asked for; an explicit setting in the environment wins.
    """
    arity, restarts, i = _torchrun_option_arity(), 0, 0
    while i < len(torchrun_argv) and torchrun_argv[i].startswith("-"):  # torchrun's options, then the script
        name, eq, value = torchrun_argv[i].partition("=")
        takes_value = not eq and arity.get(name, 0) == 1
        if _canonical(name) == "--max-restarts":
            value = torchrun_argv[i + 1] if takes_value and i + 1 < len(torchrun_argv) else value
            restarts = int(value) if value.isdigit() else 0
        i += 2 if takes_value else 1
    if restarts > 0:
        os.environ.setdefault("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")


def _take_options(argv: Sequence[str], names: Sequence[str]) -> tuple[dict[str, str], list[str]]:
    """Our own ``--name value`` options (before the script, among torchrun's) taken out of the arguments."""
    args, found, i = list(argv), {}, 0
    arity = {**_torchrun_option_arity(), "--nproc": 1}
    while i < len(args) and args[i].startswith("-") and args[i] != "--":
        name, eq, value = args[i].partition("=")
        if name in names:
            if not eq:
                if i + 1 >= len(args):
                    raise UsageError(f"{name} needs a value")
                value = args.pop(i + 1)
            args.pop(i)
            found[name] = value
            continue
        i += 1 if eq or arity.get(name, 0) == 0 else 2
    return found, args


def _split_autotuning(argv: Sequence[str]) -> tuple[str | None, list[str]]:
    """``--autotuning tune|run`` (before the script) taken out of ``shardspeed run``'s arguments."""
    found, args = _take_options(argv, ("--autotuning",))
    mode = found.get("--autotuning")
    if mode is not None and mode not in ("tune", "run"):
        raise UsageError(f"--autotuning must be tune or run, got {mode!r}")
    return mode, args


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


def _positive_int(value: str, flag: str) -> int:
    if not value.isdigit() or int(value) < 1:
        raise UsageError(f"{flag} must be a positive number, got {value!r}")
    return int(value)


def _describe_for_tuning(source: str, script_args: Sequence[str], seq_len: int | None):
    """The model named by ``--model``, described on the meta device for the script's config."""
    from ..autotune.search import find_config_arg
    from ..estimate.model import describe, read_json_config

    cfg = {k: v for k, v in read_json_config(find_config_arg(script_args)[1]).items() if k != "autotuning"}
    return describe(source, cfg, seq_len=seq_len, trace=False)


def _autotune(argv: Sequence[str], then_run: bool = False) -> int:
    """``shardspeed autotune`` (and ``run --autotuning``): tune, then optionally train with the winner."""
    if not argv or argv[0] in ("-h", "--help"):
        print(_AUTOTUNE_USAGE)
        return 0 if argv else 2
    from ..autotune.search import Tuner
    from ..errors import ShardspeedError

    try:
        opts, argv = _take_options(argv, ("--model", "--seq-len"))
        torchrun_argv = build_torchrun_argv(argv)
        nproc, i = 1, 0
        while i < len(torchrun_argv) and torchrun_argv[i].startswith("-"):
            name, eq, value = torchrun_argv[i].partition("=")
            if _canonical(name) in ("--nproc-per-node",):
                value = value if eq else torchrun_argv[i + 1]
                if not value.isdigit():
                    raise UsageError(f"--nproc must be a number of local ranks, got {value!r}")
                nproc = int(value)
            elif _canonical(name) == "--nnodes" and (value if eq else torchrun_argv[i + 1]) not in ("1", "1:1"):
                raise UsageError("autotuning runs on one node: drop --nnodes")
            i += 1 if eq or _torchrun_option_arity().get(name, 0) == 0 else 2
        script, script_args = torchrun_argv[i], torchrun_argv[i + 1:]
        seq_len = _positive_int(opts["--seq-len"], "--seq-len") if "--seq-len" in opts else None
        spec = _describe_for_tuning(opts["--model"], script_args, seq_len) if "--model" in opts else None
        result = Tuner(script, list(script_args), nproc=nproc, model_spec=spec, seq_len=seq_len).run()
    except UsageError as e:
        print(f"shardspeed autotune: error: {e}", file=sys.stderr)
        return 2
    except ShardspeedError as e:
        print(f"shardspeed autotune: error: {e}", file=sys.stderr)
        return 2
    with open(os.path.join(result.results_dir, "summary.txt")) as f:
        print(f.read())
    if result.best is None:
        print("shardspeed autotune: no candidate ran successfully within the budget; see summary.txt",
              file=sys.stderr)
        return 1
    print(f"optimal config: {os.path.join(result.results_dir, 'ds_config_optimal.json')}")
    if not then_run:
        return 0
    with open(os.path.join(result.results_dir, "cmd_optimal.txt")) as f:
        import shlex

        cmd = shlex.split(f.read())
    run_at = cmd.index("run")  # python -m shardspeed.cli run ...
    return _cmd_run(cmd[run_at + 1:])


def _cmd_run(argv: Sequence[str]) -> int:
    try:
        mode, argv = _split_autotuning(argv)
    except UsageError as e:
        print(f"shardspeed run: error: {e}", file=sys.stderr)
        return 2
    if mode is not None:
        return _autotune(argv, then_run=mode == "run")
    if not argv or argv[0] in ("-h", "--help"):
        print(_RUN_USAGE)
        print("torchrun options:")
        from torch.distributed.run import get_args_parser

        get_args_parser().print_help()
        return 0
    try:
        opts, argv = _take_options(argv, ("--model", "--seq-len"))
        full_tracebacks, argv = _take_flag(argv, "--full-tracebacks")
        torchrun_argv = build_torchrun_argv(argv)
    except UsageError as e:
        print(f"shardspeed run: error: {e}", file=sys.stderr)
        return 2
    full_tracebacks = full_tracebacks or os.environ.get("SHARDSPEED_TRACEBACK", "") not in ("", "0")
    _isolate_restarts(torchrun_argv)
    return _launch(torchrun_argv, full_tracebacks)


def _take_flag(argv: Sequence[str], flag: str) -> tuple[bool, list[str]]:
    """Our own flag ``flag`` (before the script, among torchrun's options) taken out of the arguments."""
    args, i, found = list(argv), 0, False
    arity = {**_torchrun_option_arity(), "--nproc": 1}
    while i < len(args) and args[i].startswith("-") and args[i] != "--":
        name, eq, _ = args[i].partition("=")
        if name == flag:
            if eq:
                raise UsageError(f"{flag} takes no value")
            args.pop(i)
            found = True
            continue
        i += 1 if eq or arity.get(name, 0) == 0 else 2
    return found, args


def _wrap_in_bootstrap(torchrun_argv: Sequence[str]) -> list[str] | None:
    """torchrun's argv with the script run by :mod:`shardspeed.bootstrap` (which records a ShardspeedError
    instead of printing it), or None where it cannot be: ``--no-python`` (the script is a program) and
    ``--run-path`` (torchrun runs it in its own interpreter). torchrun's ``-m`` becomes the bootstrap's."""
    from .. import bootstrap

    arity, head, i = _torchrun_option_arity(), [], 0
    args = list(torchrun_argv)
    module = False
    while i < len(args) and args[i].startswith("-"):
        name, eq, _ = args[i].partition("=")
        canon = _canonical(name)
        if canon in ("--no-python", "--run-path"):
            return None
        if canon == "--module" or name == "-m":
            module = True
            i += 1
            continue
        n = 1 if eq or arity.get(name, 0) == 0 else 2
        head += args[i:i + n]
        i += n
    if i >= len(args):
        return None
    script = os.path.realpath(bootstrap.__file__)
    return [*head, script, *(["--module"] if module else []), *args[i:]]


def _script_name(torchrun_argv: Sequence[str]) -> str:
    arity, i = _torchrun_option_arity(), 0
    while i < len(torchrun_argv) and torchrun_argv[i].startswith("-"):
        name, eq, _ = torchrun_argv[i].partition("=")
        i += 1 if eq or arity.get(name, 0) == 0 else 2
    return torchrun_argv[i] if i < len(torchrun_argv) else "?"


def _launch(torchrun_argv: Sequence[str], full_tracebacks: bool = False) -> int:
    """Run torchrun; print a ShardspeedError the workers raised once per distinct (type, message), with the
    ranks it was raised on, and its tracebacks into a log file (see :mod:`shardspeed.bootstrap`)."""
    import logging
    import shutil
    import tempfile

    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import main as torchrun_main

    from .. import bootstrap

    script = _script_name(torchrun_argv)
    wrapped = None if full_tracebacks else _wrap_in_bootstrap(torchrun_argv)
    if wrapped is None:  # as torchrun alone: every rank prints its own traceback
        try:
            torchrun_main(list(torchrun_argv))
        except ChildFailedError as e:
            codes = [f.exitcode for f in e.failures.values() if f.exitcode]
            print(f"shardspeed run: {script} failed (exit codes {codes or '?'})", file=sys.stderr)
            return next((c for c in codes if c > 0), 1)
        return 0

    error_dir = tempfile.mkdtemp(prefix="shardspeed-run-")
    log_path = os.path.join(error_dir, bootstrap.TRACEBACK_LOG)
    saved_env = os.environ.get(bootstrap.ERROR_DIR_ENV)
    os.environ[bootstrap.ERROR_DIR_ENV] = error_dir  # the workers inherit the launcher's environment
    quiet = bootstrap.SuppressReported(error_dir)
    torchrun_log = logging.getLogger("torch.distributed.elastic.multiprocessing.api")
    torchrun_log.addFilter(quiet)
    failure: ChildFailedError | None = None
    try:
        torchrun_main(wrapped)
    except ChildFailedError as e:
        failure = e
    except BaseException:  # torchrun's own failure (rendezvous, Ctrl-C): no summary, no directory left
        if not bootstrap.read_records(error_dir):
            shutil.rmtree(error_dir, ignore_errors=True)
        raise
    finally:
        torchrun_log.removeFilter(quiet)
        if saved_env is None:
            os.environ.pop(bootstrap.ERROR_DIR_ENV, None)
        else:
            os.environ[bootstrap.ERROR_DIR_ENV] = saved_env

    records = bootstrap.read_records(error_dir)
    if not records:
        shutil.rmtree(error_dir, ignore_errors=True)
    else:
        bootstrap.write_traceback_log(records, log_path, quiet.dropped)
    if failure is None:
        if records:  # an earlier attempt failed with a shardspeed error, the restarted one finished
            for line in bootstrap.summary_lines(records):
                print(f"{line} (the run restarted and finished)", file=sys.stderr)
            print(f"shardspeed: tracebacks in {log_path}", file=sys.stderr)
        return 0

    codes = [f.exitcode for f in failure.failures.values() if f.exitcode]
    reported = {r.pid for r in bootstrap.latest_attempt(records)}
    for line in bootstrap.summary_lines(records):
        print(line, file=sys.stderr)
    if records:
        print(f"shardspeed: tracebacks in {log_path} (--full-tracebacks or SHARDSPEED_TRACEBACK=1 shows them)",
              file=sys.stderr)
    # workers that failed for another reason (their tracebacks are above); those stopped by torchrun
    # (negative codes) after a reported error are no news
    others = {rank: f.exitcode for rank, f in failure.failures.items() if f.pid not in reported
              and (f.exitcode > 0 or not records)}
    if others or not records:
        shown = sorted(others.values()) if records else codes
        print(f"shardspeed run: {script} failed (exit codes {shown or '?'})", file=sys.stderr)
    return next((c for c in codes if c > 0), 1)


def _version(dist: str) -> str:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def _cmd_env(args: argparse.Namespace) -> int:
    import torch
    import torch.distributed as dist

    rows: list[tuple[str, str]] = [
        ("python", f"{platform.python_version()} ({sys.executable})"),
        ("platform", platform.platform()),
        ("shardspeed", _version("shardspeed")),
        ("torch", torch.__version__),
        ("pydantic", _version("pydantic")),
        ("deepspeed", _version("deepspeed")),
        ("cpus", f"{os.cpu_count()} (torch threads {torch.get_num_threads()})"),
        ("cuda available", str(torch.cuda.is_available())),
        ("cuda version", str(torch.version.cuda)),
    ]
    if torch.cuda.is_available():
        n = torch.cuda.device_count()
        names = sorted({torch.cuda.get_device_name(i) for i in range(n)})
        rows.append(("device", f"{n} x {', '.join(names)}"))
    else:
        rows.append(("device", "cpu"))
    rows.append(("bf16 supported", str(torch.cuda.is_available() and torch.cuda.is_bf16_supported())
                 if torch.cuda.is_available() else "cpu (emulated)"))
    avail = dist.is_available()
    rows.append(("torch.distributed", str(avail)))
    if avail:
        rows.append(("gloo", str(dist.is_gloo_available())))
        rows.append(("nccl", str(dist.is_nccl_available())))
        rows.append(("mpi", str(dist.is_mpi_available())))
    width = max(len(k) for k, _ in rows)
    for k, v in rows:
        print(f"{k:<{width}}  {v}")
    return 0


_SUFFIXES = {"": 1, "k": 1e3, "m": 1e6, "b": 1e9, "g": 1e9, "t": 1e12}


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
        from shardspeed.estimate.cli import peak_command, wants_peak

        try:
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


def _cmd_plot(args: argparse.Namespace) -> int:
    from ..monitor.csv_plot import PlotError, plot_run

    try:
        out = plot_run(args.run_dir, args.output)
    except (PlotError, OSError) as e:
        print(f"shardspeed plot: {e}", file=sys.stderr)
        return 2
    print(out)
    return 0


def _build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="shardspeed", description="ZeRO-sharded training for PyTorch, drop-in for DeepSpeed configs."
    )
    sub = parser.add_subparsers(dest="command", metavar="{run,env,estimate,autotune,consolidate,plot}")
    # `run` is dispatched before argparse (its arguments belong to torchrun and the script); it is
    # registered here for --help only.
    sub.add_parser("run", help="launch a script on N processes (wraps torchrun)", add_help=False)

    p = sub.add_parser("env", help="print versions and the devices and backends available")
    p.set_defaults(func=_cmd_env)

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
    p.add_argument("--json", action="store_true", help="print bytes as JSON instead of a table")
    p.set_defaults(func=_cmd_estimate)

    from ..checkpoint.consolidate import build_parser as _consolidate_parser, run_args as _consolidate_run

    p = sub.add_parser("consolidate", help="write a sharded checkpoint as one fp32 state dict (safetensors)",
                       description="Export a sharded shardspeed checkpoint as fp32 safetensors, split by size, "
                                   "with a Hugging Face style index; loads with model.load_state_dict.")
    _consolidate_parser(p)
    p.set_defaults(func=_consolidate_run)

    p = sub.add_parser("plot", help="draw loss, LR and throughput from the CSV monitor into a PNG",
                       description="Read the csv_monitor files of a run ({output_path}/{job_name}/"
                                   "Train_Samples_*.csv) and draw loss, LR and throughput panels into a PNG.")
    p.add_argument("run_dir", metavar="RUN_DIR", help="the job directory, or an output_path with one job")
    p.add_argument("-o", "--output", help="the PNG to write (default: RUN_DIR's job directory/training.png)")
    p.set_defaults(func=_cmd_plot)

    # `autotune` is dispatched before argparse too (its arguments are torchrun's and the script's).
    sub.add_parser("autotune", help="search ZeRO stage, micro-batch, offload and buckets (model-guided trials)",
                   add_help=False)
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

