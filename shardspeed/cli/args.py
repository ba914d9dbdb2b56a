"""The command line shared by ``shardspeed run`` and ``shardspeed autotune``: torchrun's options (which they
pass through), our own options taken out from among them, and :func:`build_torchrun_argv`."""

from __future__ import annotations

from typing import Sequence

from .usage import UsageError

# Options that mean the user chose the rendezvous themselves: then --standalone is not added.
_RENDEZVOUS_OPTIONS = frozenset({
    "--standalone",
    "--rdzv-endpoint",
    "--rdzv-backend",
    "--master-addr",
    "--master-port",
    "--node-rank",
})


def torchrun_option_arity() -> dict[str, int]:
    """Every option string torchrun accepts → how many values follow it (0 or 1)."""
    from torch.distributed.run import get_args_parser

    arity: dict[str, int] = {}
    for action in get_args_parser()._actions:  # argparse keeps no public list of its actions
        for opt in action.option_strings:
            arity[opt] = 0 if action.nargs == 0 else 1
    return arity


def command_option_arity() -> dict[str, int]:
    """Every option ``shardspeed run`` accepts before the script (torchrun's, DeepSpeed's launcher options,
    ``--nproc``) -> how many values follow it: how to find the script among them."""
    from .ds_options import option_arity

    return {**torchrun_option_arity(), **option_arity(), "--nproc": 1}


def canonical_option(option: str) -> str:
    """``--nproc_per_node`` → ``--nproc-per-node`` (torchrun accepts both spellings)."""
    return "--" + option[2:].replace("_", "-") if option.startswith("--") else option


def build_torchrun_argv(argv: Sequence[str]) -> list[str]:
    """Turn ``shardspeed run``'s arguments into the argv for ``torch.distributed.run.main``.

    ``--nproc N`` becomes ``--nproc-per-node N``; other torchrun options are passed through as given;
    ``--`` may separate the options from the script; the script and its arguments follow unchanged.
    ``--standalone`` is added when the job is single-node and no rendezvous/master was given.
    Raises ``UsageError`` for an unknown option, an option missing its value, or no script.
    """
    arity = torchrun_option_arity()
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
        seen.add(canonical_option(out_name))
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
        if canonical_option(name) == "--nnodes":
            nnodes = value
        head += [out_name, value]
    if i >= len(args):
        raise UsageError("no script given: shardspeed run [options] script.py [script args]")
    script, script_args = args[i], args[i + 1 :]
    single_node = nnodes is None or nnodes in ("1", "1:1")
    if single_node and not (seen & _RENDEZVOUS_OPTIONS):
        head.insert(0, "--standalone")
    return head + [script] + script_args


def take_options(argv: Sequence[str], names: Sequence[str]) -> tuple[dict[str, str], list[str]]:
    """Our own ``--name value`` options (before the script, among torchrun's) taken out of the arguments."""
    args, found, i = list(argv), {}, 0
    arity = command_option_arity()
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


def take_flag(argv: Sequence[str], flag: str) -> tuple[bool, list[str]]:
    """Our own flag ``flag`` (before the script, among torchrun's options) taken out of the arguments."""
    args, i, found = list(argv), 0, False
    arity = command_option_arity()
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


def positive_int(value: str, flag: str) -> int:
    if not value.isdigit() or int(value) < 1:
        raise UsageError(f"{flag} must be a positive number, got {value!r}")
    return int(value)
