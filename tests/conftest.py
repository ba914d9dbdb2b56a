"""Test-session set-up: DeepSpeed (the oracle of the parity tests) runs on its CPU accelerator on a machine
without CUDA, in this process and in every worker process the tests start (they inherit the environment)."""
from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
