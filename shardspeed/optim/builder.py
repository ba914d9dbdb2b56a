"""Build the optimizer named by the DeepSpeed ``"optimizer"`` block, or rebuild a user's over new tensors.

Kernel choice (design note "fused first"). torch's fused Adam/AdamW/SGD kernels run on CPU (torch>=2.4)
and CUDA, fused Adagrad on CPU only. Measured on the 2-core CPU box (torch 2.13, fp32, AdamW, mean of
10 steps after 2 warm-up steps):

    ========================  =======  ========  ===============
    parameters                fused    foreach   for-loop (None)
    ========================  =======  ========  ===============
    one flat 10M tensor        5.3 ms  45.2 ms   43.0 ms
    100 tensors x 100k         6.6 ms  35.5 ms   23.5 ms
    ========================  =======  ========  ===============

A second run while other jobs loaded the box (fused / foreach / loop): flat 16.6 / 114.8 / 160.3 ms,
list 138.8 / 582.5 / 427.1 ms: slower everywhere, fused still 4-7x ahead. So fused is chosen whenever
every parameter is floating point and all sit on one device type the kernel supports. Otherwise nothing
is forced: torch's default then picks foreach on CUDA and the per-tensor loop on CPU (on CPU the loop
beat foreach for many tensors, and neither is consistently ahead for one flat tensor). ``fused`` or ``foreach``
given in the config's params wins over this choice, and so does ``torch_adam: true``, which asks for torch's
Adam/AdamW exactly as DeepSpeed builds it: torch's own kernel choice, so that the steps equal DeepSpeed's bit
for bit (torch's fused CPU kernel rounds the update differently from the loop, by an ulp).
"""

from __future__ import annotations

import inspect
import logging
import math
import re
from types import MappingProxyType
from typing import Any, Dict, Iterable, List, Mapping, Sequence, Tuple, Type

import torch

from shardspeed.errors import ConfigError
from shardspeed.optim.lamb import Lamb
from shardspeed.optim.lion import Lion
from shardspeed.optim.muon import MuonWithAuxAdam, muon_config, split_muon_groups

logger = logging.getLogger(__name__)

__all__ = ["build_optimizer", "rebuild_optimizer", "retarget_optimizer", "DEEPSPEED_OPTIMIZER_NAMES",
           "torch_optimizer_classes"]

#: DeepSpeed names shardspeed builds itself (matched case-insensitively).
DEEPSPEED_OPTIMIZER_NAMES = ("adam", "adamw", "sgd", "adagrad", "lamb", "lion", "muon")

# DeepSpeed optimizers that depend on DeepSpeed's own kernels or on mup.
_UNSUPPORTED = MappingProxyType({
    "onebitadam": "1-bit Adam compresses DeepSpeed's own communication; use 'adamw'",
    "zerooneadam": "0/1 Adam compresses DeepSpeed's own communication; use 'adamw'",
    "onebitlamb": "1-bit LAMB compresses DeepSpeed's own communication; use 'lamb'",
    "muadam": "mup's MuAdam is not bundled; build it yourself and pass it as optimizer=",
    "muadamw": "mup's MuAdamW is not bundled; build it yourself and pass it as optimizer=",
    "musgd": "mup's MuSGD is not bundled; build it yourself and pass it as optimizer=",
})

# torch.optim classes that cannot serve as the engine's optimizer (closure-only or sparse-only).
_EXCLUDED_TORCH = frozenset({"Optimizer", "LBFGS", "SparseAdam"})

# Which device types each torch class has a fused kernel for.
_FUSED_DEVICE_TYPES: Mapping[type, frozenset] = MappingProxyType({
    torch.optim.Adam: frozenset({"cpu", "cuda"}),
    torch.optim.AdamW: frozenset({"cpu", "cuda"}),
    torch.optim.SGD: frozenset({"cpu", "cuda"}),
    torch.optim.Adagrad: frozenset({"cpu"}),
})

