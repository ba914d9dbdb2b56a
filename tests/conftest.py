"""Test-session set-up: DeepSpeed (the oracle of the parity tests) runs on its CPU accelerator on a machine
without CUDA, in this process and in every worker process the tests start (they inherit the environment).

``deepspeed_fused_adam``: DeepSpeed's default optimizer block (``{"type": "AdamW"}`` without ``torch_adam``)
gives its C++ FusedAdam, which DeepSpeed compiles at first use: about 5 minutes on 2 busy cores on a fresh
machine, then cached (``~/.cache/torch_extensions``, or ``TORCH_EXTENSIONS_DIR``). The tests that run it ask
for this fixture, which builds it once, in its own process and under its own time bound, so that no
multi-rank test spends its timeout compiling."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("DS_ACCELERATOR", "cpu")

_BUILD = "from deepspeed.accelerator import get_accelerator; get_accelerator().create_op_builder('FusedAdamBuilder').load()"


@pytest.fixture(scope="session")
def deepspeed_fused_adam() -> None:
    pytest.importorskip("deepspeed")
    try:
        subprocess.run([sys.executable, "-c", _BUILD], check=True, timeout=1800, capture_output=True, text=True)
    except subprocess.CalledProcessError as exc:
        tail = "\n".join((exc.stderr or "").splitlines()[-5:])
        pytest.fail(f"DeepSpeed's FusedAdam op (its default optimizer on this accelerator) did not build:\n{tail}")


_BUILD_OPS = ("from deepspeed.accelerator import get_accelerator\n"
              "for b in ('FusedAdamBuilder', 'CPUAdamBuilder', 'CPUAdagradBuilder', 'CPULionBuilder'):\n"
              "    get_accelerator().create_op_builder(b).load()\n")


@pytest.fixture(scope="session")
def deepspeed_optimizer_ops() -> None:
    """DeepSpeed's FusedAdam and its CPU Adam, Adagrad and Lion ops (the oracles of shardspeed's ``deepspeed.ops``),
    built once in one process (each about 5 minutes on a fresh 2-core machine, then cached)."""
    pytest.importorskip("deepspeed")
    try:
        subprocess.run([sys.executable, "-c", _BUILD_OPS], check=True, timeout=3600, capture_output=True, text=True)
    except subprocess.CalledProcessError as exc:
        tail = "\n".join((exc.stderr or "").splitlines()[-5:])
        pytest.fail(f"DeepSpeed's optimizer ops did not build:\n{tail}")
