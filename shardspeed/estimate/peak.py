"""One job: the per-rank peak memory of a training step (model states, gradient buckets, gathered units, activations).

:func:`estimate_peak` prices a :class:`~shardspeed.plan.Plan` (made by :func:`shardspeed.plan.decide` from the
config, or given) for a :class:`~.model.ModelSpec`; pure arithmetic that mirrors what the engine allocates
(see docs/memory.md for each term and where in the code it comes from). Every decision is the plan's:

- parameters: unpartitioned (stages 0-2) the whole flat model in the compute dtype; partitioned (stage 3) a 1/N
  shard, where ``placement.params`` puts it (the device, the host, a file).
- gradients: reduced only at the accumulation boundary (stages 0-1, and 2-3 in a pipeline) the full-size flat
  buckets in the accumulation dtype, kept across micro-steps; reduced every micro-step (stages 2-3) a 1/N
  accumulator and, during backward, full-size unit buckets: at most ``sharding.buckets_alive`` (stage 2:
  two reductions in flight and one filling), or one largest unit's worth (stage 3). Units are
  ``sharding.reduce_bucket`` groups of parameters, or the stage-3 units.
- master weights: a separate fp32 (bf16 with ``bf16_master_weights_and_grads``; states bf16 with
  ``bf16_optimizer_states``, else fp32) shard
  unless the compute dtype is the master's and nothing is offloaded
  (then the parameter shard *is* the master); optimizer states: bytes per element of the optimizer (Adam 8) on
  the shard. Both go where ``placement.optimizer`` says: the host (plus two fp32 gradient tiles of
  ``tile_elems``) or files (plus the streaming pool, ``buffer_count`` × 3 tiles).
- stage 3 gathered units: the root's unit (kept from forward to backward), the unit in use and the prefetch
  window (``prefetch_bucket`` elements ahead, within ``max_live_parameters``), and units under
  ``persistence_threshold`` (kept gathered); ZeRO++: hpZ's secondary partition (Ψ/hpz) and the codes of one
  unit in flight.
- activations: a traced :class:`~.activations.ActivationProfile` (exact for that model and shape) or the
  Korthikanti formulas; with a pipeline, ``min(pp, accumulation_steps)`` micro-batches in flight.
- start-up: the model is built whole on every rank (its parameters in the dtype it was built in) and the
  flat buffers are filled unit by unit, unless it was built under ``zero.Init`` (then one shard plus the
  largest parameter being assembled).

"device" is the training device; "host" is CPU memory; on a CPU-only machine both are the same RAM.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any, Dict, List, Optional, Tuple

import torch

from ..errors import ConfigError
from ..plan import MeshPlan, Plan
from ..utils.direct_io import aligned_size
from ..zero.gather_order import PREFETCH_UNITS
from .activations import ActivationProfile, formula_activations
from .model import ModelSpec
from .planning import (
    OPTIMIZER_STATE_BYTES,
    optimizer_name,
    optimizer_state_bytes,
    plan_for,
    state_bytes,
    steps_in_tiles,
)
from .states import estimate_model_state_memory

__all__ = ["OPTIMIZER_STATE_BYTES", "PeakEstimate", "estimate_peak", "paper_table"]

Terms = Dict[str, float]


@dataclass(frozen=True)
class PeakEstimate:
    """Predicted per-rank peak bytes. ``device`` / ``host``: the larger of the training-step peak and the
    start-up peak on each; ``terms``: the parts (bytes; ``*_host`` on the host) of the training-step phase with the larger peak,
    ``phase`` ("backward": the start of a backward, activations all alive; "step": the optimizer step;
    "loss": the loss and the logits' gradient, priced when the profile gives ``loss_bytes``);
    ``model_states``: parameters, gradients (the full buckets at stages 0-1, the 1/N accumulator at 2-3), master
    weights and optimizer states as the optimizer step sees them (the ZeRO paper's quantities);
    ``startup_device`` / ``startup_host``: while the engine is being built; ``nvme``: bytes of files per rank;
    ``activations_source``: "traced" or "formula"."""

    device: float
    host: float
    terms: Dict[str, float] = field(default_factory=dict)
    phase: str = "backward"
    model_states: Dict[str, float] = field(default_factory=dict)
    startup_device: float = 0.0
    startup_host: float = 0.0
    nvme: float = 0.0
    activations_source: str = "formula"

    @property
    def total(self) -> float:
        """Device + host at the worst moment (phases are not summed across: the memory of a CPU-only machine)."""
        return max(sum(self.terms.values()), self.startup_device + self.startup_host)

    def fits(self, device_bytes: Optional[float] = None, host_bytes: Optional[float] = None,
             shared: bool = False) -> bool:
        """Whether the peak fits in ``device_bytes`` / ``host_bytes`` (None: not checked); ``shared``: device
        and host are the same memory (a CPU-only machine): the sum must fit in ``host_bytes``."""
        if shared:
            return host_bytes is None or self.total <= host_bytes
        return ((device_bytes is None or self.device <= device_bytes)
                and (host_bytes is None or self.host <= host_bytes))

    def as_dict(self) -> Dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class _Sizes:
    """Elements and bytes per element one rank works with: ``psi`` its model-parallel slice, ``shard`` the
    optimizer's share of it, ``units`` the slice's units (flat buckets or stage-3 units)."""

    psi: float
    n_dp: int
    shard: float
    units: List[float]
    t_b: int
    g_b: int
    o_b: float
    gas: int
    act: ActivationProfile
    largest: float = 0.0  # elements of the largest parameter (of the slice)


def _dtype_bytes(dtype: torch.dtype) -> int:
    return torch.empty(0, dtype=dtype).element_size()


def _bucket_sizes(numels, max_elements: int) -> list:
    """Stage 0-2 units: parameters in reverse registration order (the order gradients arrive) grouped by
    ``reduce_bucket_size`` elements, as the builder groups them."""
    from ..zero.layout import group_by_size

    rev = list(reversed(numels))
    return [sum(rev[i] for i in g) for g in group_by_size(rev, max(1, max_elements))]


def _gathered_stage3(units, prefetch: int, max_live: int, persistence: int) -> float:
    """Elements gathered at once at stage 3: the root unit (last in ``units``), the largest other unit in use,
    the prefetch window behind it (at most ``PREFETCH_UNITS`` units within the bucket, as the parameter
    manager gathers ahead) and the persistent (small) units."""
    if not units:
        return 0.0
    root, others = units[-1], list(units[:-1]) or [0]
    largest = max(others)
    budget = max(0, min(prefetch, max_live - largest - root))
    window, run = 0, 0
    for i in range(len(others)):  # the largest prefetch window over the traced order
        run = 0
        for n in others[i + 1 : i + 1 + PREFETCH_UNITS]:
            if run + n > budget:
                break
            run += n
        window = max(window, run)
    persistent = sum(n for n in others if n < persistence)
    return float(min(sum(units), root + largest + window + persistent))


def estimate_peak(spec: ModelSpec, config: Any = None, *, world_size: int = 1, tp: Optional[int] = None,
                  pp: Optional[int] = None, micro_batch: Optional[int] = None, seq_len: Optional[int] = None,
                  checkpointing: Optional[bool] = None, zero_init: bool = False,
                  built_dtype: torch.dtype = torch.float32, sequence_parallel: Optional[bool] = None,
                  mesh: Optional[MeshPlan] = None, plan: Optional[Plan] = None) -> PeakEstimate:
    """Per-rank peak bytes (device, host) for training ``spec`` with ``config`` on ``world_size`` ranks split
    into ``tp`` tensor-parallel × ``pp`` pipeline × data-parallel ranks: the price of
    :func:`~.planning.plan_for` (``decide`` with the model facts ``tp`` and ``pp``; None or 1 leave them to
    the config's ``tensor_parallel.autotp_size`` and ``pipeline.stages``; ``mesh``: sizes from elsewhere).
    ``plan``: price this plan instead (``config`` then only names the optimizer; the sizes are the plan's).

    ``micro_batch`` (default: the plan's) and ``seq_len`` (default: the profile's, else the model's positions)
    size the activations; ``checkpointing`` (default: the config's ``activation_checkpointing`` when it has
    one, else the profile's setting) recomputes each transformer block in backward; ``sequence_parallel``
    (default: the plan's). ``zero_init``: the model is built under ``shardspeed.zero.Init`` (never whole);
    ``built_dtype``: the dtype the model is built in. Raises ConfigError for sizes that do not divide, the
    plan's contradictions, or a model with neither a profile nor a shape."""
    prof = spec.activations
    if plan is None:  # the config is read once, by the plan
        plan = plan_for(config, world_size, tp=tp, pp=pp, mesh=mesh, zero_init=zero_init,
                        micro_batch=micro_batch or (prof.micro_batch if prof else 1))
        o_b = state_bytes(plan.optimizer, _muon_share(spec))
    elif world_size not in (1, plan.mesh.world) or tp is not None or pp is not None or mesh is not None:
        raise ConfigError("estimate_peak(plan=...) prices the plan's mesh; leave world_size, tp, pp and mesh out")
    else:
        o_b = optimizer_state_bytes(config, _muon_share(spec))
    sizes = _sizes(spec, plan, o_b,
                   _activations(spec, plan, micro_batch, seq_len, checkpointing, sequence_parallel))
    held, nvme = _held(plan, sizes)
    phases = {"backward": _backward(plan, sizes, held), "step": _step(plan, sizes, held)}
    if sizes.act.loss_bytes:
        phases["loss"] = _loss(plan, sizes, held)
    _offload_buffers(plan, sizes, held, phases)
    s_dev, s_host = _startup(spec, sizes, built_dtype, zero_init, held)
    return _peak(phases, s_dev, s_host, nvme, sizes.act.source)


def _muon_share(spec: ModelSpec) -> Optional[float]:
    """The share of ``spec``'s elements ``optimizer.type: "Muon"`` steps with Muon (None: not described)."""
    return None if spec.muon_numel is None or not spec.num_params else spec.muon_numel / spec.num_params


def _sizes(spec: ModelSpec, plan: Plan, o_b: float, act: ActivationProfile) -> _Sizes:
    sh, pr = plan.sharding, plan.precision
    split = plan.mesh.model * plan.mesh.pipe
    psi = spec.num_params / split
    units = (list(spec.stage3_units) if sh.partition_parameters
             else _bucket_sizes(spec.param_numels, sh.reduce_bucket))
    n_dp = plan.mesh.shard_size
    return _Sizes(psi=psi, n_dp=n_dp, shard=psi / n_dp if sh.partition_optimizer else psi,
                  units=[u / split for u in units], t_b=_dtype_bytes(pr.compute), g_b=_dtype_bytes(pr.accumulate),
                  o_b=o_b, gas=plan.batch.accumulation_steps, act=act,
                  largest=max(spec.param_numels, default=0) / split)


def _held(plan: Plan, z: _Sizes) -> Tuple[Terms, float]:
    """Bytes held through the whole step (and NVMe bytes): parameters, master weights, optimizer states and,
    where gradients are reduced only at the boundary, the full-size gradient buckets."""
    sh, where, pr = plan.sharding, plan.placement, plan.precision
    held: Terms = {}
    nvme = 0.0
    if not sh.partition_parameters:
        held["params"] = z.psi * z.t_b
    elif where.params == "device":
        held["params"] = z.psi / z.n_dp * z.t_b
    elif where.params == "host":
        held["params_host"] = z.psi / z.n_dp * z.t_b
    else:
        nvme += z.psi / z.n_dp * z.t_b
    separate_master = pr.compute != pr.master or where.optimizer != "device" or where.params != "device"
    m_b = pr.master.itemsize  # 4, or 2 with bf16 master weights
    master = z.shard * m_b if separate_master else 0.0
    states = z.shard * z.o_b * pr.states.itemsize / 4  # fp32, or bf16 with bf16_optimizer_states
    if where.optimizer == "device":
        held["master"], held["optimizer"] = master, states
    elif where.optimizer == "host":
        held["master_host"], held["optimizer_host"] = master, states
    else:  # the state files: master and two state slots (Adam's moments; a Muon tile uses one), in their dtypes
        nvme += master + z.shard * OPTIMIZER_STATE_BYTES["adamw"] * pr.states.itemsize / 4
    if not sh.reduce_every_micro_step:
        held["grads"] = z.psi * z.g_b
    return held, nvme


def _backward(plan: Plan, z: _Sizes, held: Terms) -> Terms:
    """The start of a backward: the held terms, gradient buckets, gathered stage-3 units, activations. The
    1/N accumulator of stages 2-3 is created at the end of the first backward of a step, so it is present
    in a backward only with gradient accumulation."""
    sh = plan.sharding
    out = dict(held)
    if sh.reduce_every_micro_step:
        if z.gas > 1:
            out["grads"] = z.psi / z.n_dp * z.g_b
        out["grad_buckets"] = _buckets_at_peak(z.units, z.g_b, z.act.forward_bytes, sh.buckets_alive or 1)
    if sh.partition_parameters:
        gathered = _gathered_stage3(z.units, sh.prefetch_bucket, sh.max_live_parameters, sh.persistence_threshold)
        out["gathered"] = gathered * z.t_b
        if plan.placement.params != "device":
            out["gather_staging_host"] = max(z.units) / z.n_dp * z.t_b
        out.update(_zeropp(plan, z))
    out["activations"] = z.act.peak_bytes
    return out


def _loss(plan: Plan, z: _Sizes, held: Terms) -> Terms:
    """The loss and the logits' gradient (only with a profile's ``loss_bytes``): the held terms, the 1/N
    accumulator under gradient accumulation, the persistent stage-3 units (every other unit was released
    after its forward and is gathered again when autograd reaches it), hpZ's secondary parts; no gradient
    buckets yet (no parameter has a gradient). Measured at SP 2 and 4 on the 106M Llama (fp32, untiled
    loss): the peak is these terms within 2% (``benchmarks/bench_long_context.py``)."""
    sh = plan.sharding
    out = dict(held)
    if sh.reduce_every_micro_step and z.gas > 1:
        out["grads"] = z.psi / z.n_dp * z.g_b
    if sh.partition_parameters:
        out["gathered"] = sum(n for n in z.units if n < sh.persistence_threshold) * z.t_b
        if sh.zeropp.hpz > 1:
            out["hpz_secondary"] = z.psi / sh.zeropp.hpz * z.t_b
    out["activations"] = z.act.loss_bytes
    return out


def _zeropp(plan: Plan, z: _Sizes) -> Terms:
    """ZeRO++'s extra bytes in a backward: hpZ's secondary parts of every unit (1/hpz of the parameters, kept
    from the forward to the step) and the codes in flight, sent and received, for one largest unit (qwZ: a
    gather's; qgZ: a reduction's, one or half a byte per value)."""
    zpp = plan.sharding.zeropp
    out: Terms = {}
    if zpp.hpz > 1:
        out["hpz_secondary"] = z.psi / zpp.hpz * z.t_b
    code_bytes = (1.0 if zpp.weights != "none" else 0.0) + (zpp.gradient_bits / 8 if zpp.gradient_bits else 0.0)
    if code_bytes:
        out["zeropp_codes"] = 2 * max(z.units) * code_bytes
    return out


def _step(plan: Plan, z: _Sizes, held: Terms) -> Terms:
    """The optimizer step: the held terms, the 1/N accumulator, and below fp32 one unit's gradients converted
    to fp32 at a time."""
    pr = plan.precision
    out = dict(held)
    if plan.sharding.reduce_every_micro_step:
        out["grads"] = z.psi / z.n_dp * z.g_b
    if pr.compute != pr.master or pr.accumulate != pr.master:
        out["grad_fp32"] = max(z.units) / plan.sharding.unit_world * 4
    if plan.placement.optimizer == "host" and not steps_in_tiles(plan.optimizer):
        # the generic host step (Muon, Lion, ...): every gradient shard copied to the host masters' dtype at once
        out["grads_copy_host"] = z.shard * pr.master.itemsize
    elif plan.placement.optimizer == "file" and optimizer_name(plan.optimizer) == "muon":
        # Muon from the files (offload/muon_step.py): the Nesterov blends of its elements kept between the
        # passes, 4 bytes each (its share of the elements: what its state bytes lack of AdamW's 8, over 4)
        out["muon_blends_host"] = z.shard * (OPTIMIZER_STATE_BYTES["adamw"] - z.o_b)
    if optimizer_name(plan.optimizer) == "muon" and plan.placement.optimizer != "file":
        _muon_step(plan, z, out)
    return out


def _muon_step(plan: Plan, z: _Sizes, out: Terms) -> None:
    """Muon stepped over every unit at once (zero/master.py, optim/muon.py): every gradient shard in fp32 at
    once, and, 4 bytes per Muon element of the shard each, the Nesterov blends (on the host when offloaded),
    the whole matrices its owners assemble (about one shard's worth, dealt by size) and the orthogonalised
    results; Newton-Schulz's iterate and two products of the largest matrix. Measured on a 23M GPT at ZeRO 3,
    world 2: 362 MiB against 356 priced (230 before these terms)."""
    pr = plan.precision
    if plan.placement.optimizer == "device" and (pr.compute != pr.master or pr.accumulate != pr.master):
        out["grad_fp32"] = z.shard * 4
    muon = z.shard * (OPTIMIZER_STATE_BYTES["adamw"] - z.o_b)  # 4 bytes x its share of the shard's elements
    updates = 3 * muon + 3 * 4 * z.largest
    if plan.placement.optimizer == "host":
        out["muon_blends_host"] = muon
        updates -= muon
    out["muon_updates"] = updates


def _offload_buffers(plan: Plan, z: _Sizes, held: Terms, phases: Dict[str, Terms]) -> None:
    """Adds ``offload_buffers_host`` to ``held`` and every phase: with optimizer states on the host and the
    tiled (Adam) step, the copier's two fp32 gradient slots (resident once the first step used them); in files,
    the streaming pool (``buffer_count`` × 3 tiles, rounded up to 4 KiB each) and the copier's slots from the
    start, and in the step two more fp32 tiles in flight (measured on bench_scale: +0.36 GiB at 5e7-element tiles from step 2 on)."""
    where = plan.placement
    if where.optimizer == "host" and steps_in_tiles(plan.optimizer):
        slots = _copier_slots(z.units, plan.sharding.unit_world, float(where.tile_elems))
        for terms in (held, *phases.values()):
            terms["offload_buffers_host"] = slots
    elif where.optimizer == "file":
        tile = min(float(where.tile_elems), z.shard)
        row = aligned_size(math.ceil(tile) * 4)  # the pool's rows are whole 4 KiB blocks (O_DIRECT)
        pool = max(1, where.buffer_count) * 3 * row + _copier_slots(z.units, z.n_dp, float(where.tile_elems))
        for name, terms in (("held", held), *phases.items()):
            terms["offload_buffers_host"] = pool + (2 * tile * 4 if name == "step" else 0.0)


def _peak(phases: Dict[str, Terms], s_dev: float, s_host: float, nvme: float, source: str) -> PeakEstimate:
    peak_phase = max(phases, key=lambda k: _split(phases[k])[0] + _split(phases[k])[1])
    device = max(_split(p)[0] for p in phases.values())
    host = max(_split(p)[1] for p in phases.values())
    states = {k: v for k, v in phases["step"].items()
              if k.split("_host")[0] in ("params", "grads", "master", "optimizer")}
    return PeakEstimate(device=max(device, s_dev), host=max(host, s_host), terms=dict(phases[peak_phase]),
                        phase=peak_phase, model_states=states, startup_device=s_dev, startup_host=s_host,
                        nvme=nvme, activations_source=source)


def _copier_slots(units, n_dp: int, sub_group: float) -> float:
    """Bytes of the offloaded step's two fp32 gradient slots (``offload/transfer.py``), each of the largest tile
    (``sub_group_size`` elements or a unit's shard, whichever is smaller); only one is ever used when there is
    one tile, and untouched pages are not resident."""
    shards = [u / n_dp for u in units] or [0.0]
    tiles = sum(max(1, -(-int(sh) // max(1, int(sub_group)))) for sh in shards)
    return min(2, tiles) * min(sub_group, max(shards)) * 4


def _split(terms: Terms) -> Tuple[float, float]:
    host = sum(v for k, v in terms.items() if k.endswith("_host"))
    return sum(terms.values()) - host, host


def _buckets_at_peak(units, g_b: int, act_forward: float, alive: int) -> float:
    """Gradient buckets alive at the backward peak (stages 2-3): the first bucket fills while the activations
    are all still alive; up to ``alive - 1`` more (reductions in flight) add to the peak only where a unit's
    bucket is larger than the activations its backward frees."""
    if not units:
        return 0.0
    u = max(units) * g_b
    per_unit = act_forward / len(units)
    return u + max(0.0, min(alive - 1, len(units) - 1) * (u - per_unit))


def _activations(spec: ModelSpec, plan: Plan, micro_batch: Optional[int], seq_len: Optional[int],
                 checkpointing: Optional[bool], sequence_parallel: Optional[bool]) -> ActivationProfile:
    prof = spec.activations
    tp, pp = plan.mesh.model, plan.mesh.pipe
    mb = micro_batch or plan.batch.micro_batch
    if checkpointing is not None:
        ckpt = checkpointing
    elif plan.checkpointing.configure:
        ckpt = plan.checkpointing.blocks
    else:
        ckpt = prof.checkpointing if prof else False
    sp = plan.tensor_parallel.sequence_parallel if sequence_parallel is None else sequence_parallel
    in_flight = min(pp, plan.batch.accumulation_steps) if pp > 1 else 1
    usable = prof is not None and prof.checkpointing == ckpt and (
        prof.source == "fitted" or (tp == 1 and pp == 1 and (seq_len is None or seq_len == prof.seq_len)))
    if usable:
        assert prof is not None
        return prof.scaled_to(int(mb)) if prof.micro_batch != mb else prof
    if spec.shape is None:
        raise ConfigError(f"cannot size the activations of {spec.name}: no traced profile for micro-batch {mb}, "
                          f"checkpointing {ckpt}, and no transformer shape for the formulas")
    s = seq_len or (prof.seq_len if prof else spec.shape.max_seq)
    return formula_activations(spec.shape, int(mb), int(s), _dtype_bytes(plan.precision.compute),
                               checkpointing=ckpt, tp=tp, pp=pp, in_flight=in_flight, sequence_parallel=sp)


def _startup(spec: ModelSpec, z: _Sizes, built_dtype: torch.dtype, zero_init: bool, held: Terms
             ) -> Tuple[float, float]:
    """(device, host) bytes while the engine is built (before the first step)."""
    b_b = _dtype_bytes(built_dtype)
    largest = max(z.units) if z.units else 0.0
    host = held.get("master_host", 0.0) + held.get("params_host", 0.0)
    if zero_init:  # shards only, plus one whole parameter being assembled
        return (z.shard + max(spec.param_numels)) * b_b, host
    # the whole model exists on every rank while each unit's flat buffer (stages 0-2) or shard (stage 3) is
    # cut from it; a unit's original tensors are freed once it is built. Built in another dtype, the model is
    # cast first, one parameter at a time (runtime/precision_setup.py), so the units are cut from the cast model
    # (measured on the 112.6M GPT at world 4, benchmarks/bench_precision_memory.py)
    cut = z.psi * z.t_b + largest * z.t_b
    if b_b == z.t_b:
        return cut, host
    share = z.psi / spec.num_params if spec.num_params else 1.0  # this rank's model-parallel slice
    casting = z.psi * b_b + max(spec.param_numels, default=0) * share * z.t_b
    return max(casting, cut), host


def paper_table(num_params: float = 7.5e9, world_size: int = 64) -> Dict[int, float]:
    """The ZeRO paper's model-state bytes per device for mixed-precision Adam (stage → bytes):
    16Ψ, 4Ψ + 12Ψ/N, 2Ψ + 14Ψ/N, 16Ψ/N (120, 31.4, 16.6, 1.9 GB at Ψ = 7.5B, N = 64)."""
    return {s: estimate_model_state_memory(num_params, world_size, s, "bf16").device for s in range(4)}
