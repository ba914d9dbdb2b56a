"""The cost model's memory prior from :func:`shardspeed.estimate.estimate_peak` (pure: no process group).

:class:`EstimatorMemoryModel` replaces the structural part of :class:`~.model.StateMemoryModel` (model states
+ a rough working-buffer term) with the estimator's per-rank peak for the candidate's config, activations
left out: parameters, gradients and their buckets, master weights, optimizer states, the stage-3 gathered
units and the offload tiles, as the engine allocates them. On top of it, as before, come a base per measured
variant (stage, offloads: the runtime, allocator and data the estimator does not see) and activations per
sample, both fitted from measured peaks. A variant no run has measured yet gets the estimator's structure and
the mean base of the measured ones: that is the prior the search prunes on.

The model is described without allocating it: a :class:`~shardspeed.estimate.ModelSpec` from
``shardspeed.estimate.describe*`` when the caller has one, else one made from the calibration run's measured
parameter count, largest ZeRO unit and number of units (:func:`spec_from_facts`).

Activation checkpointing keeps ``ckpt_share`` of the activations: from the estimator's activation formulas
(checkpointed / not, at the micro-batch and sequence length given) when the spec has a transformer shape,
else :data:`~.model.CHECKPOINTED_ACTIVATION_SHARE`; once a checkpointed run is measured, the share is fitted
(a column of its own in the bases' least squares).
"""
from __future__ import annotations

import copy
import math
from dataclasses import dataclass, field, replace
from typing import Any, Dict, Optional, Sequence, Set, Tuple

from shardspeed.estimate import ActivationProfile, ModelSpec, estimate_peak, formula_activations

from .model import Measurement, ModelInfo, StateMemoryModel, _variant, nnls
from .space import Candidate, apply_candidate


