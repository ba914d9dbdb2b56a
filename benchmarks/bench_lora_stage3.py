"""Issue 21: LoRA fine-tuning at ZeRO stage 3, peak RSS per rank for shardspeed, DeepSpeed and FSDP2.

    python benchmarks/bench_lora_stage3.py              # Llama 110M + LoRA, world 4, fp32, 2 steps, 7 runs: 8-13 min here
    python benchmarks/bench_lora_stage3.py --systems ss3,ds3,fsdp2,ss3-dsb,ds3-dsb   # no ddp reference: ~7 min
    python benchmarks/bench_lora_stage3.py --full ""    # LoRA runs only (no full fine-tuning comparison)
    python benchmarks/bench_lora_stage3.py --systems ss3-dsb,ds3-dsb --full ""   # DeepSpeed's default buckets only

Model (``benchmarks/models.py``): transformers ``LlamaForCausalLM`` from a ``LlamaConfig`` (12 layers, width
768, 12 heads, MLP 2048, vocabulary 16384, untied head, eager attention, random weights: 110.4M parameters),
wrapped with PEFT LoRA r=8 on q_proj and v_proj, dropout 0 (0.29M trainable, the base frozen), behind the
suite's ``forward(x, y) -> loss``; 2 x 256 tokens per rank. Systems (``benchmarks/systems.py``, AdamW over the
trainable parameters only, clipping 1.0):

- ``ss3`` / ``ds3``: shardspeed / DeepSpeed stage 3 with the suite's 2M-element buckets (reduce, all-gather,
  prefetch; persistence threshold 10k);
- ``ss3-dsb`` / ``ds3-dsb``: the same with DeepSpeed's default buckets (no bucket keys in ``zero_optimization``;
  ``overlap_comm`` and ``contiguous_gradients`` true, DeepSpeed's stage-3 defaults);
- ``fsdp2``: ``fully_shard`` on every decoder layer, then the root (FSDP2 has no bucket settings);
- ``ddp``: torch DDP, every parameter on every rank: its forward growth is the activations alone (a reference);
- ``--full``: the listed systems once more on the same model without LoRA (every parameter trains).

Memory is measured by ``benchmarks/bench_stage3_memory.py``'s worker, unchanged (fixed
``MALLOC_MMAP_THRESHOLD_``, ``VmHWM`` reset per phase, one group of fresh gloo workers per system, the groups
one after the other); this script only imports transformers and peft before that worker's baseline and adds
the LoRA formula. ZeRO-3 model states per rank, fp32: frozen parameters 4·Ψ_frozen/N + trainable (parameter 4
+ gradient 4 + Adam m, v 8 bytes)·Ψ_lora/N; full fine-tuning 16Ψ/N. On top come the gathered parameters (a few
decoder layers' fp32 weights, one layer = 27.1 MiB) and the activations. JSON: benchmarks/results/<tag>.json
(default ``lora_stage3``).
"""
from __future__ import annotations

import argparse
import importlib
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from benchmarks import bench_stage3_memory as s3m  # noqa: E402
from benchmarks.harness import spawn_workers  # noqa: E402
from benchmarks.models import MODELS  # noqa: E402

MiB = s3m.MiB
PHASES = s3m.PHASES
LORA, FULL = "llama-110m-lora", "llama-110m"


def _worker(system: str, model_name: str, rank: int, world: int, port: int, steps: int, sample_ms: float,
            res_q) -> None:
    """bench_stage3_memory's worker, with transformers and peft imported first (in the baseline, for every system)."""
    import peft  # noqa: F401
    import transformers  # noqa: F401

    s3m._worker(system, model_name, rank, world, port, steps, sample_ms, res_q)


class Group(s3m.Group):
    """One system's ``world`` fresh workers on ``model_name``; its row is called ``label``."""

    def __init__(self, label: str, system: str, model_name: str, world: int, steps: int, sample_ms: float):
        self.system, self.world = label, world
        target = importlib.import_module("benchmarks.bench_lora_stage3")._worker  # picklable by module name
        self.t0 = time.perf_counter()
        self.procs, self.res_q = spawn_workers(
            target, world, lambda r, port, q: (system, model_name, r, world, port, steps, sample_ms, q))


