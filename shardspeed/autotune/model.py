"""One job: the cost model, a candidate's per-rank peak memory and optimizer-step time (pure; no process group).

Every candidate is priced as a plan: :func:`candidate_plan` writes its config (:func:`~.space.apply_candidate`)
and :func:`shardspeed.estimate.plan_for` (``shardspeed.plan.decide``) decides it; the models below read
partitioning, placement, reductions, gathers, buckets, batch and mesh from that plan, never from the stage or
offload flags themselves.

Memory (bytes per rank) = ``base`` + model states + working buffers + ``act`` × micro-batch:

- model states: :func:`shardspeed.estimate.model_states` of the candidate's plan (exact ZeRO arithmetic);
  on a CPU "device" the offloaded states stay in the same memory, so they count there too;
- working buffers: the gradient bucket (stages 0-2) or two gathered units plus one unit's gradients
  (stage 3), and the optimizer step's fp32 temporaries over the rank's optimizer shard;
- ``base`` (runtime, allocator, data; one per measured variant: stage, offloads, TP degree) and ``act``
  (activations and their gradients per sample, with the estimator's formulas as one more observation) are
  fitted by least squares from measured runs (two calibration runs, then every trial as it finishes).

``act`` × micro-batch is scaled by ``ckpt_share`` with activation checkpointing and by the TP share of the
activations. The tuner uses :class:`~.memory.EstimatorMemoryModel`, which takes the structure (model
states, buckets, gathered units, offload tiles) from :func:`shardspeed.estimate.estimate_peak` instead and
fits the same bases and activations on top; any :class:`MemoryModel` can stand in.

Step time (seconds per optimizer step) = G·(α + β·m·r/t) + γ·comm + TP all-reduces + optimizer + offload
copies, with G accumulation steps of micro-batch m at tensor-parallel degree t, r the recompute factor
(4/3 with activation checkpointing):

- α (per micro-step), β (per sample) and γ are fitted from measured runs, and each measured variant
  (stage, offloads, TP degree) gets its mean residual as a correction;
- comm, each collective at the probe's latency and bandwidth for it, as the engine issues it over the
  data-parallel group: an all-reduce of the gradients per step (stage 0), a reduce-scatter and an all-gather
  per step (stage 1), a reduce-scatter per micro-step and an all-gather per step (stage 2), two gathers of
  every unit and a reduce-scatter per micro-step (stage 3); γ is the share of it the runs bear out
  (prefetch and overlap_comm hide part of it);
- TP: four all-reduces of each layer's activations per micro-step over the model group;
- the optimizer's step over the rank's shard at the probe's per-element Adam cost (host copies of the
  gradient and parameter shards added with optimizer offload; per-micro-step fetches with parameter offload).
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field, replace
from types import MappingProxyType
from typing import Any, Dict, List, Optional, Protocol, Sequence, Tuple

import numpy as np

from shardspeed.estimate import model_states, plan_for
from shardspeed.estimate.experts import moe_model_states
from shardspeed.plan import Plan

from .space import Candidate, apply_candidate

_DTYPE_BYTES = MappingProxyType({"fp32": 4, "bf16": 2, "fp16": 2})
#: Time factor of the per-sample compute with activation checkpointing (one extra forward ≈ 1/3 of fwd+bwd).
RECOMPUTE_FACTOR = 4.0 / 3.0
#: Share of per-sample activation memory kept with activation checkpointing (layer inputs only; a guess
#: until a checkpointed run calibrates it).
CHECKPOINTED_ACTIVATION_SHARE = 0.3


@dataclass(frozen=True)
class ModelInfo:
    """What the cost model needs to know about the job."""

    num_params: int
    largest_unit: int  # elements
    num_units: int
    dtype: str  # "fp32", "bf16", "fp16"
    world_size: int  # ranks; a candidate's data-parallel size is world_size / its tensor-parallel degree
    device_is_host: bool  # CPU training: offloaded states share the one memory
    default_bucket: int = 500_000_000  # the user's reduce_bucket_size (elements)
    #: tensor parallelism (Megatron's layout, no sequence parallelism): each of ``tp_layers`` transformer
    #: layers all-reduces its activations (``tp_elems_per_sample``: tokens × hidden, in the training dtype) twice in
    #: forward and twice in backward; 0 when the model's shape is unknown (then no TP candidate is searched)
    tp_layers: int = 0
    tp_elems_per_sample: int = 0
    #: mixture of experts: of ``num_params``, the parameters of all experts (``ep_size`` ranks share them: each
    #: holds 1/ep_size, sharded over its expert-data group; :mod:`shardspeed.estimate.experts`)
    expert_params: int = 0
    ep_size: int = 1

    @property
    def bytes_per_param(self) -> int:
        return _DTYPE_BYTES[self.dtype]

    def params_per_rank(self, c: Candidate) -> float:
        """Parameters a model-parallel rank holds before ZeRO partitions them (the plan's TP × PP slice)."""
        mesh = candidate_plan(self, c).mesh
        return self.num_params / (mesh.model * mesh.pipe)

    def dp(self, c: Candidate) -> int:
        """The candidate's data-parallel size (the ranks ZeRO partitions over: the plan's shard group)."""
        return candidate_plan(self, c).mesh.shard_size


@functools.lru_cache(maxsize=8192)
def candidate_plan(info: ModelInfo, c: Candidate) -> Plan:
    """The plan of candidate ``c`` at ``info.world_size`` ranks: ``apply_candidate`` of a config in the
    job's dtype with its ``reduce_bucket_size``, decided by the estimator's :func:`~shardspeed.estimate.plan_for`."""
    base: Dict[str, Any] = {"zero_optimization": {"reduce_bucket_size": info.default_bucket}}
    if info.dtype != "fp32":
        base[info.dtype] = {"enabled": True}
    return plan_for(apply_candidate(base, c, info.world_size), info.world_size,
                    ep=info.ep_size if info.ep_size > 1 else None)


def _elem_bytes(plan: Plan) -> int:
    """Bytes per element of the plan's compute dtype."""
    return plan.precision.compute.itemsize


@dataclass(frozen=True)
class LinkProfile:
    """The bandwidth probe's figures (see :mod:`shardspeed.autotune.bandwidth`)."""

    latency_s: float  # per all-reduce call
    bus_bandwidth: float  # bytes/s, ring-normalised (all-reduce moves 2·(N-1)/N·bytes at this rate)
    adam_s_per_elem: float  # optimizer step on the training device, seconds per element
    host_adam_s_per_elem: float  # the offloaded (CPU) step, seconds per element
    copy_bandwidth: float  # device↔host copies, bytes/s
    # the flat all-gather and reduce-scatter (moving (N-1)/N·bytes); None: as the all-reduce
    all_gather_latency_s: Optional[float] = None
    all_gather_bus_bandwidth: Optional[float] = None
    reduce_scatter_latency_s: Optional[float] = None
    reduce_scatter_bus_bandwidth: Optional[float] = None

    def cost(self, op: str) -> Tuple[float, float]:
        """(latency s, bus bandwidth bytes/s) of ``op``: all_reduce, all_gather or reduce_scatter."""
        lat, bw = {"all_gather": (self.all_gather_latency_s, self.all_gather_bus_bandwidth),
                   "reduce_scatter": (self.reduce_scatter_latency_s, self.reduce_scatter_bus_bandwidth)
                   }.get(op, (None, None))
        return (self.latency_s if lat is None else lat), (self.bus_bandwidth if bw is None else bw)


@dataclass(frozen=True)
class Measurement:
    """A run's result: the candidate and what it measured (peak memory per rank, seconds per step)."""

    candidate: Candidate
    peak_memory: float
    step_time_s: float


@dataclass(frozen=True)
class Prediction:
    device_bytes: float
    host_bytes: float
    step_time_s: float
    breakdown: Dict[str, float] = field(default_factory=dict, compare=False)


class MemoryModel(Protocol):
    """Anything that predicts per-rank (device, host) bytes of a candidate."""

    def predict(self, cand: Candidate) -> Tuple[float, float]: ...


def nnls(rows: Sequence[Sequence[float]], ys: Sequence[float]) -> List[float]:
    """Least squares with non-negative coefficients, by trying every subset of the (few) columns."""
    k = len(rows[0]) if rows else 0
    x, y = np.asarray(rows, dtype=float), np.asarray(ys, dtype=float)
    best: Tuple[float, List[float]] = (float(np.sum(y * y)), [0.0] * k)
    for mask in range(1, 1 << k):
        cols = [j for j in range(k) if mask >> j & 1]
        coef, *_ = np.linalg.lstsq(x[:, cols], y, rcond=None)
        if np.any(coef < 0):
            continue
        full = [0.0] * k
        for j, c in zip(cols, coef):
            full[j] = float(c)
        err = float(np.sum((x @ np.asarray(full) - y) ** 2))
        if err < best[0] * (1 - 1e-12):
            best = (err, full)
    return best[1]


@dataclass(frozen=True)
class StateMemoryModel:
    """Model states (exact) + working buffers (structural) + fitted bases and activations per sample.

    Each variant (stage, optimizer offload, parameter offload) that has been measured gets a base of its
    own (the engine's buffers and the allocator differ by variant in ways the structure above does not
    capture); a variant never measured uses the mean base of its stage's measured variants, else of all,
    and :meth:`measured` tells the search to be more careful with it.

    ``act_prior`` (bytes per sample, e.g. the estimator's activation formulas) enters the activations' fit
    as one more observation, worth one run at the largest measured micro-batch: two calibration peaks a
    few MB apart (a box's allocator noise) no longer decide alone, and a variant whose peak barely moves
    with the micro-batch (stage 3 here) does not set every other variant's activations to zero."""

    info: ModelInfo
    base: float = 0.0
    act_per_sample: float = 0.0
    variant_base: Tuple[Tuple[Tuple[int, bool, bool, int], float], ...] = ()
    ckpt_share: float = CHECKPOINTED_ACTIVATION_SHARE  # activations kept with checkpointing, a share
    act_prior: Optional[float] = None

    def plan(self, c: Candidate) -> Plan:
        """The candidate's plan (what every term below reads)."""
        return candidate_plan(self.info, c)

    def states(self, c: Candidate) -> Tuple[float, float]:
        """(device, host) bytes of parameters, gradients and optimizer states: the plan's model states."""
        i = self.info
        m = (moe_model_states(self.plan(c), i.num_params - i.expert_params, i.expert_params) if i.expert_params
             else model_states(self.plan(c), i.num_params))
        return (m.device + m.host if self.info.device_is_host else m.device), m.host

    def working(self, c: Candidate) -> float:
        """Bytes of transient buffers: the gradient bucket or, with partitioned parameters, the gathered units,
        and the fp32 temporaries of the optimizer step over this rank's shard (on the device unless the plan
        places the optimizer elsewhere)."""
        i, p = self.info, self.plan(c)
        sh, b = p.sharding, _elem_bytes(p)
        psi = i.num_params / (p.mesh.model * p.mesh.pipe)
        if sh.partition_parameters:
            buf = 3.0 * i.largest_unit / p.mesh.model * b  # the unit in use, the prefetched one, one unit's gradients
        else:
            buf = min(sh.reduce_bucket, psi) * b
        shard = psi / (p.mesh.shard_size if sh.partition_optimizer else 1)
        step = 4.0 * shard if (p.placement.optimizer == "device" or i.device_is_host) else 0.0
        return buf + step

    def structural(self, c: Candidate) -> Tuple[float, float]:
        """(device, host) bytes the structure predicts before the fitted base and activations: model states
        plus working buffers (on a CPU device the host's share counts on the device too)."""
        dev, host = self.states(c)
        return dev + self.working(c), host

    def variable(self, c: Candidate) -> float:
        """Per-sample activation factor of the candidate (checkpointing keeps ``ckpt_share``, tensor
        parallelism :meth:`tp_share`, sequence parallelism a 1/SP share of each sample's tokens)."""
        p = self.plan(c)
        ckpt = self.ckpt_share if p.checkpointing.blocks else 1.0
        return p.batch.micro_batch * ckpt * self.tp_share(p.mesh.model) / p.mesh.sequence

    def tp_share(self, tp: int) -> float:
        """Share of a sample's activations a rank keeps at tensor-parallel degree ``tp`` (here 1: the layer
        inputs stay replicated and the split share is not known without the model's shape)."""
        return 1.0

    def measured(self, c: Candidate) -> bool:
        """Whether the candidate's variant has a measured base."""
        return _variant(c) in dict(self.variant_base)

    def _base(self, c: Candidate) -> float:
        bases = dict(self.variant_base)
        if _variant(c) in bases:
            return bases[_variant(c)]
        same_stage = [b for (s, _, _, _), b in bases.items() if s == c.stage]
        return sum(same_stage) / len(same_stage) if same_stage else self.base

    def predict(self, c: Candidate) -> Tuple[float, float]:
        dev, host = self.structural(c)
        return self._base(c) + dev + self.act_per_sample * self.variable(c), host

    def fit(self, runs: Sequence[Measurement]) -> StateMemoryModel:
        """Refit the bases (one per measured variant) and activations per sample from measured peaks."""
        ok = [r for r in runs if math.isfinite(r.peak_memory) and r.peak_memory > 0]
        if not ok:
            return self
        keys = sorted({_variant(r.candidate) for r in ok})
        ys = [r.peak_memory - self.structural(r.candidate)[0] for r in ok]
        if len({self.variable(r.candidate) for r in ok}) < 2:  # activations cannot be told from the bases
            act = self.act_per_sample if self.act_prior is None else self.act_prior
            bases = [sum(y - act * self.variable(r.candidate) for r, y in zip(ok, ys) if _variant(r.candidate) == k)
                     / sum(1 for r in ok if _variant(r.candidate) == k) for k in keys]
        else:
            rows = [[1.0 if _variant(r.candidate) == k else 0.0 for k in keys] + [self.variable(r.candidate)]
                    for r in ok]
            *bases, act = nnls(*self.with_prior(rows, ys, len(keys), ok))
        return replace(self, base=sum(bases) / len(bases), act_per_sample=act,
                       variant_base=tuple(zip(keys, bases)))

    def with_prior(self, rows: List[List[float]], ys: List[float], act_col: int, runs: Sequence[Measurement]
                   ) -> Tuple[List[List[float]], List[float]]:
        """The least squares' rows and targets, plus ``act_prior`` as one observation of column ``act_col``
        weighted as a run at the largest measured micro-batch."""
        if self.act_prior is None:
            return rows, ys
        w = float(max(r.candidate.micro_batch for r in runs))
        prior = [0.0] * len(rows[0])
        prior[act_col] = w
        return [*rows, prior], [*ys, w * self.act_prior]


@dataclass(frozen=True)
class StepTimeModel:
    """Seconds per optimizer step: fitted compute + modelled communication and optimizer step."""

    info: ModelInfo
    link: LinkProfile
    per_micro_step: float = 0.0  # α
    per_sample: float = 0.0  # β
    #: γ: the share of the modelled data-parallel communication the measurements bear out (stage 3's
    #: prefetched gathers and overlap_comm's reductions run under compute; the probe's message size is not the
    #: engine's). The optimizer step, offload copies and TP all-reduces sit on the critical path at face value.
    overhead_scale: float = 1.0
    #: measured correction per (stage, offload optimizer, offload param, TP degree): the mean residual of its runs
    variant_offset: Tuple[Tuple[Tuple[int, bool, bool, int], float], ...] = ()

    def _collective(self, op: str, nbytes: float, calls: float, n: int) -> float:
        """Seconds of ``calls`` calls of ``op`` over ``n`` ranks moving ``nbytes`` of message in all (ring: an
        all-reduce sends 2·(n-1)/n of it per rank, a gather or scatter (n-1)/n)."""
        if n <= 1:
            return 0.0
        latency, bandwidth = self.link.cost(op)
        factor = 2.0 if op == "all_reduce" else 1.0
        return calls * latency + factor * (n - 1) / n * nbytes / bandwidth

    def plan(self, c: Candidate) -> Plan:
        return candidate_plan(self.info, c)

    def _zero_comm(self, p: Plan, psi: float, b: int) -> float:
        """Seconds of ZeRO's collectives per step over the shard group, as the plan has the engine issue them:
        gradients reduced (``reduce_op``) every micro-step or once at the boundary; with partitioned
        parameters every unit gathered twice per micro-step (forward, backward), else the updated
        parameters gathered once after the step where the plan says so (stages 1-2). Stage 0 all-reduces
        once per step, stage 1 reduce-scatters once and gathers, stage 2 reduce-scatters every micro-step
        and gathers once, stage 3 gathers and reduce-scatters every micro-step."""
        sh, dp, g = p.sharding, p.mesh.shard_size, p.batch.accumulation_steps
        pbytes = psi * b
        reductions = g if sh.reduce_every_micro_step else 1
        if sh.partition_parameters:
            units = max(self.info.num_units, 1)
            return (g * self._collective("all_gather", 2 * pbytes, 2 * units, dp)
                    + reductions * self._collective(sh.reduce_op, pbytes, units, dp))
        buckets = math.ceil(psi / sh.reduce_bucket)
        gathers = self._collective("all_gather", pbytes, buckets, dp) if sh.gather_after_step else 0.0
        return reductions * self._collective(sh.reduce_op, pbytes, buckets, dp) + gathers

    def overheads(self, c: Candidate) -> Dict[str, float]:
        """Modelled seconds per step that the fitted compute does not cover, by cause: ZeRO's communication
        (:meth:`_zero_comm`); tensor parallelism all-reduces each layer's activations four times per
        micro-step over the model group; the optimizer step over the rank's shard (on the host where the plan
        places the optimizer there, plus the copies); fetches of host-placed parameter shards."""
        i, p = self.info, self.plan(c)
        b, g, dp, mesh = _elem_bytes(p), p.batch.accumulation_steps, p.mesh.shard_size, p.mesh
        psi = i.num_params / (mesh.model * mesh.pipe)
        out = {"comm": self._zero_comm(p, psi, b)}
        if mesh.model > 1:
            activations = p.batch.micro_batch * i.tp_elems_per_sample * b
            out["tp_comm"] = g * self._collective("all_reduce", 4 * i.tp_layers * activations, 4 * i.tp_layers,
                                                  mesh.model)
        shard = psi / (dp if p.sharding.partition_optimizer else 1)
        if p.placement.optimizer != "device":
            out["optimizer"] = shard * self.link.host_adam_s_per_elem
            out["offload_copies"] = 2 * shard * 4 / self.link.copy_bandwidth
        else:
            out["optimizer"] = shard * self.link.adam_s_per_elem
        if p.placement.params != "device":  # each gather first fetches the shard from the host (forward and backward)
            out["param_fetch"] = 2 * g * (psi / dp) * b / self.link.copy_bandwidth
        return out

    def features(self, c: Candidate) -> Tuple[float, float]:
        """(micro-steps, samples' compute per rank): tensor parallelism splits each sample's matmuls over
        its ranks, sequence parallelism its tokens; checkpointing recomputes the forward."""
        p = self.plan(c)
        g = p.batch.accumulation_steps
        r = RECOMPUTE_FACTOR if p.checkpointing.blocks else 1.0
        return float(g), float(g * p.batch.micro_batch) * r / (p.mesh.model * p.mesh.sequence)

    def predict(self, c: Candidate) -> Tuple[float, Dict[str, float]]:
        g, gm = self.features(c)
        parts = {k: v * self.overhead_scale if k == "comm" else v for k, v in self.overheads(c).items()}
        parts["compute"] = self.per_micro_step * g + self.per_sample * gm
        offset = dict(self.variant_offset).get(_variant(c))
        if offset is not None:
            parts["measured_correction"] = offset
        return max(sum(parts.values()), 1e-9), parts

    def with_offsets(self, runs: Sequence[Measurement]) -> StepTimeModel:
        """Each measured variant (stage, offloads) gets the mean residual of its runs as a correction."""
        base = replace(self, variant_offset=())
        res: Dict[Tuple[int, bool, bool, int], List[float]] = {}
        for r in runs:
            res.setdefault(_variant(r.candidate), []).append(r.step_time_s - base.predict(r.candidate)[0])
        return replace(self, variant_offset=tuple((k, sum(v) / len(v)) for k, v in sorted(res.items())))

    def fit(self, runs: Sequence[Measurement]) -> StepTimeModel:
        """Fit α and β (and, from 4 runs of differing communication on, γ) by non-negative least squares on
        the step times less the critical-path overheads. With fewer runs γ stays 1, unless the modelled
        communication alone would exceed 80% of what is left of a measured step (a probe on a noisy link):
        then γ shrinks so that it does not."""
        ok = [r for r in runs if math.isfinite(r.step_time_s) and r.step_time_s > 0]
        if not ok:
            return self
        feats = [self.features(r.candidate) for r in ok]
        comm, ts = [], []
        for r in ok:
            parts = self.overheads(r.candidate)
            comm.append(parts.pop("comm"))
            ts.append(r.step_time_s - sum(parts.values()))
        if len(ok) >= 4 and max(comm) - min(comm) > 0.05 * max(ts):
            a, b, gamma = nnls([(g, gm, o) for (g, gm), o in zip(feats, comm)], ts)
            if a + b > 0:
                return replace(self, per_micro_step=a, per_sample=b, overhead_scale=gamma).with_offsets(ok)
        gamma = min([1.0] + [0.8 * t / o for t, o in zip(ts, comm) if o > 0 and t > 0])
        a, b = nnls(feats, [t - gamma * o for t, o in zip(ts, comm)])
        return replace(self, per_micro_step=a, per_sample=b, overhead_scale=gamma).with_offsets(ok)


@dataclass(frozen=True)
class CostModel:
    """Memory and time together; :meth:`fit` refits both from every measurement so far."""

    memory: StateMemoryModel
    time: StepTimeModel
    measurements: Tuple[Measurement, ...] = ()

    @classmethod
    def create(cls, info: ModelInfo, link: LinkProfile, memory: Optional[StateMemoryModel] = None) -> CostModel:
        """``memory``: e.g. an :class:`~.memory.EstimatorMemoryModel` (default: the structural one)."""
        return cls(memory or StateMemoryModel(info), StepTimeModel(info, link))

    def fit(self, runs: Sequence[Measurement]) -> CostModel:
        runs = tuple(runs)
        return CostModel(self.memory.fit(runs), self.time.fit(runs), runs)

    def predict(self, c: Candidate) -> Prediction:
        dev, host = self.memory.predict(c)
        t, parts = self.time.predict(c)
        return Prediction(dev, host, t, parts)


def _variant(c: Candidate) -> Tuple[int, bool, bool, int]:
    return c.stage, c.offload_optimizer, c.offload_param, c.tp


def spearman(a: Sequence[float], b: Sequence[float]) -> float:
    """Spearman's rank correlation (average ranks for ties); nan for fewer than 2 points."""
    if len(a) < 2 or len(a) != len(b):
        return float("nan")

    def ranks(v: Sequence[float]) -> List[float]:
        order = sorted(range(len(v)), key=lambda k: v[k])
        out = [0.0] * len(v)
        i = 0
        while i < len(order):
            j = i
            while j + 1 < len(order) and v[order[j + 1]] == v[order[i]]:
                j += 1
            for k in range(i, j + 1):
                out[order[k]] = (i + j) / 2.0
            i = j + 1
        return out

    ra, rb = ranks(a), ranks(b)
    ma, mb = sum(ra) / len(ra), sum(rb) / len(rb)
    cov = sum((x - ma) * (y - mb) for x, y in zip(ra, rb))
    va = math.sqrt(sum((x - ma) ** 2 for x in ra))
    vb = math.sqrt(sum((y - mb) ** 2 for y in rb))
    return cov / (va * vb) if va and vb else float("nan")


def fits(p: Prediction, device_budget: Optional[float], host_budget: Optional[float], margin: float = 0.0) -> bool:
    """Whether a prediction stays within the budgets, ``margin`` (a share) above them allowed."""
    if device_budget is not None and p.device_bytes > device_budget * (1 + margin):
        return False
    return not (host_budget is not None and p.host_bytes > host_budget * (1 + margin))
