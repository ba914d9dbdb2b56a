"""One job: the tuner's search: probe, calibrate, predict every candidate, prune, run the best predictions, stop.

1. A few-second probe of the link and the optimizer step (:mod:`.bandwidth`).
2. Two calibration runs (stage 3 at the smallest micro-batch, the config most likely to fit, then at the
   largest, the widest lever for per-sample terms; the second smallest if that fails) give the model's
   size and fit the cost model's free terms (:mod:`.model`).
3. Every candidate is predicted; those predicted over a budget by more than ``prune_margin`` are pruned
   without running. The rest are ordered by predicted step time (the global batch is fixed, so
   throughput, latency and flops all rank by it).
4. ``model_based``: run the best prediction, refit the model with every measurement, repeat; a candidate
   measured within ``pair_margin`` of the best is rerun back to back with the best (interleaved) and the
   means compared. Stop when no remaining prediction, less the model's observed error, beats the
   measured best, or at ``tuner_num_trials`` / ``tuner_early_stopping`` / ``wall_time_budget``.
"""
from __future__ import annotations

import json
import logging
import os
import random
import shutil
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch

from shardspeed.config import AutotuningConfig, parse_config
from shardspeed.errors import ConfigError, ShardspeedError
from shardspeed.estimate import ModelSpec
from shardspeed.plan import Plan

from .memory import EstimatorMemoryModel
from .model import CostModel, LinkProfile, Measurement, ModelInfo, fits
from .report import CandidateRecord, optimal_config_path, write_experiment, write_optimal, write_summary
from .space import (
    Candidate,
    TuningSpace,
    apply_candidate,
    default_space,
    enumerate_candidates,
    sequence_parallel_sizes,
    user_plan,
)
from .trials import TrialResult, launch_command, run_command, trial_command

logger = logging.getLogger("shardspeed.autotune")

_CONFIG_FLAGS = ("--deepspeed_config", "--deepspeed", "--config")


class AutotuneError(ShardspeedError):
    """The search cannot go on (e.g. a calibration run failed); the message says where to look."""


def find_config_arg(args: Sequence[str]) -> Tuple[int, str]:
    """(index of the config path in ``args``, the path) for ``--deepspeed_config PATH`` (or ``--deepspeed``,
    ``--config``; ``--flag=PATH`` too). Raises ConfigError when none is given."""
    for i, a in enumerate(args):
        name, eq, value = a.partition("=")
        if name in _CONFIG_FLAGS:
            if eq:
                return i, value
            if i + 1 < len(args):
                return i + 1, args[i + 1]
    raise ConfigError("the script's arguments name no config: pass --deepspeed_config cfg.json (or --deepspeed)")


def _set_arg(args: List[str], index: int, value: str) -> None:
    name, eq, _ = args[index].partition("=")
    args[index] = f"{name}={value}" if eq and name in _CONFIG_FLAGS else value


def _map_args(args: List[str], mappings: Optional[Dict[str, str]], ds_config: Dict[str, Any]) -> List[str]:
    """``arg_mappings``: pass the trial's value of each config key as the script's flag too."""
    out = list(args)
    for key, flag in (mappings or {}).items():
        if key not in ds_config:
            continue
        value = str(ds_config[key])
        for i, a in enumerate(out):
            if a == flag and i + 1 < len(out):
                out[i + 1] = value
                break
            if a.startswith(flag + "="):
                out[i] = f"{flag}={value}"
                break
        else:
            out += [flag, value]
    return out


def default_device_budget(nproc: int) -> float:
    """A rank's share of the device (CUDA: the device's memory) or of host memory on CPU."""
    if torch.cuda.is_available():
        return float(torch.cuda.get_device_properties(0).total_memory)
    return float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")) / max(nproc, 1)


def _dtype(cfg: Dict[str, Any]) -> str:
    for key in ("bf16", "bfloat16"):
        if isinstance(cfg.get(key), dict) and cfg[key].get("enabled"):
            return "bf16"
    return "fp16" if isinstance(cfg.get("fp16"), dict) and cfg["fp16"].get("enabled") else "fp32"


def _checkpointing_refused(result: TrialResult) -> bool:
    """Whether a checkpointed trial failed because the model has nothing to checkpoint (the engine's
    ConfigError names ``block_types``), not for a reason of its own size (oom, timeout)."""
    return result.status == "failed" and "block_types" in result.error


