"""``optimizer.type: "Muon"`` with DeepSpeed 0.19.8's meaning: Muon for hidden matrices, AdamW for the rest.

Routing (DeepSpeed's ``use_muon``): a parameter with two or more dimensions whose name contains neither
``embed`` nor ``lm_head`` (case-insensitive) goes to Muon; embeddings, the LM head, norms and biases go to the
auxiliary AdamW. Each of the user's param groups is split into a Muon half and an Adam half, each half keeping
the group's own ``lr`` / ``weight_decay`` (and ``momentum``, ``ns_method`` / ``betas``, ``eps``) over the
config's values; ``muon_lr`` and ``adam_lr`` override the shared ``lr`` for one half.

Defaults (DeepSpeed's ``MuonWithAuxAdam``): Muon ``lr`` 0.02, ``momentum`` 0.95 (Nesterov), ``weight_decay``
0, ``ns_method`` ``"gram"``; Adam ``lr`` 3e-4, ``betas`` (0.9, 0.95), ``eps`` 1e-10, ``weight_decay`` 0,
decoupled (``adam_w_mode: false``: L2 added to the gradient instead).

The optimizer steps any 1-D piece of a matrix: momentum and the Nesterov blend are elementwise; the
Newton-Schulz step needs the whole matrix and is delegated to a :class:`MatrixRouter` bound by the engine (at
ZeRO 1-3 each matrix is orthogonalised once in the job, by the rank that owns it:
:mod:`shardspeed.zero.muon_exchange`). Unbound, a Muon parameter must be the whole matrix.
"""
from __future__ import annotations

from types import MappingProxyType
from typing import Any, Callable, Dict, Iterable, List, Mapping, Optional, Protocol, Sequence, Tuple

import torch

from shardspeed.errors import ConfigError
from shardspeed.optim.newton_schulz import NS_METHODS, orthogonalize

__all__ = ["MuonWithAuxAdam", "use_muon", "split_muon_groups", "muon_config", "MatrixRouter", "MUON_KEYS"]

_MUON_DEFAULTS = MappingProxyType(dict(lr=0.02, momentum=0.95, weight_decay=0.0, ns_method="gram"))
_ADAM_DEFAULTS = MappingProxyType(dict(lr=3e-4, betas=(0.9, 0.95), eps=1e-10, weight_decay=0.0))
_MUON_HALF = ("lr", "momentum", "weight_decay", "ns_method")
_ADAM_HALF = ("lr", "betas", "eps", "weight_decay")
#: the config keys Muon takes (DeepSpeed's); ``adam_w_mode`` picks decoupled (default) or L2 weight decay
MUON_KEYS = ("lr", "momentum", "weight_decay", "ns_method", "muon_lr", "adam_lr", "betas", "eps", "adam_w_mode")


def use_muon(name: str, param: torch.Tensor) -> bool:
    """DeepSpeed's routing: a matrix (2+ dimensions: the layer's shape, ``ds_shape`` when zero.Init has
    partitioned it) not named like an embedding or the LM head."""
    low = name.lower()
    ndim = len(getattr(param, "ds_shape", param.shape))
    return ndim >= 2 and "embed" not in low and "lm_head" not in low


def muon_config(params: Mapping[str, Any]) -> Tuple[Dict[str, Any], Dict[str, Any], bool]:
    """(the Muon half's settings, the Adam half's, adam_w_mode) of the config's ``optimizer.params``, checked."""
    unknown = [k for k in params if k not in MUON_KEYS]
    if "per_head_muon" in unknown:
        raise ConfigError("optimizer.params.per_head_muon is not implemented for Muon in shardspeed: remove it "
                          "(each matrix is orthogonalised whole)")
    if unknown:
        raise ConfigError(f"optimizer.params.{unknown[0]} is not a parameter of 'Muon'; accepted: "
                          f"{', '.join(MUON_KEYS)}")
    muon = {k: params[k] for k in _MUON_HALF if k in params}
    adam = {k: params[k] for k in _ADAM_HALF if k in params}
    if "muon_lr" in params:
        muon["lr"] = params["muon_lr"]
    if "adam_lr" in params:
        adam["lr"] = params["adam_lr"]
    _check(dict(_MUON_DEFAULTS, **muon), dict(_ADAM_DEFAULTS, **adam))
    mode = params.get("adam_w_mode", True)
    if not isinstance(mode, bool):
        raise ConfigError(f"optimizer.params.adam_w_mode of 'Muon' must be true or false, got {mode!r}")
    return muon, adam, mode


def _number(key: str, v: Any) -> None:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or v != v or v < 0:
        raise ConfigError(f"optimizer.params.{key} of 'Muon' must be a number >= 0, got {v!r}")