def param_counts(model_name: str) -> dict[str, int]:
    """(total, trainable, one decoder layer) of the model, built on the meta device (no memory, no init)."""
    import torch

    from benchmarks.models import build_model, num_params, num_trainable_params

    with torch.device("meta"):
        m = build_model(model_name)
    return {"total": num_params(m), "trainable": num_trainable_params(m),
            "layer": sum(p.numel() for p in m.blocks[0].parameters())}


def formula(counts: dict[str, int], world: int) -> dict[str, float]:
    """ZeRO-3 fp32 model states per rank, bytes: frozen 4 bytes, trainable 4 + 4 + 8 bytes, all over N."""
    frozen = counts["total"] - counts["trainable"]
    f = {"frozen_params": 4 * frozen / world, "trainable_params": 4 * counts["trainable"] / world,
         "grads": 4 * counts["trainable"] / world, "adam": 8 * counts["trainable"] / world}
    f["total"] = sum(f.values())
    return f


def enrich(row: dict, counts: dict[str, int], world: int) -> None:
    f = formula(counts, world)
    row.update(psi_total=counts["total"], psi_trainable=counts["trainable"], psi_frozen=counts["total"] - counts["trainable"],
               layer_params=counts["layer"], layer_mib=4 * counts["layer"] / MiB,
               lora_formula_bytes=f, lora_formula_mib=f["total"] / MiB)
    if row.get("status") != "ok":
        return
    build = max(r["build_peak_kb"] for r in row["per_rank"]) / 1024
    phases = dict(row["phase_peak_mib"], build=build)
    row["peak_phase"] = max(phases, key=phases.get)
    # the peak over what was resident before the step began: the model states plus what the step adds
    row["peak_over_before_forward_mib"] = row["peak_rss_mib"] - row["phase_rss_last_step_mib"]["before_forward"]
    row["before_forward_over_baseline_mib"] = row["phase_rss_last_step_mib"]["before_forward"] - row["baseline_rss_mib"]


