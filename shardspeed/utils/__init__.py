"""DeepSpeed-compatible utilities (``shardspeed.utils`` mirrors ``deepspeed.utils``): ``RepeatingLoader``,
``logger`` / ``log_dist`` (:mod:`.logging`), ZeRO-3 leaf modules (:mod:`.z3_leaf_module`), ``groups`` and
``zero_to_fp32`` (submodules). A DeepSpeed name not provided here fails with the one-line error."""
from ..compat.alias import module_getattr
from .logging import log_dist, log_dist_once, logger, set_log_level_from_string
from .repeating import RepeatingLoader
from .z3_leaf_module import (
                              get_z3_leaf_modules,
                              set_z3_leaf_module,
                              set_z3_leaf_modules,
                              set_z3_leaf_modules_by_name,
                              set_z3_leaf_modules_by_suffix,
                              unset_z3_leaf_modules,
                              z3_leaf_module,
                              z3_leaf_parameter,
)

__all__ = ["RepeatingLoader", "get_z3_leaf_modules", "log_dist", "log_dist_once", "logger",
           "safe_get_full_fp32_param", "safe_get_full_grad", "safe_get_full_optimizer_state",
           "safe_set_full_fp32_param", "safe_set_full_optimizer_state", "set_log_level_from_string",
           "set_z3_leaf_module", "set_z3_leaf_modules", "set_z3_leaf_modules_by_name", "set_z3_leaf_modules_by_suffix",
           "unset_z3_leaf_modules", "z3_leaf_module", "z3_leaf_parameter"]

# the safe_* functions live in a facade over the checkpoint layer (utils.tensor_fragment, DeepSpeed's path):
# imported when first asked for, so that `import shardspeed.utils` (low in the layers) does not import it
_SAFE = ("safe_get_full_fp32_param", "safe_get_full_grad", "safe_get_full_optimizer_state",
         "safe_set_full_fp32_param", "safe_set_full_optimizer_state")
_missing = module_getattr(__name__)


def __getattr__(name: str):
    if name in _SAFE:
        import importlib

        return getattr(importlib.import_module(f"{__name__}.tensor_fragment"), name)
    return _missing(name)
