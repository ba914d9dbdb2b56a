"""The tuning space: candidates (pure data) and how one becomes a DeepSpeed config.

A :class:`Candidate` is one point: ZeRO stage, micro-batch × gradient accumulation (their product times
the data-parallel size is the user's global batch, always), optimizer/parameter offload to CPU, the
gradient bucket size, activation checkpointing, the tensor-parallel degree (``tensor_parallel.autotp_size``)
and the sequence-parallel degree (``sequence_parallel_size``): the data-parallel size is the world over
both. :func:`sequence_parallel_sizes` offers SP degrees only when the sequence is long (the estimator's
activations per rank above the model states). :func:`enumerate_candidates` lists every valid point
of a :class:`TuningSpace`; :func:`apply_candidate` writes one into a copy of the user's config, changing
only the keys it tunes.

Activation checkpointing is a dimension only when the engine can switch it from the config:
:data:`ACTIVATION_CHECKPOINTING_KEY` names that key (None would take the dimension out; with it the
space offers both values and the cost model charges the recompute).
"""
from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Dict, List, Optional, Sequence, Tuple

from shardspeed.errors import ConfigError

if TYPE_CHECKING:
    from shardspeed.plan import Plan

#: Dotted config key of the engine's activation-checkpointing switch (``activation_checkpointing.enabled``,
#: shardspeed's extension key: every transformer block checkpointed; DeepSpeed ignores it). None would
#: take the dimension out of the search.
ACTIVATION_CHECKPOINTING_KEY: Optional[str] = "activation_checkpointing.enabled"

_MiB = 1 << 20


@dataclass(frozen=True, order=True)
class Candidate:
    """One configuration the tuner may run."""

    stage: int
    micro_batch: int
    grad_accum: int
    offload_optimizer: bool = False
    offload_param: bool = False
    reduce_bucket_size: Optional[int] = None  # elements; None: the user's
    activation_checkpointing: bool = False
    tp: int = 1  # tensor-parallel degree (tensor_parallel.autotp_size)
    sp: int = 1  # sequence-parallel degree (sequence_parallel_size)

    def dp_size(self, world: int) -> int:
        """The data-parallel size at ``world`` ranks (the world over the tensor- and sequence-parallel degrees)."""
        return world // (self.tp * self.sp)

    @property
    def name(self) -> str:
        """A directory-safe name, e.g. ``z2_mbs4_gas2_oo``."""
        parts = [f"z{self.stage}", f"mbs{self.micro_batch}", f"gas{self.grad_accum}"]
        if self.offload_optimizer:
            parts.append("oo")
        if self.offload_param:
            parts.append("op")
        if self.reduce_bucket_size is not None:
            parts.append(f"rb{self.reduce_bucket_size}")
        if self.activation_checkpointing:
            parts.append("ckpt")
        if self.tp > 1:
            parts.append(f"tp{self.tp}")
        if self.sp > 1:
            parts.append(f"sp{self.sp}")
        return "_".join(parts)


@dataclass(frozen=True)
class TuningSpace:
    """The values each dimension may take (a candidate is any valid combination)."""

    stages: Tuple[int, ...] = (0, 1, 2, 3)
    micro_batches: Tuple[int, ...] = (1, 2, 4, 8)
    offload_optimizer: Tuple[bool, ...] = (False, True)
    offload_param: Tuple[bool, ...] = (False, True)
    reduce_bucket_sizes: Tuple[Optional[int], ...] = (None,)
    activation_checkpointing: Tuple[bool, ...] = (False,)
    tp_sizes: Tuple[int, ...] = (1,)
    sp_sizes: Tuple[int, ...] = (1,)


