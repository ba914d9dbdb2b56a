"""Issue 12: peak RSS of a GPT training step with and without activation checkpointing, predicted and measured.

    python benchmarks/bench_activation.py            # GPT 8 x 256, seq 1024, micro-batch 4: ~2-4 min here
    python benchmarks/bench_activation.py --quick    # 4 x 128, seq 512: well under a minute
    python benchmarks/bench_activation.py --stage 3 --policies none,full

Each configuration (recompute none / full / selective) trains in its own fresh process (world 1, gloo, fp32
AdamW, dropout off: torch's CPU attention is then the fused flash kernel, which is what the formula's fused
case counts) with ``MALLOC_MMAP_THRESHOLD_=65536`` in its environment, so freed tensors go back to the system
and RSS follows what is alive (see benchmarks/bench_stage3_memory.py). Step 1 warms up (Adam's states
appear); in step 2 the worker records RSS before the forward and the exact peak (VmHWM, reset at the phase's
start) of the forward and of the backward.

Prediction (shardspeed.checkpointing.memory, Korthikanti et al. 2022 in fp32: 4-byte values, fused
attention): per layer ``64·sbh`` bytes kept without recompute, ``4·sbh`` with full recompute (the block
input), ``44·sbh`` with the selective policy; outside the blocks the embedding output, the final LayerNorm's
input and output (3·sbh values) and the log-probabilities (s·b·V). The step's activation peak is what the
layers keep plus, with recompute, one layer's full set while it is recomputed in backward (selective: the
elementwise part only, 20·sbh values), plus the logits (s·b·V) alive at the end of the forward. Peak RSS
predicted = RSS before the forward (parameters, gradients, Adam's states: 16Ψ, and the process) + that.

At stage 3 (world 1) the gathered parameters are added: the step gathers every unit in turn and prefetches
``stage3_prefetch_bucket_size`` elements ahead, the whole model at these sizes (4Ψ bytes).

Printed per configuration: the predicted and measured activation peak (peak RSS - RSS before forward), their
ratio, peak RSS (predicted and measured), the reduction factor against no recompute (predicted, measured)
and seconds per step. JSON: benchmarks/results/activation[-quick].json.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from typing import Any, Dict

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

MiB = 2**20
SHAPES = {"default": dict(n_layer=8, n_embd=256, n_head=8, seq=1024, batch=4, vocab=256),
          "quick": dict(n_layer=4, n_embd=128, n_head=4, seq=512, batch=4, vocab=256)}


def predicted_activation_peak(shape: Dict[str, int], recompute: str, stage: int = 0,
                              params: int = 0) -> Dict[str, float]:
    """Bytes: what the layers keep, the rest of the model keeps, and the step's activation peak. At stage 3
    the gathered parameters come on top of RSS before the forward (everything is released there): the units
    in use and prefetched, ``stage3_prefetch_bucket_size`` (5e7 elements by default) ahead, i.e. the whole
    model for these sizes."""
    from shardspeed.checkpointing.memory import activation_bytes_per_layer

    s, b, h, a, L, V = (shape[k] for k in ("seq", "batch", "n_embd", "n_head", "n_layer", "vocab"))
    per = activation_bytes_per_layer(s, b, h, a, recompute=recompute, value_bytes=4, dropout=False)
    full = activation_bytes_per_layer(s, b, h, a, recompute="none", value_bytes=4, dropout=False)
    kept = L * per + 4 * (3 * s * b * h + s * b * V)
    working = {"none": 0, "full": full, "selective": full - per + 4 * s * b * h}[recompute]
    gathered = 4 * min(params, int(5e7) + 12 * h * h) if stage == 3 else 0
    return {"per_layer": per, "kept": kept, "peak": kept + max(working, 4 * s * b * V) + gathered}


# ---- the worker (one configuration, its own process) ------------------------------------------------------

def _worker(spec: Dict[str, Any]) -> Dict[str, Any]:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(spec["port"]), RANK="0", WORLD_SIZE="1",
                      LOCAL_RANK="0", LOCAL_WORLD_SIZE="1")
    import logging

    import torch

    from benchmarks.harness import proc_status_kb, reset_peak_rss

    logging.disable(logging.WARNING)
    torch.set_num_threads(spec["threads"])
    import shardspeed
    from shardspeed.models.gpt import GPT, GPTConfig

    shape = spec["shape"]
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=shape["vocab"], block_size=shape["seq"], n_layer=shape["n_layer"],
                          n_head=shape["n_head"], n_embd=shape["n_embd"], dropout=0.0))
    recompute = spec["recompute"]
    cfg = {"train_micro_batch_size_per_gpu": shape["batch"], "gradient_clipping": 1.0,
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}},
           "zero_optimization": {"stage": spec["stage"]},
           "activation_checkpointing": {"enabled": recompute != "none",
                                        "policy": recompute if recompute != "none" else "full"}}
    out: Dict[str, Any] = {"params": sum(p.numel() for p in model.parameters())}  # before stage 3 shards them
    engine, *_ = shardspeed.initialize(model=model, config=cfg)
    g = torch.Generator().manual_seed(1)
    for _ in range(2):
        x = torch.randint(0, shape["vocab"], (shape["batch"], shape["seq"]), generator=g)
        t0 = time.perf_counter()
        out["rss_before_forward"] = proc_status_kb("VmRSS") * 1024
        reset_peak_rss()
        loss = engine(x, x)
        out["peak_forward"] = proc_status_kb("VmHWM") * 1024
        reset_peak_rss()
        engine.backward(loss)
        out["peak_backward"] = proc_status_kb("VmHWM") * 1024
        engine.step()
        out["seconds"] = time.perf_counter() - t0
        out["loss"] = float(loss.detach())
    out["peak"] = max(out["peak_forward"], out["peak_backward"])
    return out


def _run_one(spec: Dict[str, Any]) -> Dict[str, Any]:
    from benchmarks.harness import _free_port

    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_=str(spec.pop("mmap")), DS_ACCELERATOR="cpu")
    spec["port"] = _free_port()
    proc = subprocess.run([sys.executable, os.path.abspath(__file__), "--worker", json.dumps(spec)], env=env,
                          capture_output=True, text=True, timeout=1800)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    if proc.returncode or not lines:
        raise RuntimeError(f"worker {spec['recompute']} failed:\n{proc.stderr[-3000:]}")
    return json.loads(lines[-1][len("RESULT "):])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--stage", type=int, default=0)
    ap.add_argument("--policies", default="none,full,selective")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--mmap-threshold", type=int, default=65536)
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker is not None:
        print("RESULT " + json.dumps(_worker(json.loads(args.worker))), flush=True)
        return
    shape = SHAPES["quick" if args.quick else "default"]
    sbh = shape["seq"] * shape["batch"] * shape["n_embd"]
    print(f"GPT {shape}, stage {args.stage}, fp32, world 1, MALLOC_MMAP_THRESHOLD_={args.mmap_threshold}; "
          f"s·b·h = {sbh / MiB:.2f} Mi values")
    rows: Dict[str, Dict[str, Any]] = {}
    for recompute in args.policies.split(","):
        got = _run_one({"shape": shape, "recompute": recompute, "stage": args.stage, "threads": args.threads,
                        "mmap": args.mmap_threshold})
        pred = predicted_activation_peak(shape, recompute, args.stage, got["params"])
        act = got["peak"] - got["rss_before_forward"]
        rows[recompute] = dict(got, predicted=pred, activation_peak=act, predicted_rss=got["rss_before_forward"]
                               + pred["peak"])
    print(f"{'recompute':<10} {'act. pred MiB':>13} {'act. meas MiB':>13} {'meas/pred':>9} {'peak pred MiB':>13} "
          f"{'peak meas MiB':>13} {'factor pred':>11} {'factor meas':>11} {'s/step':>7}")
    base = rows.get("none")
    for name, r in rows.items():
        fp = base["predicted"]["peak"] / r["predicted"]["peak"] if base else float("nan")
        fm = base["activation_peak"] / r["activation_peak"] if base else float("nan")
        print(f"{name:<10} {r['predicted']['peak'] / MiB:>13.1f} {r['activation_peak'] / MiB:>13.1f} "
              f"{r['activation_peak'] / r['predicted']['peak']:>9.3f} {r['predicted_rss'] / MiB:>13.1f} "
              f"{r['peak'] / MiB:>13.1f} {fp:>11.2f} {fm:>11.2f} {r['seconds']:>7.2f}")
    if base and "full" in rows:
        per = {k: v["predicted"]["per_layer"] for k, v in rows.items()}
        print(f"per layer kept (formula): none {per['none'] / MiB:.1f} MiB, full {per['full'] / MiB:.2f} MiB "
              f"(factor {per['none'] / per['full']:.1f}); losses equal: "
              f"{len({round(r['loss'], 5) for r in rows.values()}) == 1}")
    path = os.path.join(ROOT, "benchmarks", "results", f"activation{'-quick' if args.quick else ''}"
                        f"{'-stage' + str(args.stage) if args.stage else ''}.json")
    with open(path, "w") as f:
        json.dump({"shape": shape, "stage": args.stage, "rows": rows}, f, indent=1)
    print(f"wrote {os.path.relpath(path, ROOT)}")


if __name__ == "__main__":
    main()
