"""Which modules own stage-3 units (:func:`select_units`, pure) and building a model's stage-3 units and
their :class:`~shardspeed.zero.root.ZeroRoot` (:func:`build_stage3_units`)."""
from __future__ import annotations

from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.nn as nn

from ..comm.collectives import Collectives
from ..comm.quantize import BlockCodec
from ..utils.z3_leaf_module import z3_leaf_module
from .owned_unit import ReducePolicy
from .placement import DevicePlacement, ShardPlacement
from .root import GatherPolicy, ZeroRoot
from .tags import init_shard_of
from .unit import ShardedParamUnit


def param_numel(p: torch.Tensor) -> int:
    """Elements of a parameter, also when zero.Init left only an empty placeholder in ``.data``."""
    info = init_shard_of(p)
    return info.numel if info is not None else p.numel()


_CONTAINERS = (nn.ModuleList, nn.ModuleDict)  # hold modules but are never called themselves


def select_units(module: nn.Module, max_numel: int) -> List[Tuple[nn.Module, List[nn.Parameter]]]:
    """Partition ``module``'s parameters into units: (owning module, parameters).

    Top-down: a called module whose parameters (those not taken yet) number at most ``max_numel`` becomes
    one unit with all of them (so a transformer block is one unit, as with FSDP2's per-block wrapping);
    a larger one is split among its children, and what is left under it (its own parameters and children
    smaller than ``max_numel / 8``) becomes its unit. Containers (ModuleList/ModuleDict) are never called,
    so they never own a unit. Each parameter appears once: tied parameters go to the first unit that
    reaches them. A unit's owner is always a module whose forward runs, which is what gathers it. A module
    flagged as a ZeRO-3 leaf (:func:`shardspeed.utils.set_z3_leaf_modules`) is one unit whatever its size.
    """
    claimed: set = set()
    units: List[Tuple[nn.Module, List[nn.Parameter]]] = []
    min_child = max(1, max_numel // 8)

    def unclaimed(m: nn.Module) -> List[nn.Parameter]:
        out, seen = [], set()
        for p in m.parameters():
            if id(p) not in claimed and id(p) not in seen:
                seen.add(id(p))
                out.append(p)
        return out

    def take(m: nn.Module, params: List[nn.Parameter]) -> None:
        if params:
            claimed.update(id(p) for p in params)
            units.append((m, params))

    def assign(m: nn.Module) -> None:
        params = unclaimed(m)
        size = sum(param_numel(p) for p in params)
        if not params:
            return
        container = isinstance(m, _CONTAINERS)
        small = size <= max_numel or not any(True for _ in m.children())
        if m is not module and not container and (small or z3_leaf_module(m)):  # a leaf: one unit, any size
            take(m, params)
            return
        for child in m.children():
            child_size = sum(param_numel(p) for p in unclaimed(child))
            if child_size >= min_child or container or isinstance(child, _CONTAINERS):
                assign(child)
        if not container:
            take(m, unclaimed(m))

    assign(module)
    return units


def unit_max_numel(total: int, prefetch_bucket_size: int) -> int:
    """Largest unit: the prefetch bucket (so the next unit can be prefetched), and at most a quarter of the
    model (so even a small model is split and its parameters are never all gathered at once)."""
    cap = int(prefetch_bucket_size) if prefetch_bucket_size and prefetch_bucket_size > 0 else total
    return max(1, min(cap, total // 4))


def build_stage3_units(model: nn.Module, sharding, collectives: Collectives, rank: int, policy: ReducePolicy,
                       placement: Callable[[], ShardPlacement] = DevicePlacement,
                       secondary: Optional[Collectives] = None, expert_comm: Optional[Collectives] = None,
                       is_expert: Callable[[nn.Parameter], bool] = lambda p: False,
                       epilogue_timer: Optional[Callable] = None) -> ZeroRoot:
    """Shard ``model``'s parameters into units and hook them under one root; each unit's shard is held by a
    new ``placement()`` (device, host or file, as the builder decided). ``sharding``: the plan's
    :class:`~shardspeed.plan.ShardingPlan` (prefetch bucket, persistence threshold, live parameters, ZeRO++).
    ``secondary``: hpZ's collectives within this rank's node. ``expert_comm``: the expert-data group's
    collectives, over which the parameters ``is_expert`` picks are sharded (in units of their own)."""
    all_params = list(dict.fromkeys(model.parameters()))
    total = sum(param_numel(p) for p in all_params)
    selected = select_units(model, unit_max_numel(total, sharding.prefetch_bucket))
    units: List[ShardedParamUnit] = []
    owners: List[nn.Module] = []
    for owner, params in selected:
        # one flat buffer has one dtype; frozen and trainable parameters apart, so that every rank owns its
        # share of the trainable elements (a LoRA adapter after its frozen base weight would otherwise sit on
        # the last rank) and autograd's use of frozen weights is tracked on its own (OwnedUnit.post_backward)
        by_kind: Dict[Tuple[torch.dtype, bool, bool], List[nn.Parameter]] = {}
        for p in params:
            by_kind.setdefault((p.dtype, p.requires_grad, expert_comm is not None and is_expert(p)), []).append(p)
        for (_, _, expert), plist in by_kind.items():
            comm = expert_comm if expert and expert_comm is not None else collectives
            units.append(ShardedParamUnit(plist, world=comm.world, rank=comm.topology.shard_rank, index=len(units),
                                          group=comm.group, placement=placement()))
            if expert:
                units[-1].comm = comm
            owners.append(owner)
    gather = GatherPolicy(int(sharding.prefetch_bucket), int(sharding.persistence_threshold),
                          int(sharding.max_live_parameters), _weight_codec(sharding.zeropp),
                          sharding.zeropp.weights == "frozen")
    timer = {"epilogue_timer": epilogue_timer} if epilogue_timer is not None else {}
    return ZeroRoot(units, collectives, policy, max_buckets=sharding.buckets_alive,
                    coalesce_numel=small_unit_numel(units), max_alive_numel=largest_unit_numel(units),
                    module=model, owners=owners, gather=gather, secondary=secondary, **timer)


def small_unit_numel(units: Sequence[ShardedParamUnit]) -> int:
    """Stage 3's coalescing threshold: an eighth of the median trainable unit (as small children are left to
    their parent's unit in unit selection; the median, so that one huge embedding does not make every other
    unit "small"). Units below it (norms, biases, small heads) are reduced in groups of about that size: fewer
    collectives, and never more than an eighth of a typical unit held back."""
    sizes = sorted(u.layout.padded_numel for u in units if u.grad_params)
    return sizes[len(sizes) // 2] // 8 if sizes else 0


def largest_unit_numel(units: Sequence[ShardedParamUnit]) -> int:
    """Stage 3's bound on gradient buckets alive at once, in elements: one largest trainable unit's worth."""
    return max((u.layout.padded_numel for u in units if u.grad_params), default=0)


def _weight_codec(zeropp) -> Optional[BlockCodec]:
    """qwZ's codec, from the plan's :class:`~shardspeed.plan.ZeroPlusPlan` (None: gathers stay exact)."""
    return BlockCodec(zeropp.weight_bits, zeropp.block) if zeropp.weights != "none" else None