def table(rows: dict[str, dict], world: int) -> str:
    anyr = next(iter(rows.values()))
    lora = next((r for r in rows.values() if r["psi_trainable"] < r["psi_total"]), anyr)
    f = lora["lora_formula_bytes"]
    out = [f"Llama {lora['psi_total'] / 1e6:.1f}M parameters, LoRA r=8 on q_proj/v_proj: Ψ_lora = "
           f"{lora['psi_trainable'] / 1e6:.3f}M trainable, Ψ_frozen = {lora['psi_frozen'] / 1e6:.2f}M; world {world}, "
           f"fp32 AdamW; one decoder layer = {lora['layer_params'] / 1e6:.2f}M params = {lora['layer_mib']:.1f} MiB fp32. "
           f"ZeRO-3 model states per rank: LoRA 4Ψ_frozen/N + 16Ψ_lora/N = {f['frozen_params'] / MiB:.1f} + "
           f"{(f['total'] - f['frozen_params']) / MiB:.2f} = {f['total'] / MiB:.1f} MiB; full fine-tuning (no adapters, "
           f"Ψ = {lora['psi_frozen'] / 1e6:.2f}M) 16Ψ/N = {16 * lora['psi_frozen'] / world / MiB:.0f} MiB.",
           "",
           "| run | fine-tuning | buckets | peak RSS MiB | peak − baseline MiB | phase of peak | forward / backward / step peak MiB "
           "| RSS before forward − baseline MiB | ZeRO-3 model states formula MiB | forward growth MiB, step 1 / 2 "
           "| peak − RSS before forward MiB | final loss |",
           "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for label, r in rows.items():
        full = r["psi_trainable"] == r["psi_total"]
        system = r.get("run_system", label)
        kind = "full" if full else "LoRA"
        buckets = "–" if system.startswith(("fsdp", "ddp")) else ("DeepSpeed default" if "dsb" in system.split("-") else "2M")
        if r.get("status") != "ok":
            out.append(f"| {label} | {kind} | {buckets} | {r.get('status')}: {r.get('message', '')} | | | | | "
                       f"{r['lora_formula_mib']:.1f} | | | |")
            continue
        pp = r["phase_peak_mib"]
        out.append(f"| {label} | {kind} | {buckets} | **{r['peak_rss_mib']:.0f}** | {r['peak_rss_delta_mib']:.0f} "
                   f"| {r['peak_phase']} | {pp['forward']:.0f} / {pp['backward']:.0f} / {pp['step']:.0f} "
                   f"| {r['before_forward_over_baseline_mib']:.0f} | {r['lora_formula_mib']:.1f} "
                   f"| {r['forward_growth_first_step_mib']:.0f} / {r['forward_growth_mib']:.0f} "
                   f"| {r['peak_over_before_forward_mib']:.0f} | {r['losses'][-1]:.5f} |")
    base = [r["baseline_rss_mib"] for r in rows.values() if r.get("status") == "ok"]
    if base:
        out.append(f"\nMax over ranks throughout. Baseline (RSS after imports incl. torch, shardspeed, transformers, peft "
                   f"and process-group setup, before the model is built): {min(base):.0f}-{max(base):.0f} MiB. "
                   "Phase peaks are VmHWM reset at each phase's start, max over steps; 'RSS before forward' is the "
                   "last step's (model states resident between steps, gradients included where a system keeps them); forward "
                   "growth: RSS after forward − before forward. ddp (every parameter resident on every rank) is the "
                   "reference for the activations alone: its forward growth is what autograd saves.")
    return "\n".join(out)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--systems", default="ss3,ds3,fsdp2,ss3-dsb,ds3-dsb,ddp",
                    help="LoRA runs, from ss3, ds3, fsdp2, ss3-dsb, ds3-dsb, ddp (the activations reference; also -off)")
    ap.add_argument("--full", default="ss3", help="systems also run with full fine-tuning (no LoRA); '' for none")
    ap.add_argument("--world", type=int, default=4)
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--sample-ms", type=float, default=5.0)
    ap.add_argument("--mmap-threshold", type=int, default=65536, help="MALLOC_MMAP_THRESHOLD_ (0: glibc's dynamic one)")
    ap.add_argument("--timeout", type=float, default=900, help="seconds per system's group")
    ap.add_argument("--tag", default="lora_stage3", help="results/<tag>.json")
    args = ap.parse_args(argv)
    if args.mmap_threshold:  # before the forkserver and the workers start (glibc reads it at the first malloc)
        os.environ["MALLOC_MMAP_THRESHOLD_"] = str(args.mmap_threshold)
    else:
        os.environ.pop("MALLOC_MMAP_THRESHOLD_", None)
    from benchmarks.report import machine

    runs = [(s, s, LORA) for s in args.systems.split(",") if s]
    runs += [(f"{s} full", s, FULL) for s in args.full.split(",") if s]
    meta = dict(machine(), command="python benchmarks/bench_lora_stage3.py " + " ".join(
        argv if argv is not None else sys.argv[1:]), models={m: MODELS[m] for m in (LORA, FULL)}, world=args.world,
        steps=args.steps, mmap_threshold=args.mmap_threshold or None, runs=runs)
    try:
        meta["load_average_start"] = os.getloadavg()
    except OSError:
        pass
    counts = {m: param_counts(m) for m in {m for _, _, m in runs}}
    print(f"world {args.world}, {args.steps} steps, MALLOC_MMAP_THRESHOLD_={os.environ.get('MALLOC_MMAP_THRESHOLD_')}; "
          f"runs {[label for label, _, _ in runs]}, one after the other", flush=True)
    t0 = time.time()
    rows: dict[str, dict] = {}
    for label, system, model in runs:
        row = Group(label, system, model, args.world, args.steps, args.sample_ms).collect(timeout=args.timeout)
        row["run_system"], row["model"] = system, model
        enrich(row, counts[model], args.world)
        rows[label] = row
        if row.get("status") == "ok":
            print(f"  {label}: {row['wall_s']:.0f}s, peak {row['peak_rss_mib']:.0f} MiB in {row['peak_phase']} (sampled max "
                  f"{row['sampled_peak_rss_mib']:.0f}), phase peaks {({k: round(v) for k, v in row['phase_peak_mib'].items()})}"
                  f", losses {[round(v, 5) for v in row['losses']]}, mmap check "
                  f"{'ok' if all(c['ok'] for c in row['mmap_check']) else 'NOT RETURNED'}", flush=True)
        else:
            print(f"  {label}: {row.get('status')}: {row.get('message')}", flush=True)
    text = table(rows, args.world)
    print(text)
    try:
        meta["load_average_end"] = os.getloadavg()
    except OSError:
        pass
    s3m.write_results(args.tag, meta, text, rows, t0)
    return 0


if __name__ == "__main__":
    import signal

    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    sys.exit(main())
