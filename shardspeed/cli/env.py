"""``shardspeed env``: the versions, devices and backends of this machine."""

from __future__ import annotations

import argparse
import importlib.metadata
import os
import platform
import sys


def _version(dist: str) -> str:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def _deepspeed_row() -> str:
    """Which ``deepspeed`` an ``import deepspeed`` here would get: shardspeed's package or an installed one."""
    from ..compat import active, site_path

    if active():
        return f"{_version('deepspeed')} (shardspeed's package: {site_path()})"
    return _version("deepspeed")


def _cmd_env(args: argparse.Namespace) -> int:
    import torch
    import torch.distributed as dist

    rows: list[tuple[str, str]] = [
        ("python", f"{platform.python_version()} ({sys.executable})"),
        ("platform", platform.platform()),
        ("shardspeed", _version("shardspeed")),
        ("torch", torch.__version__),
        ("pydantic", _version("pydantic")),
        ("deepspeed", _deepspeed_row()),
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


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("env", help="print versions and the devices and backends available")
    p.set_defaults(func=_cmd_env)


def _cmd_deepspeed_path(args: argparse.Namespace) -> int:
    from ..compat import site_path

    print(os.path.join(site_path(), "bin") if args.bin else site_path())
    return 0


def add_path_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("deepspeed-path", help="print the folder that makes `import deepspeed` resolve to shardspeed "
                       "(put it first on PYTHONPATH; --bin: the folder holding a `deepspeed` command, for PATH)")
    p.add_argument("--bin", action="store_true", help="the folder of the `deepspeed` launcher command instead")
    p.set_defaults(func=_cmd_deepspeed_path)
