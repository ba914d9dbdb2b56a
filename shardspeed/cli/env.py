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


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("env", help="print versions and the devices and backends available")
    p.set_defaults(func=_cmd_env)