# DeepSpeed's FusedAdam / DeepSpeedCPUAdam defaults (note weight_decay 0, where torch's AdamW has 1e-2).
_DS_ADAM_DEFAULTS = MappingProxyType(dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0))
# DeepSpeed's FusedLion / DeepSpeedCPULion defaults (the Lion class itself has the paper's).
_DS_LION_DEFAULTS = MappingProxyType(dict(lr=1e-3, betas=(0.9, 0.999), weight_decay=0.0))

# Accepted for compatibility with DeepSpeed configs, with no effect here.
_IGNORED_KEYS = MappingProxyType({
    "adam": {"set_grad_none", "fp32_optimizer_states"},
    "lion": {"set_grad_none"},
})


def torch_optimizer_classes() -> Dict[str, Type[torch.optim.Optimizer]]:
    """``{lower-case name: class}`` of the torch.optim optimizers usable by name."""
    out = {}
    for name in dir(torch.optim):
        obj = getattr(torch.optim, name)
        if (
            isinstance(obj, type)
            and issubclass(obj, torch.optim.Optimizer)
            and name not in _EXCLUDED_TORCH
            and name.lower() not in _UNSUPPORTED
            and name.lower() != "muon"  # "muon" is DeepSpeed's Muon with its auxiliary Adam (optim.muon)
            and not name.startswith("_")
        ):
            out[name.lower()] = obj
    return out


def _valid_names() -> str:
    torch_names = sorted(c.__name__ for c in torch_optimizer_classes().values())
    return ", ".join(DEEPSPEED_OPTIMIZER_NAMES) + "; or a torch.optim class: " + ", ".join(torch_names)


def _init_kwargs(cls: type) -> List[str]:
    sig = inspect.signature(cls.__init__)  # type: ignore[misc]  # the class's own __init__ is what we want
    return [
        n
        for n, p in sig.parameters.items()
        if n not in ("self", "params") and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)
    ]


def _materialize(param_groups: Iterable) -> List[Any]:
    groups = list(param_groups)
    if not groups:
        raise ConfigError("build_optimizer got no parameters: pass the model's parameters or param groups")
    return groups


def _all_tensors(groups: Sequence[Any]) -> List[torch.Tensor]:
    out: List[torch.Tensor] = []
    for g in groups:
        if isinstance(g, Mapping):
            ps = g["params"]
            out.extend([ps] if isinstance(ps, torch.Tensor) else list(ps))
        else:
            out.append(g)
    return out


def _fused_applies(cls: type, tensors: Sequence[torch.Tensor]) -> bool:
    device_types = _FUSED_DEVICE_TYPES.get(cls)
    if not device_types or not tensors:
        return False
    kinds = {t.device.type for t in tensors}
    return len(kinds) == 1 and kinds <= device_types and all(t.is_floating_point() for t in tensors)


def _is_number(v: Any) -> bool:
    if isinstance(v, torch.Tensor):  # torch takes a 0-d tensor lr (capturable / compiled steps)
        return v.numel() == 1 and not v.dtype.is_complex and v.dtype != torch.bool
    return isinstance(v, (int, float)) and not isinstance(v, bool) and not math.isnan(v)


def _shown(v: Any) -> Any:
    return list(v) if isinstance(v, tuple) else v


def _not_auto(key: str, v: Any) -> None:
    if isinstance(v, str) and v == "auto":
        raise ConfigError(
            f"optimizer.params.{key} is \"auto\", which shardspeed cannot derive: the Hugging Face integration "
            "(the Trainer, or shardspeed.integrations.transformers.fill_auto) fills it in; pass a number"
        )


