"""Issue 40: per-rank peak RSS of each precision mode beside the model-states formula.

    python benchmarks/bench_precision_memory.py                    # GPT ~23M ("gpt"), world 4, stage 3, 2 steps
    python benchmarks/bench_precision_memory.py --model gpt-113m   # the 112.6M GPT of issue 9 (slow here)
    python benchmarks/bench_precision_memory.py --stage 2 --world 2

Modes (shardspeed, AdamW, ZeRO ``--stage``, gloo on CPU): ``fp32``; ``autocast`` (``torch_autocast`` bf16, fp32
parameters); ``bf16`` (fp32 masters); ``bf16_masters`` (``bf16_master_weights_and_grads`` +
``bf16_optimizer_states``). One group of ``world`` processes per mode, one mode after the other. Per rank:
VmRSS after imports and process-group setup (the baseline), then the process's high-water mark (VmHWM, reset
at the baseline) after the steps; the model-state bytes the estimator prices for the mode
(``estimate_model_state_memory``: params + grads + master + optimizer states, bytes per parameter × Ψ / ranks as
the stage shards them) and the optimizer-state bytes the engine holds. Reported: max over ranks, in MiB.
JSON: benchmarks/results/precision_memory.json (modes run separately with ``--modes`` on the same setup are
merged into it).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import traceback

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from benchmarks.harness import init_gloo, proc_status_kb, reset_peak_rss, run_once, worker_setup  # noqa: E402
from benchmarks.models import MODELS, build_model, make_batch, num_params  # noqa: E402

MiB = 2 ** 20
MODES = ("fp32", "autocast", "bf16", "bf16_masters")
MODELS.setdefault("gpt-113m", {"kind": "gpt", "vocab_size": 16384, "block_size": 1024, "n_layer": 14, "n_head": 12,
                               "n_embd": 768, "batch": 2})
SEQ = 128  # tokens per sample fed


def config(mode: str, stage: int, batch: int) -> dict:
    cfg = {"train_micro_batch_size_per_gpu": batch, "gradient_clipping": 1.0,
           "zero_optimization": {"stage": stage}, "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}}}
    if mode == "autocast":
        cfg["torch_autocast"] = {"enabled": True, "dtype": "bf16"}
    elif mode == "bf16":
        cfg["bf16"] = {"enabled": True}
    elif mode == "bf16_masters":
        cfg["bf16"] = {"enabled": True, "bf16_master_weights_and_grads": True, "bf16_optimizer_states": True}
    return cfg


def formula(mode: str, stage: int, psi: int, world: int) -> float:
    from shardspeed.estimate.states import estimate_model_state_memory

    dtype = {"fp32": "fp32", "autocast": "fp32"}.get(mode, "bf16")
    return estimate_model_state_memory(psi, world, stage, dtype, bf16_masters=mode == "bf16_masters").device


def worker(rank, world, port, model_name, mode, stage, steps, q):
    try:
        worker_setup(rank, world, port, threads=1)
        init_gloo(rank, world)
        import torch

        import shardspeed

        base = proc_status_kb("VmRSS")
        reset_peak_rss()
        model = build_model(model_name)
        psi = num_params(model)
        engine, *_ = shardspeed.initialize(model=model, config=config(mode, stage, MODELS[model_name]["batch"]))
        del model
        for step in range(steps):
            x, y = make_batch(model_name, step, world, rank)
            loss = engine(x[:, :SEQ], y[:, :SEQ])
            engine.backward(loss.float())
            engine.step()
        inner = getattr(engine.optimizer, "optimizer", engine.optimizer)
        states = sum(v.numel() * v.element_size() for st in inner.state.values() for v in st.values()
                     if torch.is_tensor(v) and v.dim() > 0)
        row = {"rank": rank, "baseline_mib": base / 1024, "peak_over_baseline_mib": (proc_status_kb("VmHWM") - base)
               / 1024, "optimizer_state_mib": states / MiB, "psi": psi, "loss": float(loss)}
        rows = [None] * world
        torch.distributed.all_gather_object(rows, row)
        engine.destroy()
        if rank == 0:
            q.put(("ok", rows))
    except Exception:
        q.put(("error", traceback.format_exc()))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="gpt")
    ap.add_argument("--world", type=int, default=4)
    ap.add_argument("--stage", type=int, default=3)
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--modes", default=",".join(MODES))
    args = ap.parse_args()
    os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", "65536")  # freed tensors go back to the system
    out = {}
    for mode in args.modes.split(","):
        rows = run_once(worker, args.world, (args.model, mode, args.stage, args.steps), 3600, mode)
        psi = rows[0]["psi"]
        out[mode] = {"peak_over_baseline_mib": max(r["peak_over_baseline_mib"] for r in rows),
                     "baseline_mib": max(r["baseline_mib"] for r in rows),
                     "optimizer_state_mib": max(r["optimizer_state_mib"] for r in rows),
                     "model_states_formula_mib": formula(mode, args.stage, psi, args.world) / MiB,
                     "psi": psi, "last_loss": rows[0]["loss"]}
        r = out[mode]
        print(f"{mode:13s} peak-baseline {r['peak_over_baseline_mib']:8.1f} MiB  model states (formula) "
              f"{r['model_states_formula_mib']:8.1f} MiB  optimizer states held {r['optimizer_state_mib']:8.1f} MiB",
              flush=True)
    meta = {"model": args.model, "world": args.world, "stage": args.stage, "steps": args.steps, "seq": SEQ}
    path = os.path.join(ROOT, "benchmarks", "results", "precision_memory.json")
    if os.path.exists(path):  # modes run separately (--modes) on the same setup accumulate in one file
        with open(path) as f:
            old = json.load(f)
        if old.get("meta") == meta:
            out = dict(old["modes"], **out)
    with open(path, "w") as f:
        json.dump({"meta": meta, "modes": out}, f, indent=1)
    print("wrote", path)


if __name__ == "__main__":
    main()
