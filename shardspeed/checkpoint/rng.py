"""Every RNG a training step may draw from: torch (CPU and each CUDA device), Python's ``random``, numpy.

Torch's states are byte tensors (stored in the rank's safetensors file); Python's and numpy's are small
lists of integers (stored in metadata.json, per rank).
"""
from __future__ import annotations

import random
from typing import Any, Dict, List, Tuple

import torch


def capture() -> Tuple[List[Tuple[str, torch.Tensor]], Dict[str, Any]]:
    tensors = [("rng/torch", torch.get_rng_state())]
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        for i, st in enumerate(torch.cuda.get_rng_state_all()):
            tensors.append((f"rng/cuda{i}", st))
    version, state, gauss = random.getstate()
    py: Dict[str, Any] = {"python": [version, list(state), gauss]}
    try:
        import numpy as np

        name, keys, pos, has_gauss, cached = np.random.get_state()
        py["numpy"] = [name, [int(k) for k in keys], int(pos), int(has_gauss), float(cached)]
    except ImportError:
        pass
    return tensors, py


def restore(tensors: Dict[str, torch.Tensor], py: Dict[str, Any]) -> None:
    if "rng/torch" in tensors:
        torch.set_rng_state(tensors["rng/torch"])
    if torch.cuda.is_available():
        states = [tensors[k] for k in sorted(k for k in tensors if k.startswith("rng/cuda"))]
        if states and len(states) == torch.cuda.device_count():
            torch.cuda.set_rng_state_all(states)
    if "python" in py:
        version, state, gauss = py["python"]
        random.setstate((version, tuple(state), gauss))
    if "numpy" in py:
        import numpy as np

        name, keys, pos, has_gauss, cached = py["numpy"]
        np.random.set_state((name, np.array(keys, dtype=np.uint32), pos, has_gauss, cached))
