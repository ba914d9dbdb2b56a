#!/usr/bin/env python
"""Model-guided autotuning against an exhaustive grid over the same space, under a memory budget.

    python benchmarks/bench_autotune.py --quick          # GPT (256 wide, 4 layers) at world 2, ~25 min here

1. The grid: every candidate of the space (ZeRO stage 0-3 × micro-batch {1,2,4,8} with the global batch
   kept × optimizer offload × parameter offload × tensor-parallel degree 1 or 2: 36 configs at TP 1, and
   12 at TP 2, where one data-parallel rank is left: stage 0 and the two offloads; 48 in all) runs as a
   trial, the same way the tuner runs one (benchmarks/autotune_gpt.py, --profile-steps timed steps from
   step 3), in --grid-repeats passes (default 3), each in its own shuffled order. A config's step time and
   peak memory per rank are the medians of its passes: one pass is noise on a shared box.
2. The budget: the artificial device-memory budget is the --budget-quantile (default 0.5) of the grid's
   measured peaks, so part of the space does not fit (the box has no small device to run out of).
3. The tuner (`shardspeed.autotune.search.Tuner`, model_based) runs in a directory of its own, knowing
   nothing of the grid: probe, two calibration runs, then the best predictions.

Checks: the tuned config's throughput ≥ 95% of the best config that fits in the grid (both as measured
by the grid; when they differ they are also rerun back to back, --pairs times each, and the means
compared); tuner trials and wall time (probe and calibration included) ≤ 1/5 of the grid's; every config
the tuner pruned for memory exceeds the budget in the grid; Spearman ≥ 0.8 between the tuner's final
predicted step times and the grid's measured ones. Writes benchmarks/results/bench_autotune.json.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

from shardspeed.autotune.model import spearman  # noqa: E402
from shardspeed.autotune.search import Tuner  # noqa: E402
from shardspeed.autotune.space import TuningSpace, enumerate_candidates  # noqa: E402
from shardspeed.config import AutotuningConfig  # noqa: E402


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="the sizes above (the default is a larger GPT)")
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--global-batch", type=int, default=16)
    p.add_argument("--n-embd", type=int, default=None)
    p.add_argument("--n-layer", type=int, default=None)
    p.add_argument("--block-size", type=int, default=None)
    p.add_argument("--budget-quantile", type=float, default=0.5)
    p.add_argument("--pairs", type=int, default=2)
    p.add_argument("--grid-repeats", type=int, default=3,
                   help="run the whole grid this many times, each pass in its own shuffled order; a config's step "
                        "time and peak are the medians over its passes (one pass is noise on a shared box)")
    p.add_argument("--profile-steps", type=int, default=6,
                   help="optimizer steps timed per trial (from step 3 on; the median is the trial's step time)")
    p.add_argument("--workdir", default=None)
    p.add_argument("--reuse-grid", default=None, metavar="JSON",
                   help="take the grid's measurements from an earlier run's results JSON (same sizes) instead of "
                        "running it again; the tuner always runs")
    p.add_argument("--out", default=str(HERE / "results" / "bench_autotune.json"))
    return p.parse_args(argv)


def user_config(workdir: Path, name: str, a: argparse.Namespace, **autotuning) -> Path:
    cfg = {"train_batch_size": a.global_batch, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
           "gradient_clipping": 1.0, "zero_optimization": {"stage": 0},
           "autotuning": {"start_profile_step": 3, "end_profile_step": 2 + a.profile_steps, "trial_timeout": 300,
                          "results_dir": str(workdir / name / "autotuning_results"),
                          "exps_dir": str(workdir / name / "autotuning_exps"), **autotuning}}
    path = workdir / f"{name}.json"
    path.write_text(json.dumps(cfg))
    return path


def model_spec(a: argparse.Namespace, config):
    """autotune_gpt.py's GPT described on the meta device (the memory prior's shape; nothing allocated)."""
    from shardspeed.estimate import describe_gpt
    from shardspeed.models import GPTConfig

    return describe_gpt(GPTConfig(vocab_size=256, block_size=a.block_size, n_layer=a.n_layer, n_head=4,
                                  n_embd=a.n_embd), config, trace=False)


def script_args(cfg: Path, a: argparse.Namespace):
    return ["--deepspeed_config", str(cfg), "--n-embd", str(a.n_embd), "--n-layer", str(a.n_layer),
            "--block-size", str(a.block_size)]


SPACE = TuningSpace(stages=(0, 1, 2, 3), micro_batches=(1, 2, 4, 8), offload_optimizer=(False, True),
                    offload_param=(False, True), tp_sizes=(1, 2))


def run_grid(a, workdir: Path):
    """Every candidate once, in a shuffled order (so drift in the box's load spreads evenly)."""
    import random

    cfg = user_config(workdir, "grid", a, device_memory_budget=1e15, tuner_num_trials=10_000)
    tuner = Tuner(str(HERE / "autotune_gpt.py"), script_args(cfg, a), nproc=a.nproc, space=SPACE, progress=True,
                  config=AutotuningConfig(**json.loads(cfg.read_text())["autotuning"]))
    cands = enumerate_candidates(SPACE, a.global_batch, a.nproc)
    if a.reuse_grid:
        old = json.loads(Path(a.reuse_grid).read_text())
        by_name = {c.name: c for c in cands}
        rows = {by_name[r["name"]]: {k: r[k] for k in ("name", "status", "step_time_s", "peak_memory", "wall_s", "runs")
                                     if k in r} for r in old["grid"]}
        return rows, float(old["grid_wall_s"]), tuner
    t0 = time.perf_counter()
    runs: dict = {c: [] for c in cands}
    for rep in range(a.grid_repeats):
        order = list(cands)
        random.Random(rep).shuffle(order)
        for i, c in enumerate(order):
            res = tuner.run_candidate(c, tag=f"_rep{rep}" if rep else "")
            m = res.metrics or {}
            runs[c].append({"status": res.status, "step_time_s": m.get("step_time_s"),
                            "peak_memory": m.get("peak_memory"), "wall_s": res.wall_s})
            print(f"grid pass {rep + 1}/{a.grid_repeats} {i + 1}/{len(order)} {c.name}: {res.status} "
                  f"step {m.get('step_time_s')} mem {m.get('peak_memory')}", flush=True)
    rows = {c: _summarize(c, rs) for c, rs in runs.items()}
    return rows, time.perf_counter() - t0, tuner


def _summarize(c, rs: list) -> dict:
    """One grid row from a config's passes: medians of the passes that ran (every pass kept under "runs")."""
    import statistics

    ok = [r for r in rs if r["status"] == "ok"]
    med = (lambda k: statistics.median(r[k] for r in ok)) if ok else (lambda k: None)
    return {"name": c.name, "status": "ok" if ok else rs[0]["status"], "step_time_s": med("step_time_s"),
            "peak_memory": med("peak_memory"), "wall_s": sum(r["wall_s"] for r in rs), "runs": rs}


def paired(tuner: Tuner, a, b, pairs: int):
    """Rerun candidates a and b back to back ``pairs`` times; their mean step times."""
    ta, tb = [], []
    for k in range(pairs):
        for cand, out in ((a, ta), (b, tb)) if k % 2 == 0 else ((b, tb), (a, ta)):
            res = tuner.run_candidate(cand, tag=f"_pair{k}")
            if res.ok:
                out.append(float(res.metrics["step_time_s"]))
    return (sum(ta) / len(ta) if ta else None), (sum(tb) / len(tb) if tb else None)


def main(argv=None) -> int:
    a = parse_args(argv)
    defaults = (256, 4, 32) if a.quick else (384, 6, 64)
    a.n_embd, a.n_layer, a.block_size = (v if v is not None else d for v, d in
                                         zip((a.n_embd, a.n_layer, a.block_size), defaults))
    workdir = Path(a.workdir or tempfile.mkdtemp(prefix="bench_autotune_"))
    if workdir.exists() and a.workdir:
        shutil.rmtree(workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    grid, grid_wall, grid_tuner = run_grid(a, workdir)
    peaks = sorted(r["peak_memory"] for r in grid.values() if r["peak_memory"])
    budget = float(peaks[min(int(a.budget_quantile * len(peaks)), len(peaks) - 1)])
    fits = {c: r for c, r in grid.items() if r["status"] == "ok" and r["peak_memory"] <= budget}
    grid_best = min(fits, key=lambda c: fits[c]["step_time_s"])
    print(f"budget {budget / 1e6:.1f} MB/rank: {len(fits)} of {len(grid)} configs fit; grid best {grid_best.name} "
          f"{fits[grid_best]['step_time_s']:.4f} s/step; grid wall {grid_wall:.0f} s", flush=True)

    cfg = user_config(workdir, "tuned", a, device_memory_budget=budget)
    tuner = Tuner(str(HERE / "autotune_gpt.py"), script_args(cfg, a), nproc=a.nproc, space=SPACE, progress=True,
                  config=AutotuningConfig(**json.loads(cfg.read_text())["autotuning"]),
                  model_spec=model_spec(a, json.loads(cfg.read_text())), seq_len=a.block_size)
    result = tuner.run()
    assert result.best is not None and result.model is not None
    tuned = result.best.candidate
    print((Path(result.results_dir) / "summary.txt").read_text(), flush=True)

    ratio_grid = fits[grid_best]["step_time_s"] / grid[tuned]["step_time_s"] if grid[tuned]["step_time_s"] else 0.0
    paired_ratio = None
    if tuned != grid_best and a.pairs > 0:
        t_tuned, t_best = paired(grid_tuner, tuned, grid_best, a.pairs)
        paired_ratio = t_best / t_tuned if t_tuned and t_best else None
    pruned = [r.candidate for r in result.records if r.status.startswith("pruned: memory")]
    pruned_over = [c for c in pruned if (grid[c]["peak_memory"] or 0) > budget]
    ok = [c for c, r in grid.items() if r["status"] == "ok"]
    rho = spearman([result.model.predict(c).step_time_s for c in ok], [grid[c]["step_time_s"] for c in ok])
    rho_fit = spearman([result.model.predict(c).step_time_s for c in fits], [fits[c]["step_time_s"] for c in fits])
    mem_err = [abs(result.model.predict(c).device_bytes - grid[c]["peak_memory"]) / grid[c]["peak_memory"] for c in ok]
    # the box's noise: configs the tuner measured too, its mean step time over the grid's
    repeat = {r.candidate.name: r.time_s / grid[r.candidate]["step_time_s"] for r in result.records
              if r.time_s and grid[r.candidate]["step_time_s"]}
    out = {
        "model": {"n_embd": a.n_embd, "n_layer": a.n_layer, "block_size": a.block_size, "nproc": a.nproc,
                  "global_batch": a.global_batch},
        "budget_bytes": budget, "grid_trials": len(grid), "grid_wall_s": grid_wall,
        "grid_best": grid_best.name, "grid_best_step_s": fits[grid_best]["step_time_s"],
        "tuned": tuned.name, "tuned_step_s_in_grid": grid[tuned]["step_time_s"],
        "throughput_ratio_grid": ratio_grid, "throughput_ratio_paired": paired_ratio,
        "tuner_trials": result.trials, "tuner_wall_s": result.wall_s, "tuner_calibration_s": result.calibration_s,
        "trial_ratio": result.trials / len(grid), "wall_ratio": result.wall_s / grid_wall,
        "pruned_for_memory": [c.name for c in pruned], "pruned_really_over": len(pruned_over) == len(pruned),
        "spearman_all": rho, "spearman_fitting": rho_fit,
        "memory_error_mean": sum(mem_err) / len(mem_err), "memory_error_max": max(mem_err),
        "tuner_over_grid_step_time": repeat,
        "probe": json.loads((Path(result.results_dir) / "probe_bandwidth" / "metrics.json").read_text()),
        "probe_wall_s": tuner.probe_wall_s,
        "grid": [dict(r, predicted_step_s=result.model.predict(c).step_time_s,
                      predicted_memory=result.model.predict(c).device_bytes) for c, r in grid.items()],
    }
    os.makedirs(os.path.dirname(a.out), exist_ok=True)
    Path(a.out).write_text(json.dumps(out, indent=2))
    checks = {
        "throughput >= 95% of grid best": max(ratio_grid, paired_ratio or 0.0) >= 0.95,
        "trials <= 1/5 of grid": out["trial_ratio"] <= 0.2,
        "wall <= 1/5 of grid": out["wall_ratio"] <= 0.2,
        "every memory-pruned config over budget": out["pruned_really_over"],
        "spearman >= 0.8": rho >= 0.8,
    }
    print(json.dumps({k: v for k, v in out.items() if k != "grid"}, indent=2))
    for k, v in checks.items():
        print(f"{'PASS' if v else 'FAIL'}  {k}")
    return 0 if all(checks.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