def _check_values(type_name: str, cls: type, params: Dict[str, Any], defaults: Dict[str, Any]) -> None:
    """Each hyper-parameter given must have the kind of its default: a number where the default is a
    number (``lr``, ``eps``, ``weight_decay``, ``momentum``, ...), true/false where it is a bool, a list of
    as many numbers where it is a tuple of numbers (``betas``, ``etas``, ``step_sizes``), and ``betas`` in
    [0, 1). Otherwise the optimizer's constructor fails with a TypeError (``'<=' not supported ...``) or an
    IndexError that does not say which key is wrong, or takes a string such as ``"false"`` as true."""
    sig = inspect.signature(cls.__init__)  # type: ignore[misc]
    for k, v in params.items():
        _not_auto(k, v)
        default = defaults.get(k, sig.parameters[k].default if k in sig.parameters else None)
        if isinstance(default, bool):
            if not isinstance(v, bool):
                raise ConfigError(f"optimizer.params.{k} of {type_name!r} must be true or false, got {v!r}")
        elif isinstance(default, (int, float)):
            if not _is_number(v):
                raise ConfigError(f"optimizer.params.{k} must be a number, got {_shown(v)!r}")
        elif isinstance(default, tuple) and default and all(isinstance(x, (int, float)) for x in default):
            for x in v if isinstance(v, tuple) else ():
                _not_auto(k, x)
            ok = isinstance(v, tuple) and len(v) == len(default) and all(_is_number(x) for x in v)
            if not ok:
                raise ConfigError(
                    f"optimizer.params.{k} of {type_name!r} must be a list of {len(default)} numbers "
                    f"(e.g. {list(default)}), got {_shown(v)!r}"
                )
            if k == "betas" and not all(0.0 <= float(x) < 1.0 for x in v):
                raise ConfigError(f"optimizer.params.betas must be 2 numbers in [0, 1), got {_shown(v)!r}")


def _rejected_keys(message: str, params: Mapping[str, Any]) -> List[str]:
    """The hyper-parameters of the config's ``params`` that an optimizer constructor's error message is
    about: torch's phrases ("Invalid learning rate", "Invalid beta parameter", ...) and the keys it names."""
    low = message.lower()
    keys = [k for phrase, k in _TORCH_PHRASES if phrase in low and k in params]
    # only the user's own keys: a default (or the fused=True chosen here) is not their mistake
    return keys + [k for k in params if k not in keys and re.search(rf"(?<![\w.]){re.escape(k.lower())}(?!\w)", low)]


# torch's ValueError phrases (torch.optim.*) -> the key they are about
_TORCH_PHRASES = (
    ("learning rate", "lr"),
    ("epsilon", "eps"),
    ("beta parameter", "betas"),
    ("eta values", "etas"),
    ("nesterov momentum", "nesterov"),
)


def _one_line(e: BaseException) -> str:
    return " ".join(str(e).split())


def build_optimizer(cfg: Any, param_groups: Iterable) -> torch.optim.Optimizer:
    """The optimizer for an ``{"type": ..., "params": {...}}`` block (any object with ``.type`` and
    ``.params``), over ``param_groups`` (tensors, or dicts with ``"params"`` and per-group options).

    Names, case-insensitive: ``adam`` (AdamW unless ``adam_w_mode: false``, then Adam with L2 weight
    decay), ``adamw``, ``sgd``, ``adagrad``, ``lamb`` (:class:`Lamb`), ``lion`` (:class:`Lion`), or any
    ``torch.optim`` class by name. Missing Adam/Lion hyper-parameters take DeepSpeed's defaults (Adam:
    lr 1e-3, betas (0.9, 0.999), eps 1e-8, weight_decay 0), except with ``torch_adam: true``, which like
    DeepSpeed means torch's own class and defaults. Raises :class:`ConfigError` for an unknown name, a
    param the optimizer does not take, or ``max_grad_norm`` (use top-level ``gradient_clipping``).
    """
    type_name = getattr(cfg, "type", None)
    if not isinstance(type_name, str) or not type_name:
        raise ConfigError(f"optimizer.type must be a non-empty string, got {type_name!r}; valid: {_valid_names()}")
    params: Dict[str, Any] = dict(getattr(cfg, "params", None) or {})
    key = type_name.lower()

    if "max_grad_norm" in params:
        raise ConfigError(
            "optimizer.params.max_grad_norm is not supported: remove it and set the top-level "
            "'gradient_clipping' instead"
        )
    if key in _UNSUPPORTED:
        raise ConfigError(f"optimizer.type {type_name!r} is not supported by shardspeed: {_UNSUPPORTED[key]}")

    if key == "muon":
        return _build_muon(params, _materialize(param_groups))
    cls, defaults = _resolve_class(type_name, key, params)
    _check_accepted(type_name, key, cls, params)
    for k, v in list(params.items()):
        if isinstance(v, list):  # JSON has no tuples: betas, etas, step_sizes; and [0, 0.999] has an int,
            # where torch's Adam wants "both floats or both Tensors"
            params[k] = tuple(float(x) if isinstance(x, int) and not isinstance(x, bool) else x for x in v)
    _check_values(type_name, cls, params, defaults)
    return _construct(type_name, cls, params, defaults, _materialize(param_groups))