def _check(muon: Mapping[str, Any], adam: Mapping[str, Any]) -> None:
    for key in ("lr", "momentum", "weight_decay"):
        _number(key, muon[key])
    for key in ("lr", "eps", "weight_decay"):
        _number(key, adam[key])
    if muon["ns_method"] not in NS_METHODS:
        raise ConfigError(f"optimizer.params.ns_method of 'Muon' must be one of {', '.join(NS_METHODS)}, "
                          f"got {muon['ns_method']!r}")
    betas = adam["betas"]
    if not (isinstance(betas, (list, tuple)) and len(betas) == 2
            and all(isinstance(b, (int, float)) and not isinstance(b, bool) and 0 <= b < 1 for b in betas)):
        raise ConfigError(f"optimizer.params.betas of 'Muon' must be 2 numbers in [0, 1), got {betas!r}")


def split_muon_groups(groups: Sequence[Mapping[str, Any]], names: Mapping[int, str],
                      params: Mapping[str, Any]) -> List[Dict[str, Any]]:
    """Each group split into its Muon half and its Adam half (empty halves dropped), DeepSpeed's order and
    names (``muon-params`` / ``adam-params``, ``group<i>-`` prefixed when there are several); ``names``:
    ``{id(param): qualified name}``. Settings: the defaults, then the config's, then the group's own."""
    muon_cfg, adam_cfg, _ = muon_config(params)
    out: List[Dict[str, Any]] = []
    for index, group in enumerate(groups):
        own = {k: v for k, v in group.items() if k != "params"}
        trainable = [p for p in group["params"] if p.requires_grad]
        for flag, label, keys, base in ((True, "muon", _MUON_HALF, dict(_MUON_DEFAULTS, **muon_cfg)),
                                        (False, "adam", _ADAM_HALF, dict(_ADAM_DEFAULTS, **adam_cfg))):
            half = [p for p in trainable if use_muon(names.get(id(p), ""), p) is flag]
            if not half:
                continue
            settings = dict(base, **{k: v for k, v in own.items() if k in keys})
            if "betas" in settings:
                settings["betas"] = tuple(settings["betas"])
            prefix = own.get("name") or (f"group{index}" if len(groups) > 1 else None)
            name = f"{prefix}-{label}-params" if prefix else f"{label}-params"
            out.append(dict(params=half, use_muon=flag, name=name, **settings))
    return out


class MatrixRouter(Protocol):
    """Whole-matrix Newton-Schulz for pieces of matrices: given this rank's updates ``{id(piece): update}``
    and ``fn(group position, shape, whole update)``, this rank's pieces of the orthogonalised updates."""

    def orthogonalize(self, updates: Dict[int, torch.Tensor],
                      fn: Callable[[int, torch.Size, torch.Tensor], torch.Tensor]) -> Dict[int, torch.Tensor]: ...

    def update_norm(self, tensors: Mapping[int, torch.Tensor]) -> float: ...

    def clip_coefficient(self, norm: float, clip: float) -> float: ...


