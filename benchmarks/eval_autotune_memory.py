#!/usr/bin/env python
"""The autotuner's memory prior, replayed offline on a measured grid (no training: seconds).

    python benchmarks/eval_autotune_memory.py [benchmarks/results/bench_autotune.json]

Takes the grid that ``bench_autotune.py`` measured (every candidate's peak memory per rank), fits each memory
model on the tuner's two calibration runs only (stage 3 at the smallest and the largest micro-batch) and
predicts the rest, as the search does before it has measured anything else: the structural model
(``StateMemoryModel``: ZeRO model states + a working-buffer term) and the estimator-backed one
(``EstimatorMemoryModel``: ``shardspeed.estimate.estimate_peak``). Prints the relative errors on variants
never measured, and which configs each would prune at the benchmark's budget (5% margin once measured, the
tuner's ``unmeasured_margin`` otherwise) against the truth. Last, the step-time ranking's noise ceiling: how
well a linear model fitted on all the grid's own step times ranks them (the Spearman any cost model could
reach against that grid).
"""
from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

from shardspeed.autotune.memory import EstimatorMemoryModel  # noqa: E402
from shardspeed.autotune.model import Measurement, ModelInfo, StateMemoryModel, fits  # noqa: E402
from shardspeed.autotune.search import Tuner  # noqa: E402
from shardspeed.autotune.space import Candidate  # noqa: E402
from shardspeed.estimate import describe_gpt  # noqa: E402
from shardspeed.models import GPTConfig  # noqa: E402


def parse_name(name: str) -> Candidate:
    parts = name.split("_")
    return Candidate(int(parts[0][1:]), int(parts[1][3:]), int(parts[2][3:]), "oo" in parts, "op" in parts)


def main(path: str = str(HERE / "results" / "bench_autotune.json")) -> int:
    d = json.loads(Path(path).read_text())
    m = d["model"]
    user = {"train_batch_size": m["global_batch"], "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
            "gradient_clipping": 1.0, "zero_optimization": {"stage": 0}}  # bench_autotune's user config
    spec = describe_gpt(GPTConfig(vocab_size=256, block_size=m["block_size"], n_layer=m["n_layer"], n_head=4,
                                  n_embd=m["n_embd"]), user, trace=False)
    info = ModelInfo(spec.num_params, max(spec.stage3_units), len(spec.stage3_units), "fp32", m["nproc"], True)
    grid = {parse_name(r["name"]): r for r in d["grid"] if r.get("peak_memory")}
    sizes = sorted({c.micro_batch for c in grid})
    calib = [c for c in grid if c.stage == 3 and not c.offload_optimizer and not c.offload_param
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
    return 0


def time_ceiling(rows) -> None:
    """How well any model linear in (micro-steps, stage, offloads) can rank the grid's one-shot step times:
    least squares on all of them (in-sample, 7 free terms), against the tuner's final model's ranking."""
    import numpy as np

    from shardspeed.autotune.model import spearman

    feats, meas = [], []
    for r in rows:
        c = parse_name(r["name"])
        feats.append([1.0, c.grad_accum, c.stage == 1, c.stage == 2, c.stage == 3, c.offload_optimizer,
                      c.offload_param])
        meas.append(r["step_time_s"])
    x, y = np.asarray(feats, dtype=float), np.asarray(meas)
    fit = x @ np.linalg.lstsq(x, y, rcond=None)[0]
    r2 = 1 - float(((y - fit) ** 2).sum() / ((y - y.mean()) ** 2).sum())
    print(f"step time: the tuner's model ranks the grid at Spearman "
          f"{spearman([r['predicted_step_s'] for r in rows], meas):.2f}; a linear fit on all {len(rows)} measured "
          f"times themselves reaches {spearman(list(fit), meas):.2f} (R^2 {r2:.2f}): the one-shot grid's noise ceiling")


def fits_pred(model: StateMemoryModel, c: Candidate, budget: float, margin: float) -> bool:
    from shardspeed.autotune.model import Prediction

    dev, host = model.predict(c)
    return fits(Prediction(dev, host, 0.0), budget, None, margin)


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:]))
