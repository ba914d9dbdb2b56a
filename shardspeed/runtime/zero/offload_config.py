"""``deepspeed.runtime.zero.offload_config``: DeepSpeed's offload enums (string-valued, as in DeepSpeed, so
``OffloadDeviceEnum.cpu == "cpu"``)."""
from enum import Enum

from ...compat.alias import module_getattr


class OffloadDeviceEnum(str, Enum):
    """Where offloaded states live (``offload_optimizer.device`` / ``offload_param.device``)."""

    none = "none"
    cpu = "cpu"
    nvme = "nvme"


class OffloadStateTypeEnum(str, Enum):
    """The kinds of engine state ``engine.offload_states(include=...)`` names."""

    optim_states = "optim_states"
    hp_params = "hp_params"
    lp_params = "lp_params"
    lp_grads = "lp_grads"
    contiguous_grad_buffer = "contiguous_grad_buffer"


__all__ = ["OffloadDeviceEnum", "OffloadStateTypeEnum"]

__getattr__ = module_getattr(__name__)