def spec_from_facts(num_params: int, largest_unit: int, num_units: int) -> ModelSpec:
    """A ModelSpec from what a calibration run measured: ``num_units`` units, the largest as measured and
    the rest of the parameters spread evenly over the others (the parameters are those units)."""
    n = max(int(num_units), 1)
    largest = min(int(largest_unit), int(num_params))
    rest = int(num_params) - largest
    others = [rest // (n - 1) + (1 if i < rest % (n - 1) else 0) for i in range(n - 1)] if n > 1 else []
    units = tuple(u for u in [*others, largest] if u > 0)  # the root's unit last, as select_units orders them
    return ModelSpec("measured model", units, units)


def checkpointed_share(spec: ModelSpec, micro_batch: int, seq_len: Optional[int] = None, elem_bytes: int = 2
                       ) -> Optional[float]:
    """Peak activation bytes with checkpointing over those without, by the estimator's formulas for the
    spec's transformer shape (None without one)."""
    if spec.shape is None:
        return None
    s = seq_len or spec.shape.max_seq
    on, off = (formula_activations(spec.shape, micro_batch, s, elem_bytes, checkpointing=ck).peak_bytes
               for ck in (True, False))
    return on / off if off > 0 else None


def activation_prior(spec: ModelSpec, seq_len: Optional[int] = None, elem_bytes: int = 2) -> Optional[float]:
    """Activation bytes per sample by the estimator's formulas for the spec's transformer shape (the peak
    at micro-batch 8, per sample; None without a shape)."""
    if spec.shape is None:
        return None
    mb = 8
    return formula_activations(spec.shape, mb, seq_len or spec.shape.max_seq, elem_bytes).peak_bytes / mb


@dataclass(frozen=True)
class EstimatorMemoryModel(StateMemoryModel):
    """:class:`StateMemoryModel` whose structure is :func:`estimate_peak` of the candidate's config."""

    spec: Optional[ModelSpec] = None
    config: Dict[str, Any] = field(default_factory=dict)  # the user's config (its autotuning block dropped)
    ckpt_measured: bool = False  # whether a checkpointed run has been measured (else the share is a prior)
    seq_len: Optional[int] = None  # tokens per sample (for the shares the formulas give)
    _cache: Dict[Candidate, Tuple[float, float]] = field(default_factory=dict, compare=False, repr=False)

    def measured(self, c: Candidate) -> bool:
        """The variant has a measured base and, for a checkpointed candidate, some checkpointed run was measured
        (until then its activations rest on the prior share, and the search keeps the wider margin)."""
        return super().measured(c) and (self.ckpt_measured or not c.activation_checkpointing)

    @classmethod
    def create(cls, info: ModelInfo, user_config: Dict[str, Any], spec: Optional[ModelSpec] = None,
               micro_batch: int = 1, seq_len: Optional[int] = None) -> EstimatorMemoryModel:
        """The prior for ``user_config`` at ``info.world_size`` ranks; ``spec`` defaults to :func:`spec_from_facts`
        of ``info``."""
        cfg = {k: copy.deepcopy(v) for k, v in user_config.items() if k != "autotuning"}
        spec = spec or spec_from_facts(info.num_params, info.largest_unit, info.num_units)
        share = checkpointed_share(spec, micro_batch, seq_len, info.bytes_per_param)
        prior = activation_prior(spec, seq_len, info.bytes_per_param)
        model = cls(info, spec=replace(spec, activations=None), config=cfg, act_prior=prior,
                    act_per_sample=prior or 0.0, seq_len=seq_len)
        return replace(model, ckpt_share=share) if share is not None else model

    def tp_share(self, tp: int) -> float:
        """Share of a sample's activations a rank keeps at tensor-parallel degree ``tp``, by the estimator's
        formulas for the spec's transformer shape (1 without one)."""
        shape = self.spec.shape if self.spec is not None else None
        if tp == 1 or shape is None:
            return 1.0
        s, b = self.seq_len or shape.max_seq, self.info.bytes_per_param
        split, whole = (formula_activations(shape, 8, s, b, tp=t).peak_bytes for t in (tp, 1))
        return split / whole if whole > 0 else 1.0

    def structural(self, c: Candidate) -> Tuple[float, float]:
        """(device, host) bytes of the estimator's peak without activations; on a CPU device the sum of the
        training step's worst phase (device and host are one memory; the trial counts from the engine's
        construction on, so the start-up phase is not part of it)."""
        if c not in self._cache:
            assert self.spec is not None
            cfg = apply_candidate(self.config, c, self.info.world_size)
            zero = ActivationProfile(0.0, 0.0, c.micro_batch, 1, c.activation_checkpointing, "fitted")
            est = estimate_peak(self.spec.with_activations(zero), cfg, world_size=self.info.world_size, tp=c.tp,
                                micro_batch=c.micro_batch, checkpointing=c.activation_checkpointing)
            dev = sum(est.terms.values()) if self.info.device_is_host else est.device
            self._cache[c] = (dev, est.host)
        return self._cache[c]

    def fit(self, runs: Sequence[Measurement]) -> EstimatorMemoryModel:
        """The bases and activations per sample (as :meth:`StateMemoryModel.fit`). Once a checkpointed run
        of a variant with plain runs at two micro-batches is measured, the checkpointed activations per
        sample are a column of their own in the same least squares, and their ratio is the share."""
        ok = [r for r in runs if math.isfinite(r.peak_memory) and r.peak_memory > 0]
        if any(r.candidate.activation_checkpointing for r in ok):
            return replace(self, ckpt_measured=True)._fit(ok)
        return self._fit(ok)

    def _fit(self, ok: Sequence[Measurement]) -> EstimatorMemoryModel:
        plain = [r for r in ok if not r.candidate.activation_checkpointing]
        sizes: Dict[Tuple[int, bool, bool, int], Set[int]] = {_variant(r.candidate): set() for r in plain}
        for r in plain:
            sizes[_variant(r.candidate)].add(r.candidate.micro_batch)
        ck = [r for r in ok if r.candidate.activation_checkpointing and _variant(r.candidate) in sizes]
        if not ck or max(len(v) for v in sizes.values()) < 2:
            fitted = super().fit(ok)
            assert isinstance(fitted, EstimatorMemoryModel)
            return fitted
        keys = sorted({_variant(r.candidate) for r in ok})
        rows = [[1.0 if _variant(r.candidate) == k else 0.0 for k in keys]
                + [0.0 if r.candidate.activation_checkpointing else float(r.candidate.micro_batch),
                   float(r.candidate.micro_batch) if r.candidate.activation_checkpointing else 0.0] for r in ok]
        ys = [r.peak_memory - self.structural(r.candidate)[0] for r in ok]
        *bases, act, act_ck = nnls(*self.with_prior(rows, ys, len(keys), ok))
        share = min(act_ck / act, 1.0) if act > 0 else self.ckpt_share
        return replace(self, base=sum(bases) / len(bases), act_per_sample=act, ckpt_share=share,
                       variant_base=tuple(zip(keys, bases)))
