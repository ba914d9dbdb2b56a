"""``deepspeed.accelerator.abstract_accelerator.DeepSpeedAccelerator``: the methods scripts call on
``get_accelerator()``, answered by torch for one device type (``cpu`` or ``cuda``).

Nothing here touches the device when imported or constructed: CUDA is initialised only by a method that needs
it (``current_device()``, ``memory_allocated()``...), as with torch itself.
"""
from __future__ import annotations

import contextlib
import os
from typing import Any, List, Optional

import torch

from ..compat.alias import not_provided


class DeepSpeedAccelerator:
    """The device-independent part: RNG, tensor types, dtype support, op builders, the ``_name`` field."""

    _name = "cpu"
    _communication_backend_name = "gloo"
    _compile_backend = "inductor"

    # ---- names ------------------------------------------------------------------------------------
    def device_name(self, device_index: Optional[int] = None) -> str:
        return self._name if device_index is None else f"{self._name}:{device_index}"

    def communication_backend_name(self) -> str:
        return self._communication_backend_name

    def is_synchronized_device(self) -> bool:
        return self._name == "cpu"

    def use_host_timers(self) -> bool:
        return self.is_synchronized_device()

    def resolves_data_dependency(self) -> bool:
        return self.is_synchronized_device()

    def handles_memory_backpressure(self) -> bool:
        return self.is_synchronized_device()

    def is_triton_supported(self) -> bool:
        return False

    def get_compile_backend(self) -> str:
        return self._compile_backend

    def set_compile_backend(self, backend: str) -> None:
        self._compile_backend = backend

    # ---- RNG --------------------------------------------------------------------------------------
    def random(self):
        return torch.random

    # ---- dtypes -----------------------------------------------------------------------------------
    def supported_dtypes(self) -> List[torch.dtype]:
        out = [torch.float, torch.bfloat16] if self.is_bf16_supported() else [torch.float]
        return out + [torch.float16] if self.is_fp16_supported() else out

    def is_bf16_supported(self) -> bool:
        return True

    def is_fp16_supported(self) -> bool:
        return True

    # ---- tensor types (DeepSpeed's properties) -----------------------------------------------------
    def current_device_name(self) -> str:
        return self._name

    def _tensor_type(self, dtype: torch.dtype):
        """A constructor like ``torch.cuda.IntTensor``: ``T([0])`` / ``T()`` on the current device."""
        def make(data: Any = None) -> torch.Tensor:
            device = self.current_device_name()
            return torch.empty(0, dtype=dtype, device=device) if data is None else \
                torch.tensor(data, dtype=dtype, device=device)
        return make

    @property
    def BFloat16Tensor(self):
        return self._tensor_type(torch.bfloat16)

    @property
    def ByteTensor(self):
        return self._tensor_type(torch.uint8)

    @property
    def DoubleTensor(self):
        return self._tensor_type(torch.float64)

    @property
    def FloatTensor(self):
        return self._tensor_type(torch.float32)

    @property
    def HalfTensor(self):
        return self._tensor_type(torch.float16)

    @property
    def IntTensor(self):
        return self._tensor_type(torch.int32)

    @property
    def LongTensor(self):
        return self._tensor_type(torch.int64)

    # ---- misc -------------------------------------------------------------------------------------
    def on_accelerator(self, tensor: torch.Tensor) -> bool:
        return tensor.device.type == self._name

    def lazy_call(self, callback):
        return callback()

    def create_graph(self):
        return None

    def capture_to_graph(self, graph, pool=None, stream=None):
        return contextlib.nullcontext()

    def replay_graph(self, graph) -> None:
        return None

    def range_push(self, msg: str, domain=None, category=None) -> None:
        return None

    def range_pop(self, domain=None) -> None:
        return None

    def visible_devices_envs(self) -> List[str]:
        return ["CUDA_VISIBLE_DEVICES"] if self._name == "cuda" else []

    def set_visible_devices_envs(self, current_env: dict, local_accelerator_ids) -> None:
        for env in self.visible_devices_envs():
            current_env[env] = ",".join(map(str, local_accelerator_ids))

    def export_envs(self) -> List[str]:
        return ["NCCL"] if self._name == "cuda" else []

    def build_extension(self):
        """DeepSpeed's extension builder: shardspeed builds no C++ ops (its ops are torch's kernels)."""
        raise not_provided("deepspeed.accelerator.build_extension")

    def op_builder_dir(self) -> str:
        return "deepspeed.ops.op_builder"

    # ---- op builders: torch's kernels, nothing to compile ------------------------------------------
    def get_op_builder(self, class_name: str):
        """The builder class ``class_name`` (``FusedAdamBuilder``, ``CPUAdamBuilder``...), or None when
        shardspeed has no such op (DeepSpeed answers None for ops its accelerator lacks)."""
        from ..ops import op_builder

        return op_builder.builder_class(class_name)

    def create_op_builder(self, class_name: str):
        cls = self.get_op_builder(class_name)
        return None if cls is None else cls()


def local_rank() -> int:
    return int(os.environ.get("LOCAL_RANK", "0"))
