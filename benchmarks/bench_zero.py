"""Issue 3's measurements: per-rank memory of ZeRO stages 0-3 against the paper's formulas, step time
against DDP and FSDP2, and bytes per step against theory, on a ~50M-parameter GPT with AdamW, 2 ranks.

    python benchmarks/bench_zero.py [--model gpt-50m] [--dtypes fp32,bf16] [--max-alive 6]   # ~3 min per dtype

Memory is shown three ways per rank: shardspeed's report (bytes of the tensors it holds after a step,
``engine.memory_breakdown()``), the ZeRO formula for the same Ψ, and the process's peak RSS over its
pre-build baseline (which adds activations, temporaries and allocator slack). Formulas:
  fp32: stage 0 16Ψ, stage 1 8Ψ+8Ψ/N, stage 2 4Ψ+12Ψ/N, stage 3 16Ψ/N
  bf16 with fp32 master: 16Ψ, 4Ψ+12Ψ/N, 2Ψ+14Ψ/N, 16Ψ/N
Bytes per step (paper accounting, Ψ in wire-dtype bytes): stages 0-2 2Ψ, stage 3 3Ψ.
Targets: stage 2 <= 1.1x DDP; stage 3 <= FSDP2 and <= 1.3x DDP; stage 3 peak memory <= FSDP2.
"""
from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.harness import run_waves  # noqa: E402
from benchmarks.models import MODELS  # noqa: E402
from benchmarks.report import add_ratios, machine, write  # noqa: E402

MB = 2**20


def formula(stage: int, dtype: str, psi: float, n: int) -> float:
    if dtype == "fp32":
        return {0: 16 * psi, 1: 8 * psi + 8 * psi / n, 2: 4 * psi + 12 * psi / n, 3: 16 * psi / n}[stage]
    return {0: 16 * psi, 1: 4 * psi + 12 * psi / n, 2: 2 * psi + 14 * psi / n, 3: 16 * psi / n}[stage]


def table(rows: dict, dtype: str, world: int) -> str:
    elem = 4 if dtype == "fp32" else 2
    out = [f"### {dtype}, world {world}",
           "| system | report MiB | formula MiB | report/formula | peak RSS Δ MiB | step ms | vs DDP | vs FSDP2 "
           "| comm MB/step (paper) | theory MB | final loss |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for s, r in rows.items():
        if r.get("status") != "ok":
            out.append(f"| {s} | {r.get('status')}: {r.get('message', '')} | | | | | | | | | |")
            continue
        psi = r["params"]
        rep = (r.get("library_memory") or {}).get("total")
        if s.startswith("ss"):
            st = int(s[2])
            form = formula(st, dtype, psi, world)
            theory = (3 if st == 3 else 2) * psi * elem
            r.update(formula_bytes=form, report_bytes=rep, theory_comm_bytes=theory)
        else:
            form = theory = None
        f = lambda v, fmt="{:.2f}": fmt.format(v) if v is not None else "–"  # noqa: E731
        out.append(
            f"| {s} | {f(rep / MB if rep else None, '{:.0f}')} | {f(form / MB if form else None, '{:.0f}')} "
            f"| {f(rep / form if rep and form else None, '{:.3f}')} | {r['peak_rss_delta_mb']:.0f} "
            f"| {r['median_step_s'] * 1e3:.0f} | {f(r.get('vs_ddp'))} | {f(r.get('vs_fsdp2'))} "
            f"| {r['comm_paper_bytes_per_step'] / 1e6:.1f} | {f(theory / 1e6 if theory else None, '{:.1f}')} "
            f"| {r['final_loss']:.5f} |")
    return "\n".join(out)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="gpt-50m", choices=sorted(MODELS))
    ap.add_argument("--dtypes", default="fp32,bf16")
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--max-alive", type=int, default=6, help="systems alive at once: 6 = one wave per dtype")
    ap.add_argument("--stages", default="0,1,2,3")
    args = ap.parse_args(argv)
    warmup, blocks, steps = MODELS[args.model].get("timing", (1, 2, 2))
    all_rows, texts = {}, []
    for dtype in args.dtypes.split(","):
        systems = ["ddp", "fsdp2"] + [f"ss{s}" for s in args.stages.split(",")]
        rows = run_waves(systems, args.model, max_alive=args.max_alive, add_ratios=add_ratios, dtype=dtype,
                         world=args.world, warmup=warmup, blocks=blocks, steps_per_block=steps)
        text = table(rows, dtype, args.world)
        print(text)
        texts.append(text)
        all_rows[f"{args.model}-{dtype}"] = rows
    meta = dict(machine(), command="python benchmarks/bench_zero.py " + " ".join(argv or sys.argv[1:]))
    write("bench_zero", all_rows, meta)
    with open(os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "bench_zero.md"), "w") as f:
        f.write("\n\n".join(texts) + "\n")
    return 0


if __name__ == "__main__":
    import signal

    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # so the worker groups are torn down
    sys.exit(main())
