"""Results: ratios, JSON, CSV, markdown tables and plots."""
from __future__ import annotations

import csv
import json
import os
import platform
import statistics
import subprocess
from typing import Dict, List, Optional

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
MB = 2**20


def machine() -> Dict[str, str]:
    import torch

    cpu = ""
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), "")
    except OSError:
        pass
    try:
        import deepspeed  # noqa: F401

        ds = deepspeed.__version__
    except Exception:
        ds = "not installed"
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                cwd=os.path.dirname(RESULTS)).stdout.strip()
    except Exception:
        commit = ""
    import time

    try:
        load = "{:.1f} {:.1f} {:.1f}".format(*os.getloadavg())
    except OSError:
        load = ""
    return {"date": time.strftime("%Y-%m-%d %H:%M %Z"), "load_average_at_start": load,
            "cpu": cpu, "cores": str(os.cpu_count()), "python": platform.python_version(), "torch": torch.__version__,
            "deepspeed": ds, "shardspeed_commit": commit, "os": platform.platform()}


def peer_of(system: str) -> Optional[str]:
    """DeepSpeed's counterpart of a shardspeed system (same stage, same offload)."""
    return "ds" + system[2:] if system.startswith("ss") else None


def add_ratios(rows: Dict[str, dict]) -> None:
    def t(name):
        r = rows.get(name)
        return r["median_step_s"] if r and r.get("status") == "ok" else None

    def m(name):
        r = rows.get(name)
        return r["peak_rss_delta_mb"] if r and r.get("status") == "ok" else None

    def paired(r, peer):
        """Median over rounds of (this system's block median / the peer's block median in the same round):
        robust to load that changes between rounds, as it does on this shared 2-core box."""
        p = rows.get(peer)
        if not p or p.get("status") != "ok" or not r.get("block_medians") or not p.get("block_medians"):
            return None
        return [a / b for a, b in zip(r["block_medians"], p["block_medians"])]

    for s, r in rows.items():
        if r.get("status") != "ok":
            continue
        ds = peer_of(s)
        for peer, key in (("ddp", "vs_ddp"), ("fsdp2", "vs_fsdp2"), (ds, "vs_deepspeed")):
            per_round = paired(r, peer) if peer else None
            r[key] = statistics.median(per_round) if per_round else None
            r[key + "_rounds"] = per_round  # the spread: min..max of the per-round ratios
            r[key + "_of_medians"] = r["median_step_s"] / t(peer) if peer and t(peer) else None
        if s.endswith("-c"):  # compiled: against the same system eager, and against FSDP2 compiled
            eager, fsdp2c = paired(r, s[:-2]), paired(r, "fsdp2-c")
            r["compiled_vs_eager"] = statistics.median(eager) if eager else None  # < 1: compiled is faster
            r["vs_fsdp2_c"] = statistics.median(fsdp2c) if fsdp2c else None
        base = paired(r, s + "@base")  # a paired run (run.py --base): this tree over the other one
        r["vs_base"] = statistics.median(base) if base else None
        r["vs_base_rounds"] = base
        r["mem_vs_deepspeed"] = r["peak_rss_delta_mb"] / m(ds) if ds and m(ds) else None
        r["mem_vs_fsdp2"] = r["peak_rss_delta_mb"] / m("fsdp2") if m("fsdp2") else None
        ref = rows.get("ddp") if rows.get("ddp", {}).get("status") == "ok" else None
        r["loss_rel_diff_vs_ddp"] = abs(r["final_loss"] - ref["final_loss"]) / abs(ref["final_loss"]) if ref else None


CSV_FIELDS = ["model", "system", "status", "world", "dtype", "params", "median_step_s", "p10_step_s", "p90_step_s",
              "tokens_per_s", "vs_ddp", "vs_fsdp2", "vs_deepspeed", "peak_rss_mb", "peak_rss_delta_mb",
              "mem_vs_fsdp2", "mem_vs_deepspeed", "comm_paper_bytes_per_step", "final_loss",
              "loss_rel_diff_vs_ddp", "optimizer_kernel", "message"]


def write(tag: str, all_rows: Dict[str, Dict[str, dict]], meta: dict) -> List[str]:
    os.makedirs(RESULTS, exist_ok=True)
    paths = []
    jpath = os.path.join(RESULTS, f"{tag}.json")
    with open(jpath, "w") as f:
        json.dump({"meta": meta, "results": all_rows}, f, indent=1, default=float)
    paths.append(jpath)
    cpath = os.path.join(RESULTS, f"{tag}.csv")
    with open(cpath, "w", newline="") as f:
        w = csv.DictWriter(f, CSV_FIELDS, extrasaction="ignore")
        w.writeheader()
        for model, rows in all_rows.items():
            for r in rows.values():
                w.writerow({"model": model, **{k: _fmt(r.get(k)) for k in CSV_FIELDS if k != "model"}})
    paths.append(cpath)
    paths += plots(tag, all_rows)
    return paths


def _fmt(v):
    return f"{v:.6g}" if isinstance(v, float) else v