def _build_muon(params: Dict[str, Any], groups: List[Any]) -> torch.optim.Optimizer:
    """DeepSpeed's Muon over ``groups``: already split by the engine (each with ``use_muon``), or split here by
    shape alone (no names: an embedding or LM head with 2 dimensions would go to Muon)."""
    _, _, adam_w_mode = muon_config(params)
    if not all(isinstance(g, Mapping) and "use_muon" in g for g in groups):
        dicts = [dict(g, params=list(g["params"])) for g in groups if isinstance(g, Mapping)]
        loose = [g for g in groups if not isinstance(g, Mapping)]
        groups = split_muon_groups(dicts + ([{"params": loose}] if loose else []), {}, params)
    return MuonWithAuxAdam(groups, adam_w_mode=adam_w_mode)


def _resolve_class(type_name: str, key: str, params: Dict[str, Any]) -> Tuple[type, Dict[str, Any]]:
    """(the optimizer class, the defaults shardspeed gives it) for the lower-case name ``key``; the
    DeepSpeed-only flags of ``params`` (adam_w_mode, torch_adam, bias_correction, the ignored keys) are
    taken out of it."""
    defaults: Dict[str, Any] = {}
    if key in ("adam", "adamw"):
        for flag in ("adam_w_mode", "torch_adam", "bias_correction"):
            if flag in params and not isinstance(params[flag], bool):
                raise ConfigError(f"optimizer.params.{flag} of {type_name!r} must be true or false, "
                                  f"got {params[flag]!r}")
        adam_w_mode = params.pop("adam_w_mode", True)
        torch_adam = params.pop("torch_adam", False)
        for ignored in _IGNORED_KEYS["adam"]:
            params.pop(ignored, None)
        if not params.pop("bias_correction", True):
            raise ConfigError(
                f"optimizer.params.bias_correction=false is not supported for {type_name!r} "
                "(torch's Adam always corrects bias): remove it"
            )
        cls: type = torch.optim.AdamW if (key == "adamw" or adam_w_mode) else torch.optim.Adam
        # torch_adam: torch's class as DeepSpeed builds it, with torch's defaults and torch's kernel choice
        # (the per-tensor loop on CPU, foreach on CUDA; fused rounds differently): not fused-first
        defaults = dict(_DS_ADAM_DEFAULTS) if not torch_adam else {"fused": None}
    elif key == "lamb":
        cls = Lamb
        if params.pop("amsgrad", False):
            raise ConfigError("optimizer.params.amsgrad=true is not supported by Lamb: remove it")
    elif key == "lion":
        cls = Lion
        for ignored in _IGNORED_KEYS["lion"]:
            params.pop(ignored, None)
        defaults = dict(_DS_LION_DEFAULTS)
    else:
        classes = torch_optimizer_classes()
        if key not in classes:
            raise ConfigError(f"optimizer.type {type_name!r} is unknown; valid: {_valid_names()}")
        cls = classes[key]
    return cls, defaults


def _check_accepted(type_name: str, key: str, cls: type, params: Mapping[str, Any]) -> None:
    """Every key of ``params`` must be a parameter of ``cls``'s constructor."""
    accepted = _init_kwargs(cls)
    compat = {"adam": ["adam_w_mode", "torch_adam", "bias_correction"], "adamw": ["adam_w_mode", "torch_adam", "bias_correction"]}
    for k in params:
        if k not in accepted:
            raise ConfigError(
                f"optimizer.params.{k} is not a parameter of {type_name!r} ({cls.__module__}.{cls.__name__}); "
                f"accepted: {', '.join(compat.get(key, []) + accepted)}"
            )


