"""DeepSpeed's launcher options (``deepspeed --num_gpus 2 --hostfile F ...``) mapped onto torchrun's.

:func:`take_deepspeed_options` takes them out of ``shardspeed run``'s arguments; :func:`resolve` turns them into
torchrun options (``--nproc-per-node``, ``--nnodes``, ``--node-rank``, ``--master-addr``, ``--master-port``) and
the environment the workers get. Pure: the host-name test is a parameter.

A hostfile with more than one host is a multi-node job. DeepSpeed's default launcher ssh'es (pdsh) into every
host; shardspeed starts no remote process: the same command runs on every host (by hand, ssh, Slurm's ``srun``),
each finds its own node rank in the hostfile (its host name or address; ``--node_rank`` says it explicitly, as
DeepSpeed's ``--no_ssh``) and starts torchrun's agent for its slots, with a static rendezvous at the first host
(or ``--master_addr``) on ``--master_port`` (29500, DeepSpeed's default).
"""
from __future__ import annotations

import os
import re
from collections import OrderedDict
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Callable, Dict, List, Optional, Sequence, Tuple

from .usage import UsageError

#: DeepSpeed's options that take a value -> the name they are kept under (aliases share one).
VALUE_OPTIONS = MappingProxyType({
    "--num_gpus": "num_gpus", "--num_accelerators": "num_gpus", "--num_nodes": "num_nodes",
    "--hostfile": "hostfile", "-H": "hostfile", "--include": "include", "-i": "include",
    "--exclude": "exclude", "-e": "exclude", "--launcher": "launcher", "--launcher_args": "launcher_args",
    "--ssh_port": "ssh_port", "--venv_script": "venv_script", "--log_level": "log_level",
    "--enable_each_rank_log": "enable_each_rank_log", "--bind_core_list": "bind_core_list",
})
#: DeepSpeed's flags (torchrun's --module, --no_python, --master_addr/port, --node_rank are passed through).
FLAG_OPTIONS = MappingProxyType({
    "--no_local_rank": "no_local_rank", "--no_ssh": "no_ssh", "--no_ssh_check": "no_ssh_check",
    "--force_multi": "force_multi", "--save_pid": "save_pid", "--bind_cores_to_rank": "bind_cores_to_rank",
    "-q": "quiet", "--quiet": "quiet", "--elastic_training": "elastic_training",
})
#: Given these, DeepSpeed's behaviour needs a transport or a tool shardspeed does not provide: one line each.
NOT_PROVIDED = MappingProxyType({
    "launcher_args": "--launcher_args (arguments for pdsh/mpirun/srun)",
    "ssh_port": "--ssh_port (shardspeed starts no ssh session)",
    "venv_script": "--venv_script (sourced by pdsh on each host)",
    "save_pid": "--save_pid",
    "bind_cores_to_rank": "--bind_cores_to_rank (numactl binding; torchrun has --numa-binding)",
    "bind_core_list": "--bind_core_list (numactl binding; torchrun has --numa-binding)",
    "elastic_training": "--elastic_training (use torchrun's --nnodes MIN:MAX with --rdzv-backend c10d)",
})
#: DeepSpeed's multi-node transports. None is provided; pdsh (the default) is read as "run this on each host".
LAUNCHERS = ("pdsh", "openmpi", "mvapich", "slurm", "mpich", "impi")
ENV_FILE_NAME = ".deepspeed_env"  # deepspeed.launcher.runner.DEEPSPEED_ENVIRONMENT_NAME, unless DS_ENV_FILE renames it
DEFAULT_MASTER_PORT = "29500"  # DeepSpeed's TORCH_DISTRIBUTED_DEFAULT_PORT


def option_arity() -> Dict[str, int]:
    """DeepSpeed's launcher options -> how many values follow them (0 or 1)."""
    return {**{k: 1 for k in VALUE_OPTIONS}, **{k: 0 for k in FLAG_OPTIONS}}


def take_deepspeed_options(argv: Sequence[str], arity: Dict[str, int]) -> Tuple[Dict[str, str], List[str]]:
    """DeepSpeed's options (before the script) taken out of the arguments: ``{name: value}`` ("1" for a flag)
    and the rest. ``arity`` is that of every option the command line may hold (to find the script)."""
    args, found, i = list(argv), {}, 0
    while i < len(args) and args[i].startswith("-") and args[i] != "--":
        name, eq, value = args[i].partition("=")
        key = VALUE_OPTIONS.get(name) or FLAG_OPTIONS.get(name)
        if key is None:
            i += 1 if eq or arity.get(name, 0) == 0 else 2
            continue
        if name in FLAG_OPTIONS and eq:
            raise UsageError(f"{name} takes no value")
        if name in VALUE_OPTIONS and not eq:
            if i + 1 >= len(args):
                raise UsageError(f"{name} needs a value")
            value = args.pop(i + 1)
        if key in found and name in VALUE_OPTIONS:
            raise UsageError(f"{name} given twice")
        args.pop(i)
        found[key] = value if name in VALUE_OPTIONS else "1"
    return found, args