@dataclass
class TuneResult:
    best: Optional[CandidateRecord]
    records: List[CandidateRecord]
    trials: int
    wall_s: float
    calibration_s: float
    model: Optional[CostModel]
    results_dir: str


@dataclass
class Tuner:
    """One `shardspeed autotune` run. ``launch`` (nproc, script, args) → command is replaceable in tests."""

    script: str
    script_args: List[str]
    nproc: int = 1
    config: Optional[AutotuningConfig] = None
    space: Optional[TuningSpace] = None
    prune_margin: float = 0.08  # prune only when predicted over budget by more than this share
    unmeasured_margin: float = 0.10  # the same, for a variant (stage, offloads) no run has measured yet
    model_spec: Optional[ModelSpec] = None  # the model, described without allocating (else from calibration)
    seq_len: Optional[int] = None  # the tokens per sample, for the checkpointed share of ``model_spec``
    pair_margin: float = 0.10  # rerun a candidate and the best back to back when within this share
    progress: bool = True
    launch: Callable[[int, str, Sequence[str]], List[str]] = trial_command
    _records: Dict[Candidate, CandidateRecord] = field(default_factory=dict)
    _runs: List[Measurement] = field(default_factory=list)
    _trials: int = 0
    _t0: float = 0.0
    stop_reason: str = ""
    probe_wall_s: float = 0.0

    def __post_init__(self) -> None:
        self._cfg_index, cfg_path = find_config_arg(self.script_args)
        try:
            with open(cfg_path) as f:
                self.user_config: Dict[str, Any] = json.load(f)
        except (OSError, ValueError) as e:
            raise ConfigError(f"cannot read the config {cfg_path}: {e}") from None
        if self.config is None:  # the whole config is checked here, before any trial runs
            self.config = parse_config(self.user_config).autotuning
        at = self.config
        self.user_plan: Plan = user_plan(self.user_config, self.nproc)  # the run the user's config describes
        self.global_batch = self.user_plan.batch.global_batch
        if at.max_train_batch_size is not None and self.global_batch > at.max_train_batch_size:
            raise ConfigError(f"the config's global batch {self.global_batch} is above autotuning.max_train_batch_size "
                              f"{at.max_train_batch_size}; lower train_batch_size or raise the bound")
        if self.global_batch < at.min_train_batch_size:
            raise ConfigError(f"the config's global batch {self.global_batch} is below autotuning.min_train_batch_size "
                              f"{at.min_train_batch_size}")
        if self.space is None:
            self.space = default_space(self.global_batch, self.nproc, fast=at.fast, mbs_range=(
                at.min_train_micro_batch_size_per_gpu, at.max_train_micro_batch_size_per_gpu),
                tp_sizes=self._tp_sizes(), sp_sizes=self._sp_sizes())
        self.candidates = enumerate_candidates(self.space, self.global_batch, self.nproc)
        if not self.candidates:
            raise ConfigError("the tuning space has no candidate for this global batch and world size")
        self.device_budget = at.device_memory_budget or default_device_budget(self.nproc)
        self.host_budget = at.host_memory_budget
        self.results_dir = os.path.abspath(at.results_dir)
        self.exps_dir = os.path.abspath(at.exps_dir)
        self._records = {c: CandidateRecord(c) for c in self.candidates}

    def _tp_sizes(self) -> Tuple[int, ...]:
        """Tensor-parallel degrees to search: every divisor of the world that divides the model's heads,
        vocabulary and FFN width when ``model_spec`` gives its shape (the cost model needs it for the
        all-reduces); otherwise the user's plan's degree alone (``tensor_parallel.autotp_size``, 1 when unset)."""
        shape = self.model_spec.shape if self.model_spec is not None else None
        if shape is None:
            return (self.user_plan.mesh.model,)
        return tuple(t for t in range(1, self.nproc + 1) if self.nproc % t == 0 and shape.n_head % t == 0
                     and shape.vocab % t == 0 and shape.ffn_hidden % t == 0)

    def _sp_sizes(self) -> Tuple[int, ...]:
        """Sequence-parallel degrees to search: with the model's shape and ``seq_len``, those
        :func:`~.space.sequence_parallel_sizes` offers (more than 1 only when activations dominate); else the
        user's plan's degree (``sequence_parallel_size``)."""
        shape = self.model_spec.shape if self.model_spec is not None else None
        if shape is None or not self.seq_len or self.model_spec is None:
            return (self.user_plan.mesh.sequence,)
        return sequence_parallel_sizes(shape, self.seq_len, self.nproc, self.model_spec.num_params,
                                       self.user_plan.precision.compute.itemsize)

    # ---- running -------------------------------------------------------------------------------------
    def _trial_config(self, cand: Candidate, exp_dir: str) -> Dict[str, Any]:
        at = self.config
        assert at is not None
        cfg = apply_candidate(self.user_config, cand, self.nproc)
        block = dict(self.user_config.get("autotuning") or {})
        block.update(enabled=True, metric_path=os.path.join(exp_dir, "metrics.json"),
                     start_profile_step=at.start_profile_step, end_profile_step=at.end_profile_step)
        cfg["autotuning"] = block
        return cfg

    def _command(self, ds_config: Dict[str, Any], config_path: str, launch: Optional[Callable[..., List[str]]] = None
                 ) -> List[str]:
        args = list(self.script_args)
        _set_arg(args, self._cfg_index, config_path)
        assert self.config is not None
        return (launch or self.launch)(self.nproc, self.script, _map_args(args, self.config.arg_mappings, ds_config))

    def run_candidate(self, cand: Candidate, tag: str = "") -> TrialResult:
        """Run one trial of ``cand`` (a rerun gets ``tag``); record its measurement."""
        assert self.config is not None
        name = cand.name + tag
        exp_dir = os.path.join(self.results_dir, name)
        metric_path = os.path.join(exp_dir, "metrics.json")
        if not self.config.overwrite and os.path.exists(metric_path):
            with open(metric_path) as f:
                result = TrialResult("ok", 0, 0.0, json.load(f))
        else:
            if os.path.exists(exp_dir):
                shutil.rmtree(exp_dir)
            ds_config = self._trial_config(cand, exp_dir)
            cmd = self._command(ds_config, os.path.join(exp_dir, "ds_config.json"))
            write_experiment(self.results_dir, self.exps_dir, name, ds_config, cmd)
            result = run_command(cmd, exp_dir, self.config.trial_timeout, metric_path)
        self._trials += 1
        self._record(cand, result)
        return result

    def _record(self, cand: Candidate, result: TrialResult) -> None:
        rec = self._records.setdefault(cand, CandidateRecord(cand))
        m = result.metrics or {}
        if "peak_memory" in m:
            rec.measured_memory = max(rec.measured_memory or 0.0, float(m["peak_memory"]))
        if result.ok:
            rec.measured_time_s.append(float(m["step_time_s"]))
            over = rec.measured_memory is not None and rec.measured_memory > self.device_budget
            rec.status = "over budget (measured)" if over else "ran"
            self._runs.append(Measurement(cand, float(m["peak_memory"]), float(m["step_time_s"])))
        else:
            rec.status = f"{result.status}: {result.error}"[:120]
            logger.warning("trial %s %s: %s", cand.name, result.status, result.error)
            if cand.activation_checkpointing and _checkpointing_refused(result):
                self._skip(lambda c: c.activation_checkpointing, f"activation checkpointing failed in {cand.name}")
            elif cand.tp > 1 and result.status == "failed":
                self._skip(lambda c: c.tp == cand.tp, f"tensor parallelism {cand.tp} failed in {cand.name}")

    def _skip(self, which: Callable[[Candidate], bool], why: str) -> None:
        """A dimension the script or model cannot take (no blocks to checkpoint, no TP plan, inputs that
        differ within a model group): no other candidate it selects will run."""
        for c, rec in self._records.items():
            if which(c) and rec.status == "not run":
                rec.status = f"skipped: {why}"
        logger.warning("%s: the candidates that need it are skipped", why)

    def probe(self) -> LinkProfile:
        """The bandwidth probe (a trial of its own); defaults when it fails."""
        assert self.config is not None
        exp_dir = os.path.join(self.results_dir, "probe_bandwidth")
        os.makedirs(exp_dir, exist_ok=True)
        out = os.path.join(exp_dir, "metrics.json")
        cmd = self.launch(self.nproc, "-m", ["shardspeed.autotune.bandwidth", out])
        result = run_command(cmd, exp_dir, min(self.config.trial_timeout, 120.0), out)
        self.probe_wall_s = result.wall_s
        m = result.metrics or {}
        if not result.ok:
            logger.warning("bandwidth probe %s (%s): using defaults", result.status, result.error)
        defaults = {"latency_s": 1e-4, "bus_bandwidth": 1e9, "adam_s_per_elem": 5e-9, "host_adam_s_per_elem": 5e-9,
                    "copy_bandwidth": 5e9}
        known = {**defaults, **{k: v for k, v in m.items() if k in LinkProfile.__dataclass_fields__}}
        return LinkProfile(**{k: float(v) for k, v in known.items()})

    def calibrate(self) -> CostModel:
        """Probe, then run the calibration candidates; the fitted cost model."""
        link = self.probe()
        assert self.space is not None
        tp = min(c.tp for c in self.candidates)
        sizes = sorted({c.micro_batch for c in self.candidates if c.tp == tp})
        per_rank = self.global_batch // (self.nproc // tp)
        infos: Dict[str, Any] = {}
        # the smallest micro-batch (most likely to fit), then the largest (the widest lever for the
        # per-sample terms; often a good config itself), falling back to the second smallest if it fails
        plan = [sizes[0]] + ([sizes[-1]] if len(sizes) > 1 else []) + ([sizes[1]] if len(sizes) > 2 else [])
        for i, m in enumerate(plan):
            cand = Candidate(3, m, per_rank // m, tp=tp)
            res = self.run_candidate(cand)
            if not res.ok and not infos:
                raise AutotuneError(f"calibration run {cand.name} {res.status}: {res.error} (see "
                                    f"{os.path.join(self.results_dir, cand.name, 'stderr.log')})")
            if res.ok:
                infos = res.metrics or {}
                if i >= 1:
                    break
        shape = self.model_spec.shape if self.model_spec is not None else None
        # a calibration at TP > 1 (the user's degree alone) measured one slice: the model is about tp of them
        info = ModelInfo(num_params=int(infos["num_params"]) * tp, largest_unit=int(infos["largest_unit"]) * tp,
                         num_units=int(infos["num_units"]), dtype=_dtype(self.user_config), world_size=self.nproc,
                         device_is_host=not torch.cuda.is_available(),
                         default_bucket=self.user_plan.sharding.reduce_bucket,
                         tp_layers=shape.n_layer if shape else 0,
                         tp_elems_per_sample=(self.seq_len or shape.max_seq) * shape.hidden if shape else 0,
                         # this rank's experts (units over the expert-data group): the model has ep_size of them
                         expert_params=int(infos.get("expert_params", 0)) * int(infos.get("ep_size", 1)),
                         ep_size=int(infos.get("ep_size", 1)))
        memory = EstimatorMemoryModel.create(info, self.user_config, self.model_spec, micro_batch=sizes[0],
                                             seq_len=self.seq_len)
        return CostModel.create(info, link, memory).fit(self._runs)

    # ---- deciding ------------------------------------------------------------------------------------
    def _fits(self, model: CostModel, c: Candidate) -> bool:
        margin = self.prune_margin if model.memory.measured(c) else self.unmeasured_margin
        return fits(model.predict(c), self.device_budget, self.host_budget, margin)

    def _best(self) -> Optional[CandidateRecord]:
        ok = [r for r in self._records.values() if r.time_s is not None and r.status in ("ran", "best")]
        return min(ok, key=lambda r: r.time_s or 0.0) if ok else None

    def _model_error(self, model: CostModel) -> float:
        """The model's mean relative step-time error on the measured runs, within [5%, 30%]."""
        errs = [abs(model.predict(r.candidate).step_time_s - r.step_time_s) / r.step_time_s for r in self._runs]
        return min(max(sum(errs) / len(errs) if errs else 0.3, 0.05), 0.3)

    def _order(self, model: CostModel, pending: List[Candidate]) -> List[Candidate]:
        """model_based: fastest prediction first, the uncertain band (predicted over the budget by less than
        the margin of a variant never measured) included: one run settles whether it fits and calibrates its
        variant, and waiting for every config predicted to fit would never reach it (the search stops first).
        Ties go to fewer micro-steps: when the fit finds no per-micro-step cost (its runs cannot tell it from
        the communication), a larger micro-batch is never slower on the same variant."""
        assert self.config is not None
        if self.config.tuner_type == "model_based":
            return sorted(pending, key=lambda c: (model.predict(c).step_time_s, c.grad_accum))
        if self.config.tuner_type == "random":
            return random.Random(0).sample(pending, len(pending))
        return pending

    def _paired(self, cand: Candidate, best: CandidateRecord) -> None:
        """Rerun ``best`` then ``cand`` back to back; their means then decide (a noisy box)."""
        self.run_candidate(best.candidate, tag="_rerun")
        self.run_candidate(cand, tag="_rerun")

    def _out_of_budget(self) -> bool:
        at = self.config
        assert at is not None
        if self._trials >= at.tuner_num_trials:
            return True
        return at.wall_time_budget is not None and time.perf_counter() - self._t0 > at.wall_time_budget

    def search(self, model: CostModel, bar: Any = None) -> CostModel:
        assert self.config is not None
        since_best = 0
        while True:
            if self._out_of_budget():
                self.stop_reason = "trial or time budget spent"
                break
            if since_best >= self.config.tuner_early_stopping:
                self.stop_reason = f"early stopping: {since_best} trials without a new best"
                break
            pending = [c for c in self.candidates if self._records[c].status == "not run" and self._fits(model, c)]
            if not pending:
                self.stop_reason = "every candidate that fits has run"
                break
            cand = self._order(model, pending)[0]
            best = self._best()
            if best is not None and self.config.tuner_type == "model_based":
                if model.predict(cand).step_time_s * (1 - self._model_error(model)) >= (best.time_s or 0.0):
                    self.stop_reason = "no remaining prediction can beat the measured best"
                    break
            res = self.run_candidate(cand)
            rec = self._records[cand]
            if res.ok and best is not None and rec.status == "ran" and rec.time_s is not None and best.time_s:
                # a new best by less than the noise: rerun the two back to back before believing it
                if (1 - self.pair_margin) * best.time_s <= rec.time_s < best.time_s and not self._out_of_budget():
                    self._paired(cand, best)
            new_best = self._best()
            since_best = 0 if new_best is not None and new_best is not best and new_best.candidate == cand else since_best + 1
            model = model.fit(self._runs)
            if bar is not None:
                bar.update(self._trials - bar.n)
                if new_best is not None:
                    bar.set_postfix_str(f"best {new_best.candidate.name} {new_best.time_s:.3f}s/step")
        return model

    def _finalise(self, model: Optional[CostModel]) -> Optional[CandidateRecord]:
        best = self._best()
        for rec in self._records.values():
            if model is not None:
                rec.prediction = model.predict(rec.candidate)
            if rec.status != "not run":
                continue
            if model is not None and not self._fits(model, rec.candidate):
                p = rec.prediction
                assert p is not None
                rec.status = (f"pruned: memory {p.device_bytes / 1e9:.2f} GB > budget "
                              f"{self.device_budget / 1e9:.2f} GB" if p.device_bytes > self.device_budget
                              else "pruned: host memory over budget")
            elif model is not None and not fits(model.predict(rec.candidate), self.device_budget, self.host_budget):
                rec.status = "not run: memory uncertain (over budget by less than the margin; variant unmeasured)"
            elif self.stop_reason.startswith("no remaining"):
                rec.status = "not run: predicted slower than the best"
            else:
                rec.status = f"not run: {self.stop_reason}"
        if best is not None:
            best.status = "best"
        return best

    def run(self) -> TuneResult:
        """The whole search; writes the results layout and returns what it found."""
        assert self.config is not None
        self._t0 = time.perf_counter()
        os.makedirs(self.results_dir, exist_ok=True)
        from tqdm import tqdm

        bar = tqdm(total=min(self.config.tuner_num_trials, len(self.candidates) + 2), desc="autotune",
                   unit="trial", disable=not self.progress)
        model: Optional[CostModel] = None
        calibration_s = 0.0
        try:
            model = self.calibrate()
            calibration_s = time.perf_counter() - self._t0
            bar.update(self._trials)
            model = self.search(model, bar)
        finally:
            bar.close()
        best = self._finalise(model)
        wall = time.perf_counter() - self._t0
        header = (f"shardspeed autotune: {self.script} on {self.nproc} rank(s), global batch {self.global_batch}, "
                  f"device budget {self.device_budget / 1e9:.2f} GB/rank; {self._trials} trials in {wall:.0f} s "
                  f"(calibration {calibration_s:.0f} s); stopped: {self.stop_reason or 'calibration failed'}; best: "
                  f"{best.candidate.name if best else 'none'}")
        write_summary(self.results_dir, list(self._records.values()), header)
        if best is not None:
            with open(os.path.join(self.results_dir, best.candidate.name, "ds_config.json")) as f:
                best_cfg = json.load(f)
            write_optimal(self.results_dir, best_cfg,
                          self._command(best_cfg, optimal_config_path(self.results_dir), launch_command))
        return TuneResult(best, list(self._records.values()), self._trials, wall, calibration_s, model,
                          self.results_dir)
