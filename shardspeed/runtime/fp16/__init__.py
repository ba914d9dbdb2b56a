"""``deepspeed.runtime.fp16``: the loss scalers (:mod:`.loss_scaler`)."""
from ...compat.alias import module_getattr

__getattr__ = module_getattr(__name__)
