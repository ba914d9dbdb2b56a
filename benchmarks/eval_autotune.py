#!/usr/bin/env python
"""The autotuner replayed offline on a measured grid (no training: seconds).

    python benchmarks/eval_autotune.py [benchmarks/results/bench_autotune.json]

Takes the grid that ``bench_autotune.py`` measured (every candidate's peak memory per rank), fits each memory
model on the tuner's two calibration runs only (stage 3 at the smallest and the largest micro-batch) and
predicts the rest, as the search does before it has measured anything else: the structural model
(``StateMemoryModel``: ZeRO model states + a working-buffer term) and the estimator-backed one
(``EstimatorMemoryModel``: ``shardspeed.estimate.estimate_peak``). Prints the relative errors on variants
never measured, and which configs each would prune at the benchmark's budget (5% margin once measured, the
tuner's ``unmeasured_margin`` otherwise) against the truth. Last, the step-time ranking's noise ceiling: how
well a linear model fitted on all the grid's own step times ranks them (the Spearman any cost model could
reach against that grid).

Then the whole search, replayed (:class:`ReplayTuner`): the tuner as it is, its probe and trials answered by
the grid's measurements (a candidate's k-th trial gets the grid's k-th pass of it, so reruns see the passes'
spread) and wall time counted as the grid's trials took it. It prints what the real search would have
done on that grid: trials, wall time, winner against the grid's best, memory-pruned configs, and the Spearman
of its final step-time predictions against the grid. A change to the cost model or the search is judged here
first, in seconds, before a benchmark run of ~5 minutes.
"""
from __future__ import annotations

import json
import random
import statistics
import sys
import tempfile
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

from shardspeed.autotune.memory import EstimatorMemoryModel  # noqa: E402
from shardspeed.autotune.model import LinkProfile, Measurement, ModelInfo, StateMemoryModel, fits, spearman  # noqa: E402
from shardspeed.autotune.search import Tuner  # noqa: E402
from shardspeed.autotune.space import Candidate, TuningSpace  # noqa: E402
from shardspeed.autotune.trials import TrialResult  # noqa: E402
from shardspeed.config import AutotuningConfig  # noqa: E402
from shardspeed.estimate import describe_gpt  # noqa: E402
from shardspeed.models import GPTConfig  # noqa: E402


def parse_name(name: str) -> Candidate:
    parts = name.split("_")
    tp = next((int(p[2:]) for p in parts if p.startswith("tp")), 1)
    return Candidate(int(parts[0][1:]), int(parts[1][3:]), int(parts[2][3:]), "oo" in parts, "op" in parts, tp=tp)


def main(path: str = str(HERE / "results" / "bench_autotune.json")) -> int:
    d = json.loads(Path(path).read_text())
    m = d["model"]
    user = {"train_batch_size": m["global_batch"], "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
            "gradient_clipping": 1.0, "zero_optimization": {"stage": 0}}  # bench_autotune's user config
    spec = describe_gpt(GPTConfig(vocab_size=256, block_size=m["block_size"], n_layer=m["n_layer"], n_head=4,
                                  n_embd=m["n_embd"]), user, trace=False)
    info = ModelInfo(spec.num_params, max(spec.stage3_units), len(spec.stage3_units), "fp32", m["nproc"], True,
                     tp_layers=m["n_layer"], tp_elems_per_sample=m["block_size"] * m["n_embd"])
    grid = {parse_name(r["name"]): r for r in d["grid"] if r.get("peak_memory")}
    sizes = sorted({c.micro_batch for c in grid})
    calib = [c for c in grid if c.stage == 3 and not c.offload_optimizer and not c.offload_param and c.tp == 1
             and c.micro_batch in (sizes[0], sizes[-1])]
    runs = [Measurement(c, float(grid[c]["peak_memory"]), float(grid[c]["step_time_s"])) for c in calib]
    budget = float(d["budget_bytes"])
    margin = Tuner.__dataclass_fields__["unmeasured_margin"].default
    models = {"structural (StateMemoryModel)": StateMemoryModel(info).fit(runs),
              "estimator, measured facts": EstimatorMemoryModel.create(info, user).fit(runs),
              "estimator, described GPT": EstimatorMemoryModel.create(info, user, spec).fit(runs)}
    print(f"{len(grid)} measured configs, calibration {[c.name for c in calib]}, budget {budget / 1e6:.0f} MB, "
          f"unmeasured margin {margin:.0%}")
    for label, model in models.items():
        rest = [c for c in grid if c not in calib]
        errs = [(model.predict(c)[0] - grid[c]["peak_memory"]) / grid[c]["peak_memory"] for c in rest]
        wrong = [c.name for c in rest if not fits_pred(model, c, budget, margin)
                 and grid[c]["peak_memory"] <= budget]
        missed = [c.name for c in rest if fits_pred(model, c, budget, 0.0) and grid[c]["peak_memory"] > budget]
        print(f"{label:32s} error on the {len(rest)} others: mean |e| {statistics.mean(map(abs, errs)):.1%}, "
              f"max |e| {max(map(abs, errs)):.1%}, mean e {statistics.mean(errs):+.1%}; "
              f"wrongly pruned {len(wrong)} {wrong}; predicted to fit but over {len(missed)}")
    time_ceiling(d["grid"])
    if "probe" in d:
        replay(d, spec)
        replay_draws(d, spec, 50)
    else:
        print("(no probe figures in this results file: the search replay needs a bench_autotune.py run that saved them)")
    return 0