def sequence_parallel_sizes(shape: Any, seq_len: int, world: int, num_params: int, elem_bytes: int = 4,
                            checkpointing: bool = True) -> Tuple[int, ...]:
    """SP degrees worth searching for ``seq_len``-token samples of a transformer of ``shape``
    (:class:`~shardspeed.estimate.activations.TransformerShape`): (1,) while one rank's activations at SP 1
    (:func:`~shardspeed.estimate.long_context.long_context_activations`, micro-batch 1) stay below its model
    states at ZeRO 3 (16 bytes per parameter over the world); else also every degree > 1 dividing the world
    and the attention heads (Ulysses)."""
    from shardspeed.estimate.long_context import long_context_activations

    act = long_context_activations(shape, 1, int(seq_len), elem_bytes, checkpointing=checkpointing)
    if act.device_peak + act.host_bytes <= 16.0 * num_params / max(1, world):
        return (1,)
    return tuple(p for p in range(1, world + 1) if world % p == 0 and shape.n_head % p == 0)


def micro_batch_sizes(per_rank_batch: int, lo: int = 1, hi: int = 1024) -> Tuple[int, ...]:
    """Micro-batches that divide the per-rank batch (so the global batch is kept), within [lo, hi]."""
    return tuple(m for m in range(max(lo, 1), min(hi, per_rank_batch) + 1) if per_rank_batch % m == 0)