def parse_hostfile(lines: Sequence[str], path: str = "hostfile") -> OrderedDict[str, int]:
    """``host slots=N`` lines (``#`` comments and blank lines skipped) -> ``{host: N}`` in file order."""
    pool: OrderedDict[str, int] = OrderedDict()
    for number, raw in enumerate(lines, 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        match = re.fullmatch(r"(\S+)\s+slots=(\d+)(\s.*)?", line)
        if match is None:
            raise UsageError(f"{path} line {number}: {raw.strip()!r} is not 'hostname slots=N'")
        host, slots = match.group(1), int(match.group(2))
        if host in pool:
            raise UsageError(f"{path} line {number}: host {host!r} is listed twice")
        pool[host] = slots
    if not pool:
        raise UsageError(f"{path} lists no host ('hostname slots=N' lines)")
    return pool


def _parse_filter(text: str, flag: str) -> OrderedDict[str, List[int]]:
    """``"host:0,1@host2"`` -> ``{host: [0, 1], host2: []}`` (an empty list: every slot)."""
    out: OrderedDict[str, List[int]] = OrderedDict()
    for spec in text.split("@"):
        host, colon, slots = spec.partition(":")
        if not host or (colon and not slots):
            raise UsageError(f"{flag} {text!r}: each part must be HOST or HOST:SLOT[,SLOT...]")
        try:
            numbers = [int(s) for s in slots.split(",")] if colon else []
        except ValueError:
            raise UsageError(f"{flag} {text!r}: slots must be numbers") from None
        out.setdefault(host, []).extend(numbers)
    return out


def filter_resources(pool: Dict[str, int], include: str = "", exclude: str = "") -> OrderedDict[str, List[int]]:
    """The slots of each host after ``--include`` or ``--exclude`` (DeepSpeed's NODE_SPEC[@NODE_SPEC...]);
    hosts left with no slot are dropped; the hostfile's order is kept."""
    if include and exclude:
        raise UsageError("--include and --exclude cannot be used together")
    active = OrderedDict((h, list(range(n))) for h, n in pool.items())
    if not include and not exclude:
        return active
    flag, spec = ("--include", include) if include else ("--exclude", exclude)
    chosen = _parse_filter(spec, flag)
    for host, slots in chosen.items():
        if host not in active:
            raise UsageError(f"{flag}: host {host!r} is not in the hostfile")
        for s in slots:
            if s not in active[host]:
                raise UsageError(f"{flag}: host {host!r} has no slot {s}")
    out: OrderedDict[str, List[int]] = OrderedDict()
    for host, slots in active.items():
        if include:
            keep = sorted(set(chosen[host] or slots)) if host in chosen else []
        else:
            drop = set(chosen[host] or slots) if host in chosen else set()
            keep = [s for s in slots if s not in drop]
        if keep:
            out[host] = keep
    if not out:
        raise UsageError(f"{flag} {spec!r} leaves no slot to run on")
    return out


def trim(active: OrderedDict[str, List[int]], num_nodes: int, num_gpus: int) -> OrderedDict[str, List[int]]:
    """The first ``num_nodes`` hosts, and slots ``0..num_gpus-1`` on each (DeepSpeed's --num_nodes, --num_gpus)."""
    hosts = list(active.items())[:num_nodes] if num_nodes > 0 else list(active.items())
    return OrderedDict((h, list(range(num_gpus)) if num_gpus > 0 else s) for h, s in hosts)


@dataclass
class Launch:
    """What DeepSpeed's options make of a launch: torchrun's arguments (options, script, its arguments), the
    variables the workers get on top of the launcher's environment, whether each worker's argv gets
    ``--local_rank=N`` (DeepSpeed's launcher does so), and a line to print before starting (or None)."""

    argv: List[str]
    env: Dict[str, str] = field(default_factory=dict)
    local_rank_arg: bool = False
    note: Optional[str] = None


def _pop_torchrun(rest: List[str], names: Sequence[str], arity: Dict[str, int]) -> Dict[str, str]:
    """torchrun's options ``names`` (canonical spelling; the underscore spelling too) taken out of ``rest``
    (in place) -> ``{name: value}``; ``--nproc`` counts as ``--nproc-per-node``."""
    found, i = {}, 0
    while i < len(rest) and rest[i].startswith("-") and rest[i] != "--":
        name, eq, value = rest[i].partition("=")
        canon = "--nproc-per-node" if name == "--nproc" else "--" + name[2:].replace("_", "-")
        width = 1 if eq or arity.get(name, 0) == 0 else 2
        if canon in names:
            found[canon] = value if eq else (rest[i + 1] if i + 1 < len(rest) else "")
            del rest[i:i + width]
            continue
        i += width
    return found


def _count(found: Dict[str, str], key: str, flag: str) -> int:
    value = found.get(key, "-1")
    if not re.fullmatch(r"-1|\d+", value):
        raise UsageError(f"{flag} must be a number, got {value!r}")
    return int(value)


def read_env_file(paths: Sequence[str]) -> Dict[str, str]:
    """``KEY=VALUE`` lines of DeepSpeed's ``.deepspeed_env`` in each of ``paths`` (home, then the working folder:
    the later wins), ``#`` comments and blank lines skipped."""
    out: Dict[str, str] = {}
    for path in paths:
        if not os.path.isfile(path):
            continue
        with open(path) as f:
            for number, raw in enumerate(f, 1):
                line = raw.strip()
                if not line or line.startswith("#"):
                    continue
                key, eq, value = line.partition("=")
                if not eq or not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", key.strip()):
                    raise UsageError(f"{path} line {number}: {line!r} is not KEY=VALUE")
                out[key.strip()] = value
    return out


def env_file_paths(cwd: str, home: str, environ: Dict[str, str]) -> List[str]:
    """Where DeepSpeed's launcher looks for its environment file (``DS_ENV_FILE`` renames it): home, then cwd."""
    name = environ.get("DS_ENV_FILE", ENV_FILE_NAME)
    return [os.path.join(home, name), os.path.join(cwd, name)]


def _visible_devices(slots: List[int], environ: Dict[str, str]) -> Dict[str, str]:
    """``CUDA_VISIBLE_DEVICES`` for a slot list that is not ``0..n-1`` (slots index the devices already visible)."""
    if slots == list(range(len(slots))):
        return {}
    visible = [d for d in environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if d.strip()]
    if visible and max(slots) >= len(visible):
        raise UsageError(f"slot {max(slots)} is not among CUDA_VISIBLE_DEVICES={','.join(visible)}")
    return {"CUDA_VISIBLE_DEVICES": ",".join(visible[s] if visible else str(s) for s in slots)}


def _node_rank(hosts: List[str], given: Optional[str], is_this_host: Callable[[str], bool], hostfile: str) -> int:
    if given is not None:
        if not given.isdigit() or int(given) >= len(hosts):
            raise UsageError(f"--node_rank {given} is not a node of the {len(hosts)} hosts in {hostfile}")
        return int(given)
    mine = [i for i, h in enumerate(hosts) if is_this_host(h)]
    if len(mine) != 1:
        which = "none" if not mine else " and ".join(hosts[i] for i in mine)
        raise UsageError(f"cannot tell which host of {hostfile} this is ({which} of {', '.join(hosts)} match): "
                         "give --node_rank R on each host")
    return mine[0]


@dataclass
class Machine:
    """What :func:`resolve` asks of the machine it runs on (tests pass their own)."""

    is_this_host: Callable[[str], bool]
    device_count: Callable[[], int]
    environ: Dict[str, str]
    cwd: str
    home: str


def _check_provided(found: Dict[str, str], multi: bool) -> None:
    for key, text in NOT_PROVIDED.items():
        if key in found:
            raise UsageError(f"{text} is not provided by shardspeed run")
    launcher = found.get("launcher", "pdsh").lower()
    if launcher not in LAUNCHERS:
        raise UsageError(f"--launcher {found['launcher']!r} is unknown; DeepSpeed's are {', '.join(LAUNCHERS)}")
    if multi and "launcher" in found:
        raise UsageError(f"--launcher {launcher} is not provided: shardspeed starts no remote process; run the "
                         "same command on every host of the hostfile (each finds its node rank in it)")


def resolve(found: Dict[str, str], rest: Sequence[str], arity: Dict[str, int], machine: Machine,
            deepspeed_style: bool = False) -> Launch:
    """DeepSpeed's options ``found`` (from :func:`take_deepspeed_options`) applied to the rest of the command line
    (torchrun's options, the script, its arguments). Plain ``shardspeed run`` with none of them: unchanged."""
    rest = list(rest)
    launch = Launch(rest, local_rank_arg=deepspeed_style and "no_local_rank" not in found)
    log_dir = found.get("enable_each_rank_log", "None")
    if log_dir != "None":  # torchrun's per-rank files (its own layout under the folder)
        rest[:0] = ["--log-dir", log_dir, "--redirects", "3"]
    num_gpus, num_nodes = _count(found, "num_gpus", "--num_gpus"), _count(found, "num_nodes", "--num_nodes")
    include, exclude = found.get("include", ""), found.get("exclude", "")
    if (num_gpus >= 0 or num_nodes >= 0) and (include or exclude):
        raise UsageError("--num_nodes/--num_gpus cannot be used with --include/--exclude")
    given = _pop_torchrun(rest, ("--nproc-per-node", "--nnodes"), arity)
    places = any(k in found for k in ("num_gpus", "num_nodes", "hostfile", "include", "exclude"))
    if given and places:
        raise UsageError(f"{' and '.join(given)} and DeepSpeed's --num_gpus/--num_nodes/--hostfile/--include/"
                         "--exclude both say where to run: give one of them")
    if not places:
        _check_provided(found, multi=False)
        if given or not deepspeed_style:  # torchrun's own counts (or its default, one process)
            rest[:0] = [x for k, v in given.items() for x in (k, v)]
        else:  # DeepSpeed: every local device (one process where there is none)
            rest[:0] = ["--nproc-per-node", str(max(machine.device_count(), 1))]
        return launch
    hostfile = found.get("hostfile")
    if hostfile is not None:
        if not os.path.isfile(hostfile):
            raise UsageError(f"--hostfile {hostfile}: no such file")
        with open(hostfile) as f:
            pool: Dict[str, int] = parse_hostfile(f.read().splitlines(), hostfile)
    elif num_nodes > 1:
        raise UsageError(f"--num_nodes {num_nodes} needs a --hostfile listing the hosts")
    else:
        pool = {"localhost": max(machine.device_count(), 1)}
    active = trim(filter_resources(pool, include, exclude), num_nodes, num_gpus)
    multi = len(active) > 1 or "force_multi" in found
    _check_provided(found, multi)
    if not multi:
        slots = next(iter(active.values()))
        rest[:0] = ["--nproc-per-node", str(len(slots))]
        launch.env.update(_visible_devices(slots, machine.environ))
        return launch
    _multi_node(launch, found, active, arity, machine)
    return launch


def _multi_node(launch: Launch, found: Dict[str, str], active: OrderedDict[str, List[int]], arity: Dict[str, int],
                machine: Machine) -> None:
    """This host's agent of a multi-node job: its node rank and slots, the static rendezvous at the first host,
    and the variables of ``.deepspeed_env`` (as DeepSpeed exports them to multi-node workers)."""
    hostfile = found.get("hostfile", "the hostfile")
    rest = launch.argv
    given = _pop_torchrun(rest, ("--node-rank", "--master-addr", "--master-port"), arity)
    hosts = list(active)
    rank = _node_rank(hosts, given.get("--node-rank"), machine.is_this_host, hostfile)
    slots = active[hosts[rank]]
    rest[:0] = ["--nnodes", str(len(hosts)), "--node-rank", str(rank), "--nproc-per-node", str(len(slots)),
                "--master-addr", given.get("--master-addr", hosts[0]),
                "--master-port", given.get("--master-port", DEFAULT_MASTER_PORT)]
    launch.env.update(_visible_devices(slots, machine.environ))
    launch.env.update(read_env_file(env_file_paths(machine.cwd, machine.home, machine.environ)))
    procs = f"{len(slots)} process" + ("es" if len(slots) != 1 else "")
    launch.note = (f"shardspeed run: node {rank} of {len(hosts)} ({hosts[rank]}, {procs}); run the "
                   f"same command on every host of {hostfile}: shardspeed starts no remote process")


def is_this_host(name: str) -> bool:
    """Whether ``name`` (a hostfile entry) is this machine: its host name, or an address it resolves to is
    loopback or one of this host name's addresses."""
    import socket

    own = socket.gethostname()
    if name in (own, own.split(".")[0], socket.getfqdn()):
        return True

    def addresses(host: str) -> set:
        try:
            return {str(info[4][0]) for info in socket.getaddrinfo(host, None)}
        except OSError:
            return set()

    theirs = addresses(name)
    return any(a.startswith("127.") or a == "::1" for a in theirs) or bool(theirs & addresses(own))


def this_machine() -> Machine:
    def device_count() -> int:
        import torch

        return torch.cuda.device_count() if torch.cuda.is_available() else 0

    return Machine(is_this_host, device_count, dict(os.environ), os.getcwd(), os.path.expanduser("~"))
