"""The engine's side of ``optimizer.type: "Muon"``: its param groups split as DeepSpeed splits them, the
configurations it refuses, and the optimizer bound to the exchange that orthogonalises each matrix once
(:mod:`shardspeed.zero.muon_exchange`)."""
from __future__ import annotations

from typing import Any, Dict, List, Optional

import torch.nn as nn

from ..comm.collectives import Collectives
from ..errors import ConfigError
from ..optim.muon import MuonWithAuxAdam, split_muon_groups
from ..zero.master import MasterWeights
from ..zero.muon_exchange import build_exchange

__all__ = ["muon_groups", "bind_muon"]


def _is_muon(optimizer_cfg: Any) -> bool:
    return optimizer_cfg is not None and str(getattr(optimizer_cfg, "type", "")).lower() == "muon"


def muon_groups(optimizer_cfg: Any, model: nn.Module, groups: List[dict], *, experts: bool) -> List[dict]:
    """``groups`` split into Muon and Adam halves when the config's optimizer is Muon (else as they are); MoE
    experts are refused by name (optimizer offload is refused by the plan)."""
    if not _is_muon(optimizer_cfg):
        return groups
    if experts:
        raise ConfigError("optimizer.type 'Muon' with MoE experts is not implemented in shardspeed: use AdamW")
    names = {id(p): n for n, p in model.named_parameters()}
    return split_muon_groups(groups, names, dict(getattr(optimizer_cfg, "params", None) or {}))


def bind_muon(master: MasterWeights, collectives: Collectives, group_of: Dict[int, int]) -> None:
    """Bind a :class:`MuonWithAuxAdam` engine optimizer to the exchange over ``master``'s units."""
    opt = master.optimizer
    if not isinstance(opt, MuonWithAuxAdam):
        return
    position = {gi: pos for pos, gi in enumerate(master.group_indices)}

    def group_pos(p: nn.Parameter) -> Optional[int]:
        pos = position.get(group_of.get(id(p), -1))
        return pos if pos is not None and opt.param_groups[pos]["use_muon"] else None

    opt.bind(build_exchange(master.units, master.trainable_pieces, master.piece_tensors, group_pos, collectives))
    master.step_over_updates(opt)