class MuonWithAuxAdam(torch.optim.Optimizer):
    """Muon over the groups with ``use_muon`` true, AdamW (or Adam with L2, ``adam_w_mode=False``) over the
    others. State: ``momentum_buffer`` per Muon tensor; ``exp_avg``, ``exp_avg_sq``, ``step`` per Adam tensor.

    Bound to a router (ZeRO 1-3), the engine steps every piece in one call (the router exchanges all matrices
    at once) and leaves clipping to the step (:meth:`clip_updates_to`): DeepSpeed takes the global norm over
    the orthogonalised Muon updates and the AdamW gradients, reports it as the gradient norm, and clips both
    by it."""

    def __init__(self, params: Iterable[Dict[str, Any]], adam_w_mode: bool = True):
        groups = [dict(g) for g in params]
        for g in groups:
            if "use_muon" not in g:
                raise ConfigError("MuonWithAuxAdam: every param group needs use_muon (true for Muon, false for Adam)")
            for k, v in (_MUON_DEFAULTS if g["use_muon"] else _ADAM_DEFAULTS).items():
                g.setdefault(k, v)
        super().__init__(groups, {})
        self.adam_w_mode = adam_w_mode
        self.router: Optional[MatrixRouter] = None
        self._update_clip: Optional[float] = None
        #: the global norm over the last step's updates (after :meth:`clip_updates_to`), before clipping
        self.update_norm = 0.0

    def bind(self, router: MatrixRouter) -> None:
        """Orthogonalise through ``router`` (the engine's: its pieces are parts of matrices)."""
        self.router = router

    def clip_updates_to(self, clip: float) -> None:
        """For the next step: take the global norm over the updates (:attr:`update_norm`) and, when ``clip``
        > 0, scale them by DeepSpeed's clip factor of it. Needs a bound router."""
        self._update_clip = clip

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        stepped, done = self._muon_updates()
        clip, self._update_clip = self._update_clip, None
        if clip is not None and self.router is not None:
            self._clip_updates(done, clip, self.router)
        for group in self.param_groups:
            if not group["use_muon"]:
                self._adam_group(group)
        for p, group in stepped:
            p.mul_(1 - group["lr"] * group["weight_decay"])
            p.add_(done[id(p)].reshape(p.shape).to(p.device), alpha=-group["lr"])  # host masters: from the device
        return loss

    def _clip_updates(self, done: Dict[int, torch.Tensor], clip: float, router: MatrixRouter) -> None:
        """The norm over the Muon updates and the AdamW gradients; both scaled by its clip factor."""
        tensors = dict(done)
        tensors.update((id(p), p.grad) for g in self.param_groups if not g["use_muon"] for p in g["params"]
                       if p.grad is not None)
        self.clip_together(tensors, clip)

    def clip_together(self, tensors: Dict[int, torch.Tensor], clip: float) -> None:
        """DeepSpeed's ZeRO 1-3 clipping over ``tensors`` (``{id(optimizer tensor): orthogonalised update or
        AdamW gradient}``, this rank's): their global norm into :attr:`update_norm`, and, when ``clip`` > 0,
        every tensor scaled in place by its clip factor. Needs a bound router (a sync point)."""
        if self.router is None:
            raise ConfigError("MuonWithAuxAdam: clipping over the updates needs a bound router")
        self.update_norm = self.router.update_norm(tensors)
        if clip <= 0:
            return
        coef = self.router.clip_coefficient(self.update_norm, clip)
        if coef < 1.0:
            for t in tensors.values():
                t.mul_(coef)

    @staticmethod
    def nesterov_update(grad: torch.Tensor, momentum_buffer: torch.Tensor, momentum: float) -> torch.Tensor:
        """Muon's elementwise half on any piece: the momentum takes ``grad`` (in place) and the Nesterov blend
        of the two is returned (Newton-Schulz then runs on the whole matrix of such blends)."""
        momentum_buffer.lerp_(grad, 1 - momentum)
        return grad.lerp(momentum_buffer, momentum)

    def orthogonalized(self, updates: Dict[int, torch.Tensor]) -> Dict[int, torch.Tensor]:
        """``{id(optimizer tensor): Nesterov blend}`` of this rank's Muon pieces, orthogonalised through the
        bound router (each whole matrix once in the job): this rank's pieces of the results."""
        if self.router is None:
            raise ConfigError("MuonWithAuxAdam: pieces of matrices need a bound router")
        methods = [g.get("ns_method", "gram") for g in self.param_groups]
        return self.router.orthogonalize(updates, lambda gi, shape, u: orthogonalize(u, shape, methods[gi]))

    def _adam_group(self, group: Dict[str, Any]) -> None:
        beta1, beta2 = group["betas"]
        lr, wd, eps = group["lr"], group["weight_decay"], group["eps"]
        for p in group["params"]:
            if p.grad is None:
                continue
            g = p.grad if self.adam_w_mode or wd == 0 else p.grad.add(p, alpha=wd)
            st = self.state[p]
            if not st:
                st["exp_avg"], st["exp_avg_sq"], st["step"] = torch.zeros_like(p), torch.zeros_like(p), 0
            st["step"] += 1
            st["exp_avg"].lerp_(g, 1 - beta1)
            st["exp_avg_sq"].lerp_(g.square(), 1 - beta2)
            m_hat = st["exp_avg"] / (1 - beta1 ** st["step"])
            v_hat = st["exp_avg_sq"] / (1 - beta2 ** st["step"])
            if self.adam_w_mode:
                p.mul_(1 - lr * wd)
            p.add_(m_hat / (v_hat.sqrt() + eps), alpha=-lr)

    def _muon_updates(self) -> Tuple[List[Tuple[torch.Tensor, Dict[str, Any]]], Dict[int, torch.Tensor]]:
        """Momentum and the Nesterov blend per tensor, Newton-Schulz per whole matrix: the tensors stepped (with
        their groups) and their updates."""
        updates: Dict[int, torch.Tensor] = {}
        stepped: List[Tuple[torch.Tensor, Dict[str, Any]]] = []
        for group in self.param_groups:
            if not group["use_muon"]:
                continue
            for p in group["params"]:
                if p.grad is None:
                    continue
                st = self.state[p]
                if not st:
                    st["momentum_buffer"] = torch.zeros_like(p)
                updates[id(p)] = self.nesterov_update(p.grad, st["momentum_buffer"], group["momentum"])
                stepped.append((p, group))
        if self.router is not None:
            done = self.orthogonalized(updates)
        else:
            for p, _ in stepped:
                if p.dim() < 2:
                    raise ConfigError("MuonWithAuxAdam: a Muon parameter is not a whole matrix and no router is "
                                      "bound; build it through shardspeed.initialize")
            done = {id(p): orthogonalize(updates[id(p)], p.shape, g.get("ns_method", "gram")) for p, g in stepped}
        return stepped, done