def default_space(global_batch: int, world: int, *, fast: bool = True, mbs_range: Tuple[int, int] = (1, 1024),
                  bucket_sizes: Sequence[int] = (5 * _MiB, 50 * _MiB), tp_sizes: Sequence[int] = (1,),
                  sp_sizes: Sequence[int] = (1,)) -> TuningSpace:
    """Every stage, every micro-batch dividing a per-rank batch, offload on/off; bucket sizes only when
    not ``fast`` (DeepSpeed's meaning of the flag); checkpointing when the engine can switch it; the
    tensor-parallel degrees given that divide ``world``; the sequence-parallel degrees given (see
    :func:`sequence_parallel_sizes`) that divide the world with a tensor-parallel degree and keep the batch."""
    tps = tuple(t for t in tp_sizes if t >= 1 and world % t == 0 and global_batch % (world // t) == 0)
    if not tps:
        sizes = sorted({world // t for t in tp_sizes if t >= 1 and world % t == 0} or {world})
        raise ConfigError(f"the global batch {global_batch} is not a multiple of the data-parallel size "
                          f"{' or '.join(map(str, sizes))}")
    sps = tuple(s for s in sp_sizes if s >= 1 and any(world % (t * s) == 0 and global_batch % (world // (t * s)) == 0
                                                   for t in tps)) or (1,)
    per_rank = sorted({global_batch // (world // (t * s)) for t in tps for s in sps
                       if world % (t * s) == 0 and global_batch % (world // (t * s)) == 0})
    mbs = tuple(sorted({m for b in per_rank for m in micro_batch_sizes(b, *mbs_range)}))
    if not mbs:
        raise ConfigError(f"no micro-batch in [{mbs_range[0]}, {mbs_range[1]}] divides the per-rank batch "
                          f"{' or '.join(map(str, per_rank))}; widen min/max_train_micro_batch_size_per_gpu")
    buckets: Tuple[Optional[int], ...] = (None,) if fast else (None, *bucket_sizes)
    ckpt = (False, True) if ACTIVATION_CHECKPOINTING_KEY else (False,)
    return TuningSpace(micro_batches=mbs, reduce_bucket_sizes=buckets, activation_checkpointing=ckpt, tp_sizes=tps,
                       sp_sizes=sps)


def _meaningful(stage: int, oo: bool, op: bool, dp: int) -> bool:
    """Offload only where the stage allows it (optimizer: stages 1-3, parameters: stage 3). With one
    data-parallel rank ZeRO partitions nothing: stage 0, and the offloads (stage 1 with the optimizer's,
    stage 3 with both), are the distinct configs."""
    if (oo and stage == 0) or (op and stage != 3):
        return False
    if dp == 1:
        return (stage, oo, op) in ((0, False, False), (1, True, False), (3, True, True))
    return True


def enumerate_candidates(space: TuningSpace, global_batch: int, world: int) -> List[Candidate]:
    """Every valid candidate at ``world`` ranks: for each tensor- and sequence-parallel degree whose product
    divides the world, the micro-batches that divide that data-parallel size's per-rank batch, the stages and
    offloads that mean something (:func:`_meaningful`; ZeRO partitions over data x sequence)."""
    out: List[Candidate] = []
    for tp, sp in [(t, s) for t in space.tp_sizes for s in space.sp_sizes]:
        if world % (tp * sp) or global_batch % (world // (tp * sp)):
            continue
        dp = world // (tp * sp)
        per_rank = global_batch // dp
        for stage in space.stages:
            for mbs in space.micro_batches:
                if per_rank % mbs:
                    continue
                for oo in space.offload_optimizer:
                    for op in space.offload_param:
                        if not _meaningful(stage, oo, op, dp * sp):
                            continue
                        for rb in space.reduce_bucket_sizes:
                            for ck in space.activation_checkpointing:
                                out.append(Candidate(stage, mbs, per_rank // mbs, oo, op, rb, ck, tp, sp))
    return out


def _offload_block(user: Any) -> Dict[str, Any]:
    """The user's offload block kept where it says cpu (pin_memory, ...), else a plain cpu one."""
    if isinstance(user, dict) and user.get("device") == "cpu":
        return dict(user)
    return {"device": "cpu"}


def apply_candidate(user_config: Dict[str, Any], cand: Candidate, world: int) -> Dict[str, Any]:
    """A copy of the user's config with the candidate's values at ``world`` ranks; every other section is
    kept as given."""
    cfg = copy.deepcopy(user_config)
    cfg["train_batch_size"] = cand.micro_batch * cand.grad_accum * cand.dp_size(world)
    cfg["train_micro_batch_size_per_gpu"] = cand.micro_batch
    cfg["gradient_accumulation_steps"] = cand.grad_accum
    zero = cfg.get("zero_optimization")
    zero = dict(zero) if isinstance(zero, dict) else {}
    for old in ("cpu_offload", "cpu_offload_param"):  # deprecated spellings of the blocks set below
        zero.pop(old, None)
    zero["stage"] = cand.stage
    if cand.offload_optimizer:
        zero["offload_optimizer"] = _offload_block(zero.get("offload_optimizer"))
    else:
        zero.pop("offload_optimizer", None)
    if cand.offload_param:
        zero["offload_param"] = _offload_block(zero.get("offload_param"))
    else:
        zero.pop("offload_param", None)
    if cand.reduce_bucket_size is not None:
        zero["reduce_bucket_size"] = cand.reduce_bucket_size
        zero["allgather_bucket_size"] = cand.reduce_bucket_size
    cfg["zero_optimization"] = zero
    if ACTIVATION_CHECKPOINTING_KEY:
        _set_dotted(cfg, ACTIVATION_CHECKPOINTING_KEY, cand.activation_checkpointing)
    if cand.tp > 1 or isinstance(cfg.get("tensor_parallel"), dict):
        _set_dotted(cfg, "tensor_parallel.autotp_size", cand.tp)
    if cand.sp > 1 or "sequence_parallel_size" in cfg:
        cfg["sequence_parallel_size"] = cand.sp
    return cfg


def _set_dotted(cfg: Dict[str, Any], dotted: str, value: Any) -> None:
    *heads, last = dotted.split(".")
    node = cfg
    for h in heads:
        node = node.setdefault(h, {})
    node[last] = value


def user_plan(user_config: Dict[str, Any], world: int) -> Plan:
    """The plan of the user's own config at ``world`` ranks (its ``autotuning`` block aside), as
    :func:`shardspeed.plan.decide` makes it: the tuner keeps its global batch and starts from its
    tensor-parallel degree and gradient bucket size. A config that cannot train at ``world`` ranks is
    decide's ConfigError."""
    from shardspeed.plan import decide

    return decide({k: v for k, v in user_config.items() if k != "autotuning"}, world)


def user_global_batch(user_config: Dict[str, Any], world: int) -> int:
    """The global batch the user's config trains with at ``world`` ranks (what the tuner keeps; its data-parallel
    size is the world over the plan's model-parallel dimensions)."""
    return user_plan(user_config, world).batch.global_batch