def plots(tag: str, all_rows: Dict[str, Dict[str, dict]]) -> List[str]:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except Exception:
        return []
    out = []
    models = list(all_rows)
    fig, axes = plt.subplots(2, len(models), figsize=(6 * len(models), 7), squeeze=False)
    for j, model in enumerate(models):
        rows = [r for r in all_rows[model].values() if r.get("status") == "ok"]
        names = [r["system"] for r in rows]
        colors = ["tab:gray" if n in ("ddp", "fsdp2") else "tab:orange" if n.startswith("ds") else "tab:blue"
                  for n in names]
        ax = axes[0][j]
        med = [r["median_step_s"] * 1e3 for r in rows]
        err = [[r["median_step_s"] * 1e3 - r["p10_step_s"] * 1e3 for r in rows],
               [r["p90_step_s"] * 1e3 - r["median_step_s"] * 1e3 for r in rows]]
        ax.bar(names, med, color=colors, yerr=err, capsize=3)
        ax.set_ylabel("median step time (ms), p10-p90")
        ax.set_title(f"{model}: step time (lower is better)")
        ax.tick_params(axis="x", rotation=45)
        ax = axes[1][j]
        ax.bar(names, [r["peak_rss_delta_mb"] for r in rows], color=colors)
        ax.set_ylabel("peak RSS over pre-build baseline (MiB, max rank)")
        ax.set_title(f"{model}: peak memory per rank")
        ax.tick_params(axis="x", rotation=45)
    fig.tight_layout()
    p = os.path.join(RESULTS, f"{tag}.png")
    fig.savefig(p, dpi=90)
    plt.close(fig)
    out.append(p)
    return out


def _spread(r: dict, key: str) -> str:
    v, rounds = r.get(key), r.get(key + "_rounds")
    if v is None:
        return "–"
    if not rounds or len(rounds) < 2:
        return f"{v:.2f}×"
    return f"{v:.2f}× ({min(rounds):.2f}-{max(rounds):.2f})"


def markdown_table(rows: Dict[str, dict], spread: bool = False) -> str:
    if spread:
        return markdown_ratio_table(rows)

    head = ("| system | step ms (median) | tokens/s | vs DDP | vs FSDP2 | vs DeepSpeed same stage | peak RSS Δ MiB "
            "| mem vs FSDP2 | comm MB/step (paper) | final loss |\n|---|---|---|---|---|---|---|---|---|---|")
    lines = [head]
    for r in rows.values():
        if r.get("status") != "ok":
            lines.append(f"| {r['system']} | {r.get('status')}: {r.get('message', '')} | | | | | | | | |")
            continue
        f = lambda v, fmt="{:.2f}": fmt.format(v) if v is not None else "–"  # noqa: E731
        lines.append(
            f"| {r['system']} | {r['median_step_s'] * 1e3:.1f} | {r['tokens_per_s']:.0f} | {f(r.get('vs_ddp'))}× "
            f"| {f(r.get('vs_fsdp2'))}× | {f(r.get('vs_deepspeed'))}{'×' if r.get('vs_deepspeed') else ''} "
            f"| {r['peak_rss_delta_mb']:.0f} | {f(r.get('mem_vs_fsdp2'))}× "
            f"| {r['comm_paper_bytes_per_step'] / 1e6:.1f} | {r['final_loss']:.5f} |")
    return "\n".join(lines)


def markdown_ratio_table(rows: Dict[str, dict]) -> str:
    """Paired ratios with their spread over rounds (median (min-max) of per-round ratios)."""
    head = ("| system | vs DDP | vs FSDP2 | vs DeepSpeed same stage | rounds | peak RSS Δ MiB | mem vs FSDP2 "
            "| mem vs DeepSpeed | comm MB/step (paper) | final loss |\n|---|---|---|---|---|---|---|---|---|---|")
    lines = [head]
    for r in rows.values():
        if r.get("status") != "ok":
            lines.append(f"| {r['system']} | {r.get('status')}: {r.get('message', '')} | | | | | | | | |")
            continue
        f = lambda v: f"{v:.2f}×" if v is not None else "–"  # noqa: E731
        lines.append(
            f"| {r['system']} | {_spread(r, 'vs_ddp')} | {_spread(r, 'vs_fsdp2')} | {_spread(r, 'vs_deepspeed')} "
            f"| {len(r.get('block_medians') or [])} | {r['peak_rss_delta_mb']:.0f} | {f(r.get('mem_vs_fsdp2'))} "
            f"| {f(r.get('mem_vs_deepspeed'))} | {r['comm_paper_bytes_per_step'] / 1e6:.1f} | {r['final_loss']:.5f} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    """Re-print a results file's tables with the paired ratios and their spread over rounds:
    ``python -m benchmarks.report benchmarks/results/suite.json`` (ratios as computed inside each wave)."""
    import sys

    path = (argv or sys.argv[1:])[0]
    with open(path) as f:
        data = json.load(f)
    for model, rows in data["results"].items():
        print(f"### {model}\n" + markdown_ratio_table(rows) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