@dataclass
class ReplayTuner(Tuner):
    """The tuner with its probe and trials answered from a measured grid (no process is started)."""

    grid_runs: Dict[Candidate, List[Dict[str, Any]]] = field(default_factory=dict)
    link: LinkProfile = field(default_factory=lambda: LinkProfile(1e-4, 1e9, 5e-9, 5e-9, 5e9))
    facts: Dict[str, int] = field(default_factory=dict)  # num_params, largest_unit, num_units
    probe_wall_s: float = 0.0
    draw: Optional[random.Random] = None  # None: a candidate's k-th trial gets pass k; else a random pass
    wall_s: float = 0.0
    _seen: Counter = field(default_factory=Counter)

    def probe(self) -> LinkProfile:
        self.wall_s += self.probe_wall_s
        return self.link

    def run_candidate(self, cand: Candidate, tag: str = "") -> TrialResult:
        runs = self.grid_runs[cand]
        r = runs[self.draw.randrange(len(runs)) if self.draw else self._seen[cand] % len(runs)]
        self._seen[cand] += 1
        ok = r["status"] == "ok"
        metrics = dict(self.facts, step_time_s=r["step_time_s"], peak_memory=r["peak_memory"]) if ok else None
        result = TrialResult(r["status"], 0 if ok else 1, float(r["wall_s"]), metrics, "" if ok else r["status"])
        self.wall_s += result.wall_s
        self._trials += 1
        self._record(cand, result)
        return result


def replay(d: Dict[str, Any], spec, draw: Optional[random.Random] = None, quiet: bool = False) -> Dict[str, Any]:
    """The search on the grid's measurements (``draw``: each trial gets a random pass of its candidate);
    prints and returns its figures."""
    m = d["model"]
    grid = {parse_name(r["name"]): r for r in d["grid"]}
    runs = {c: r.get("runs") or [r] for c, r in grid.items()}
    budget = float(d["budget_bytes"])
    with tempfile.TemporaryDirectory() as tmp:
        cfg = Path(tmp) / "user.json"
        cfg.write_text(json.dumps({"train_batch_size": m["global_batch"], "optimizer": {"type": "AdamW"},
                                   "zero_optimization": {"stage": 0}}))
        at = AutotuningConfig(device_memory_budget=budget, results_dir=tmp, exps_dir=tmp,
                              **d.get("autotuning", {}))
        space = TuningSpace(stages=tuple(sorted({c.stage for c in grid})),
                            micro_batches=tuple(sorted({c.micro_batch for c in grid})),
                            tp_sizes=tuple(sorted({c.tp for c in grid})))
        tuner = ReplayTuner("replay", ["--deepspeed_config", str(cfg)], nproc=m["nproc"], config=at, space=space,
                            model_spec=spec, seq_len=m["block_size"], progress=False, grid_runs=runs,
                            link=LinkProfile(**{k: float(d["probe"][k]) for k in LinkProfile.__dataclass_fields__}),
                            facts={"num_params": spec.num_params, "largest_unit": max(spec.stage3_units),
                                   "num_units": len(spec.stage3_units)},
                            probe_wall_s=float(d.get("probe_wall_s", 0.0)), draw=draw)
        model = tuner.search(tuner.calibrate())
        best = tuner._finalise(model)
    fitting = {c: r for c, r in grid.items() if r["status"] == "ok" and r["peak_memory"] <= budget}
    grid_best = min(fitting, key=lambda c: fitting[c]["step_time_s"])
    ok = [c for c, r in grid.items() if r["status"] == "ok"]
    rho = spearman([model.predict(c).step_time_s for c in ok], [grid[c]["step_time_s"] for c in ok])
    pruned = [r.candidate for r in tuner._records.values() if r.status.startswith("pruned: memory")]
    out = {"trials": tuner._trials, "trial_ratio": tuner._trials / len(grid), "wall_s": tuner.wall_s,
           "wall_ratio": tuner.wall_s / float(d["grid_wall_s"]), "winner": best.candidate.name if best else None,
           "grid_best": grid_best.name,
           "throughput_ratio": (fitting[grid_best]["step_time_s"] / grid[best.candidate]["step_time_s"]
                                if best else 0.0),
           "pruned_really_over": all(grid[c]["peak_memory"] > budget for c in pruned), "pruned": len(pruned),
           "spearman": rho, "stop": tuner.stop_reason}
    out["ran"] = [c.name for c, r in tuner._records.items() if r.measured_time_s or r.measured_memory]
    if not quiet:
        print("search replayed on the grid: " + ", ".join(f"{k} {v:.3g}" if isinstance(v, float) else f"{k} {v}"
                                                          for k, v in out.items()))
    return out


