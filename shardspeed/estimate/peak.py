"""Per-rank peak memory of a training step: model states + gradient buckets + gathered units + activations.

:func:`estimate_peak` is pure arithmetic over a :class:`~.model.ModelSpec` and a config; it mirrors what the
engine allocates (see docs/memory.md for each term and where in the code it comes from):

- parameters: stages 0-2 hold the whole flat model in the training dtype; stage 3 a 1/N shard (in host memory
  with ``offload_param: cpu``, in a file with ``nvme``).
- gradients: stages 0-1 keep full-size flat buckets (the training dtype) across micro-steps; stages 2-3 keep a
  1/N accumulator and, during backward, at most three full-size unit buckets (two reductions in flight and
  one filling). Units are ``reduce_bucket_size`` groups of parameters at stages 0-2 and the stage-3 units.
- master weights: a separate fp32 shard unless training is fp32 without any offload (then the parameter shard
  *is* the master); optimizer states: bytes per element of the optimizer (Adam 8) on the shard. Both move to
  host memory with ``offload_optimizer: cpu`` (plus two fp32 gradient tiles of ``sub_group_size``) or to
  files with ``nvme`` (plus the streaming pool, ``buffer_count`` × 3 tiles).
- stage 3 gathered units: the root's unit (kept from forward to backward), the unit in use and the prefetch
  window (``stage3_prefetch_bucket_size`` elements ahead, within ``stage3_max_live_parameters``), and units
  under ``stage3_param_persistence_threshold`` (kept gathered).
- activations: a traced :class:`~.activations.ActivationProfile` (exact for that model and shape) or the
  Korthikanti formulas; with a pipeline, ``min(pp, gradient_accumulation_steps)`` micro-batches in flight.
- start-up: the model is built whole on every rank (its parameters in the dtype it was built in) and the
  flat buffers are filled unit by unit, unless it was built under ``zero.Init`` (then one shard plus the
  largest parameter being assembled).

"device" is the training device; "host" is CPU memory; on a CPU-only machine both are the same RAM.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Dict, Optional

import torch

from ..errors import ConfigError
from .activations import ActivationProfile, formula_activations
from .model import ModelSpec

#: fp32 optimizer-state bytes per parameter element, by optimizer name (lower case)
OPTIMIZER_STATE_BYTES = {"adam": 8, "adamw": 8, "lamb": 8, "fusedadam": 8, "cpuadam": 8, "onebitadam": 8,
                         "adagrad": 4, "lion": 4, "sgd": 4, "rmsprop": 4}


def parse(config: Any):
    """A ShardspeedConfig from a dict, a JSON path, a ShardspeedConfig or None (DeepSpeed's defaults)."""
    from ..config import parse_config

    return parse_config({"train_micro_batch_size_per_gpu": 1} if config is None else config)


def zero_section(config: Any):
    return parse(config).zero_optimization


@dataclass(frozen=True)
class PeakEstimate:
    """Predicted per-rank peak bytes. ``device`` / ``host``: the larger of the training-step peak and the
    start-up peak on each; ``terms``: the parts (bytes; ``*_host`` on the host) of the training-step phase with the larger peak,
    ``phase`` ("backward": the start of a backward, activations all alive; "step": the optimizer step);
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
    the prefetch window behind it and the persistent (small) units."""
    if not units:
        return 0.0
    root, others = units[-1], list(units[:-1]) or [0]
    largest = max(others)
    budget = max(0, min(prefetch, max_live - largest - root))
    window, run = 0, 0
    for i in range(len(others)):  # the largest prefetch window over the traced order
        run = 0
        for n in others[i + 1:]:
            if run + n > budget:
                break
            run += n
        window = max(window, run)
    persistent = sum(n for n in others if n < persistence)
    return float(min(sum(units), root + largest + window + persistent))


def estimate_peak(spec: ModelSpec, config: Any = None, *, world_size: int = 1, tp: int = 1, pp: int = 1,
                  micro_batch: Optional[int] = None, seq_len: Optional[int] = None,
                  checkpointing: Optional[bool] = None, zero_init: bool = False,
                  built_dtype: torch.dtype = torch.float32, sequence_parallel: bool = False) -> PeakEstimate:
    """Per-rank peak bytes (device, host) for training ``spec`` with ``config`` on ``world_size`` ranks split
    into ``tp`` tensor-parallel × ``pp`` pipeline × data-parallel ranks.

    ``micro_batch`` (default: the config's ``train_micro_batch_size_per_gpu``, else the traced profile's) and
    ``seq_len`` (default: the profile's, else the model's positions) size the activations; ``checkpointing``
    (default: the profile's setting) recomputes each transformer block in backward. ``zero_init``: the model is
    built under ``shardspeed.zero.Init`` (never whole); ``built_dtype``: the dtype the model is built in.
    Raises ConfigError for sizes that do not divide or a model with neither a profile nor a shape."""
    cfg = parse(config)
    z = cfg.zero_optimization
    stage = int(z.stage)
    if world_size < 1 or tp < 1 or pp < 1 or world_size % (tp * pp):
        raise ConfigError(f"world_size {world_size} must be a positive multiple of tp × pp = {tp} × {pp}")
    n_dp = world_size // (tp * pp)
    psi = spec.num_params / (tp * pp)
    t_b = _dtype_bytes(cfg.train_dtype)
    g_b = _dtype_bytes(_accum_dtype(cfg))
    oo, op = z.offload_optimizer, z.offload_param
    oo_dev = oo.device if oo is not None else "none"
    op_dev = op.device if op is not None else "none"
    if oo_dev != "none" and stage == 0:
        raise ConfigError("offload_optimizer needs zero_optimization.stage 1, 2 or 3")
    if op_dev != "none" and stage != 3:
        raise ConfigError("offload_param needs zero_optimization.stage 3")
    shard = psi / n_dp if stage >= 1 else psi
    opt_name = (cfg.optimizer.type.lower() if cfg.optimizer is not None else "adamw")
    o_b = OPTIMIZER_STATE_BYTES.get(opt_name, 8)

    units = (list(spec.stage3_units) if stage == 3
             else _bucket_sizes(spec.param_numels, int(z.reduce_bucket_size)))
    units = [u / (tp * pp) for u in units]
    act = _activations(spec, cfg, micro_batch, seq_len, checkpointing, tp, pp, sequence_parallel, t_b)
    gas = int(cfg.gradient_accumulation_steps or 1)

    held: Dict[str, float] = {}  # held through the whole step
    # parameters
    if stage < 3:
        held["params"] = psi * t_b
    elif op_dev == "none":
        held["params"] = psi / n_dp * t_b
    elif op_dev == "cpu":
        held["params_host"] = psi / n_dp * t_b
    # master weights and optimizer states
    separate_master = cfg.train_dtype != torch.float32 or oo_dev != "none" or op_dev != "none"
    master = shard * 4 if separate_master else 0.0
    states = shard * o_b
    nvme = 0.0
    if oo_dev == "none":
        held["master"], held["optimizer"] = master, states
    elif oo_dev == "cpu":
        held["master_host"], held["optimizer_host"] = master, states
    else:
        nvme += shard * (4 + o_b)
    if op_dev == "nvme":
        nvme += psi / n_dp * t_b
    # gradients: stages 0-1 keep full buckets; stages 2-3 a 1/N accumulator (created at the end of the first
    # backward of a step, so present in a backward only with gradient accumulation) and transient buckets
    accumulator = psi / n_dp * g_b
    if stage <= 1:
        held["grads"] = psi * g_b

    backward = dict(held)
    if stage >= 2:
        if gas > 1:
            backward["grads"] = accumulator
        backward["grad_buckets"] = _buckets_at_peak(units, g_b, act.forward_bytes)
    if stage == 3:
        gathered = _gathered_stage3(units, int(z.prefetch_bucket_size), int(z.max_live_parameters),
                                    int(z.param_persistence_threshold))
        backward["gathered"] = gathered * t_b
        if op_dev != "none":
            backward["gather_staging_host"] = max(units) / n_dp * t_b
    backward["activations"] = act.peak_bytes

    step = dict(held)
    if stage >= 2:
        step["grads"] = accumulator
    if cfg.train_dtype != torch.float32 or g_b != 4:  # gradients converted to fp32 one unit at a time
        step["grad_fp32"] = max(units) / (n_dp if stage >= 1 else 1) * 4
    if oo_dev == "cpu":  # the host copier's two fp32 gradient slots, resident once the first step used them
        held["offload_buffers_host"] = backward["offload_buffers_host"] = step["offload_buffers_host"] = \
            _copier_slots(units, n_dp if stage >= 1 else 1, float(z.sub_group_size))
    elif oo_dev == "nvme":
        tile = min(float(z.sub_group_size), shard)
        # the pool (buffer_count x 3 tiles) and the copier's gradient slots are held from the start; in the step two
        # more fp32 tiles are in flight (measured on bench_scale: +0.36 GiB at 5e7-element tiles from step 2 on)
        pool = max(1, oo.buffer_count) * 3 * tile * 4 + _copier_slots(units, n_dp, float(z.sub_group_size))
        held["offload_buffers_host"] = backward["offload_buffers_host"] = pool
        step["offload_buffers_host"] = pool + 2 * tile * 4

    s_dev, s_host = _startup(spec, psi, shard, units, stage, n_dp, t_b, built_dtype, zero_init, held)
    phases = {"backward": backward, "step": step}
    peak_phase = max(phases, key=lambda k: _split(phases[k])[0] + _split(phases[k])[1])
    device = max(_split(p)[0] for p in phases.values())
    host = max(_split(p)[1] for p in phases.values())
    return PeakEstimate(device=max(device, s_dev), host=max(host, s_host), terms=dict(phases[peak_phase]),
                        phase=peak_phase, model_states={k: v for k, v in step.items() if k.split("_host")[0] in
                                                        ("params", "grads", "master", "optimizer")},
                        startup_device=s_dev, startup_host=s_host, nvme=nvme,
                        activations_source=act.source)


def _copier_slots(units, n_dp: int, sub_group: float) -> float:
    """Bytes of the offloaded step's two fp32 gradient slots (``offload/transfer.py``), each of the largest tile
    (``sub_group_size`` elements or a unit's shard, whichever is smaller); only one is ever used when there is
    one tile, and untouched pages are not resident."""
    shards = [u / n_dp for u in units] or [0.0]
    tiles = sum(max(1, -(-int(sh) // max(1, int(sub_group)))) for sh in shards)
    return min(2, tiles) * min(sub_group, max(shards)) * 4


def _split(terms: Dict[str, float]):
    host = sum(v for k, v in terms.items() if k.endswith("_host"))
    return sum(terms.values()) - host, host


def _buckets_at_peak(units, g_b: int, act_forward: float) -> float:
    """Gradient buckets alive at the backward peak (stages 2-3): the first bucket fills while the activations
    are all still alive; up to two more (reductions in flight) add to the peak only where a unit's bucket is
    larger than the activations its backward frees."""
    if not units:
        return 0.0
    u = max(units) * g_b
    per_unit = act_forward / len(units)
    return u + max(0.0, min(2, len(units) - 1) * (u - per_unit))


def _accum_dtype(cfg) -> torch.dtype:
    name = cfg.data_types.grad_accum_dtype if cfg.data_types is not None else None
    if name is None:
        return cfg.train_dtype
    return {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}[name]


def _activations(spec: ModelSpec, cfg, micro_batch, seq_len, checkpointing, tp, pp, sp, t_b) -> ActivationProfile:
    prof = spec.activations
    mb = micro_batch or cfg.train_micro_batch_size_per_gpu or (prof.micro_batch if prof else 1)
    ckpt = checkpointing if checkpointing is not None else (prof.checkpointing if prof else False)
    gas = cfg.gradient_accumulation_steps or 1
    in_flight = min(pp, gas) if pp > 1 else 1
    usable = prof is not None and prof.checkpointing == ckpt and (
        prof.source == "fitted" or (tp == 1 and pp == 1 and (seq_len is None or seq_len == prof.seq_len)))
    if usable:
        assert prof is not None
        return prof.scaled_to(int(mb)) if prof.micro_batch != mb else prof
    if spec.shape is None:
        raise ConfigError(f"cannot size the activations of {spec.name}: no traced profile for micro-batch {mb}, "
                          f"checkpointing {ckpt}, and no transformer shape for the formulas")
    s = seq_len or (prof.seq_len if prof else spec.shape.max_seq)
    return formula_activations(spec.shape, int(mb), int(s), t_b, checkpointing=ckpt, tp=tp, pp=pp,
                               in_flight=in_flight, sequence_parallel=sp)


def _startup(spec: ModelSpec, psi, shard, units, stage, n_dp, t_b, built_dtype, zero_init, terms):
    """(device, host) bytes while the engine is built (before the first step)."""
    b_b = _dtype_bytes(built_dtype)
    largest = max(units) if units else 0.0
    host = terms.get("master_host", 0.0) + terms.get("params_host", 0.0)
    if zero_init:  # shards only, plus one whole parameter being assembled
        return (shard + max(spec.param_numels)) * b_b, host
    # the whole model exists on every rank while each unit's flat buffer (stages 0-2) or shard (stage 3) is
    # cut from it; a unit's original tensors are freed once it is built
    return psi * b_b + largest * t_b, host


def paper_table(num_params: float = 7.5e9, world_size: int = 64) -> Dict[int, float]:
    """The ZeRO paper's model-state bytes per device for mixed-precision Adam (stage → bytes):
    16Ψ, 4Ψ + 12Ψ/N, 2Ψ + 14Ψ/N, 16Ψ/N (120, 31.4, 16.6, 1.9 GB at Ψ = 7.5B, N = 64)."""
    from ..memory_estimate import estimate_model_state_memory

    return {s: estimate_model_state_memory(num_params, world_size, s, "bf16").device for s in range(4)}