def _construct(type_name: str, cls: type, params: Dict[str, Any], defaults: Dict[str, Any],
               groups: List[Any]) -> torch.optim.Optimizer:
    """``cls`` over ``groups`` with ``defaults`` then ``params`` (fused where it applies and nothing else was
    asked for); a constructor's error becomes a ConfigError naming the keys it is about."""
    kwargs = {**defaults, **params}
    if (
        "fused" not in kwargs
        and "foreach" not in kwargs
        and not kwargs.get("differentiable", False)
        and _fused_applies(cls, _all_tensors(groups))
    ):
        kwargs["fused"] = True
    try:
        optimizer = cls(groups, **kwargs)
    except (TypeError, ValueError, RuntimeError, IndexError, KeyError) as e:
        keys = _rejected_keys(str(e), params)
        if keys:
            named = ", ".join(f"optimizer.params.{k}={_shown(kwargs[k])!r}" for k in keys)
            by = type_name if type_name.lower() == cls.__name__.lower() else f"{type_name} ({cls.__name__})"
            raise ConfigError(f"{named} rejected by {by}: {_one_line(e)}") from e
        raise ConfigError(f"optimizer {type_name!r} rejected its params {params}: {_one_line(e)}") from e
    logger.debug("built %s with %s", cls.__name__, kwargs)
    return optimizer


def rebuild_optimizer(optimizer: torch.optim.Optimizer, param_groups: Sequence[Mapping[str, Any]]) -> torch.optim.Optimizer:
    """A fresh optimizer of ``type(optimizer)`` with its defaults and per-group hyper-parameters, over
    new tensors. Optimizer state is not carried over (call it before the first step); hooks neither.

    ``param_groups``: one dict per new group with ``"params"`` (the new tensors) and ``"group_index"``
    (the index of the group of ``optimizer`` whose hyper-parameters it takes; default: its own
    position). Any other key in the dict overrides that hyper-parameter for the new group.
    """
    cls = type(optimizer)
    new_groups = []
    for i, spec in enumerate(param_groups):
        spec = dict(spec)
        index = spec.pop("group_index", i)
        if not 0 <= index < len(optimizer.param_groups):
            raise IndexError(
                f"rebuild_optimizer: group_index {index} out of range: the optimizer has "
                f"{len(optimizer.param_groups)} param groups"
            )
        src = optimizer.param_groups[index]
        group = {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in src.items() if k != "params"}
        group.update(spec)
        new_groups.append(group)

    accepted = set(_init_kwargs(cls))
    kwargs = {k: v for k, v in optimizer.defaults.items() if k in accepted}
    try:
        return cls(new_groups, **kwargs)
    except TypeError:
        # A user optimizer whose constructor does not mirror its defaults: build the base object and copy
        # the instance's own attributes (everything but its parameters, state and hooks).
        new = cls.__new__(cls)
        torch.optim.Optimizer.__init__(new, new_groups, dict(optimizer.defaults))
        skip = set(vars(new)) | {"state", "param_groups", "defaults"}
        for k, v in vars(optimizer).items():
            if k not in skip:
                setattr(new, k, v)
        return new


def retarget_optimizer(optimizer: torch.optim.Optimizer,
                       param_groups: Sequence[Mapping[str, Any]]) -> torch.optim.Optimizer:
    """``optimizer`` itself, now over new tensors: its ``param_groups`` and (empty) ``state`` become those of
    :func:`rebuild_optimizer` over ``param_groups``; the object, its hooks and other attributes stay. So a
    script's own reference is the optimizer the engine steps (DeepSpeed's ZeRO wrapper likewise rewrites
    the user's optimizer's groups to point at its fp32 partitions): setting ``param_groups[i]["lr"]`` on it
    changes the engine's learning rate."""
    fresh = rebuild_optimizer(optimizer, param_groups)
    optimizer.param_groups = fresh.param_groups
    optimizer.state = fresh.state
    return optimizer