def replay_draws(d: Dict[str, Any], spec, draws: int) -> None:
    """The replay ``draws`` times, each trial drawing one of its candidate's passes at random: how often
    each check holds when the same search meets the box's noise differently."""
    outs = [replay(d, spec, random.Random(k), quiet=True) for k in range(draws)]
    n = len(outs)
    checks = {"throughput >= 0.95": sum(o["throughput_ratio"] >= 0.95 for o in outs),
              "trials <= 1/5": sum(o["trial_ratio"] <= 0.2 for o in outs),
              "wall <= 1/5": sum(o["wall_ratio"] <= 0.2 for o in outs),
              "pruned really over": sum(o["pruned_really_over"] for o in outs),
              "spearman >= 0.8": sum(o["spearman"] >= 0.8 for o in outs)}
    print(f"{n} replays with random passes: " + ", ".join(f"{k} in {v}/{n}" for k, v in checks.items())
          + f"; throughput ratio min {min(o['throughput_ratio'] for o in outs):.2f}, trials max "
          f"{max(o['trials'] for o in outs)}, spearman min {min(o['spearman'] for o in outs):.2f}; winners "
          + str(Counter(o["winner"] for o in outs).most_common()))


def time_ceiling(rows) -> None:
    """How well any model linear in (micro-steps, stage, offloads, TP) can rank the grid's one-shot step times:
    least squares on all of them (in-sample, 8 free terms), against the tuner's final model's ranking."""
    import numpy as np

    from shardspeed.autotune.model import spearman

    feats, meas = [], []
    for r in rows:
        c = parse_name(r["name"])
        feats.append([1.0, c.grad_accum, c.stage == 1, c.stage == 2, c.stage == 3, c.offload_optimizer,
                      c.offload_param, c.tp > 1])
        meas.append(r["step_time_s"])
    x, y = np.asarray(feats, dtype=float), np.asarray(meas)
    fit = x @ np.linalg.lstsq(x, y, rcond=None)[0]
    r2 = 1 - float(((y - fit) ** 2).sum() / ((y - y.mean()) ** 2).sum())
    print(f"step time: the tuner's model ranks the grid at Spearman "
          f"{spearman([r['predicted_step_s'] for r in rows], meas):.2f}; a linear fit on all {len(rows)} measured "
          f"times themselves reaches {spearman(list(fit), meas):.2f} (R^2 {r2:.2f}): the grid's noise ceiling")


def fits_pred(model: StateMemoryModel, c: Candidate, budget: float, margin: float) -> bool:
    from shardspeed.autotune.model import Prediction

    dev, host = model.predict(c)
    return fits(Prediction(dev, host, 0.0), budget, None, margin)


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:]))
