"""Issue 40: per-rank peak RSS of each precision mode, shardspeed beside DeepSpeed 0.19.8, the model-states
formula and the memory estimator.

    python benchmarks/bench_precision_memory.py                    # GPT 112.6M, world 4, ZeRO 3, ss + ds, 3 steps
    python benchmarks/bench_precision_memory.py --stages 3,1       # ZeRO 3 then ZeRO 1
    python benchmarks/bench_precision_memory.py --model gpt --libs ss --modes fp32,bf16   # a quick look

Modes (AdamW lr 1e-4, clipping 1.0, ZeRO ``--stages``, gloo on CPU, the same config given to both libraries):
``fp32``; ``bf16`` (bf16 compute, fp32 masters); ``autocast`` (``torch_autocast`` bf16, fp32 parameters);
``bf16_masters`` (``bf16_master_weights_and_grads`` + ``bf16_optimizer_states``); ``bf16_masters_off`` (the same
with ``offload_optimizer: cpu``; DeepSpeed steps it with DeepSpeedCPUAdam); ``bf16_masters_f32_off`` (offloaded
bf16 masters without ``bf16_optimizer_states``: fp32 moments on the host); ``muon`` and ``muon_off`` (bf16 compute,
fp32 masters, ``optimizer.type: "Muon"``, optionally offloaded; DeepSpeed's Muon step eager). Libraries: ``ss``
(``shardspeed.initialize``) and ``ds`` (the real ``deepspeed.initialize``, its FusedAdam built for the CPU).
One group of ``world`` fresh processes per (stage, library, mode), one after the other.

Measured per rank as benchmarks/bench_stage3_memory.py does: ``MALLOC_MMAP_THRESHOLD_=65536`` in the
environment before any worker starts (freed tensors go back to the system); both libraries imported and the
batches made before the baseline ``VmRSS``; ``VmHWM`` reset there. ``build``: the high-water mark while the model
is built and the engine initialised (each rank builds the whole fp32 model first); ``train``: ``VmHWM`` reset
after the build, read after ``--steps`` steps. Reported: max over ranks, in MiB over the baseline.

Beside them: the model-states formula of the mode (``estimate_model_state_memory``: params + grads + masters +
Adam's moments per rank; DeepSpeed's bf16 masters add its bf16 clone of the master shard, 2Ψ/N at stage 3 or
2Ψ/N at stages 1-2, ``runtime/zero/stage3.py: fp32_partitioned_groups_flat`` in the master dtype), shardspeed's
own count of its model states (``engine.memory_breakdown()``), and the estimator's prediction
(``estimate_peak`` on ``describe_gpt`` of the same model, traced at the same micro-batch and sequence):
its start-up peak against ``build``, its training peak against ``train``, and the error of the larger against
the larger. JSON: benchmarks/results/precision_memory.json.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback
from typing import Any, Dict, List

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from benchmarks.harness import init_gloo, proc_status_kb, reset_peak_rss, run_once, worker_setup  # noqa: E402
from benchmarks.models import MODELS, build_model, make_batch, num_params  # noqa: E402

MiB = 2 ** 20
MODES = ("bf16", "autocast", "bf16_masters")
MODELS.setdefault("gpt-113m", {"kind": "gpt", "vocab_size": 16384, "block_size": 1024, "n_layer": 14, "n_head": 12,
                               "n_embd": 768, "batch": 2})
SEQ = 128  # tokens per sample fed (fewer where the model has fewer positions)


def seq(model_name: str) -> int:
    return min(SEQ, MODELS[model_name]["block_size"])


def config(mode: str, stage: int, batch: int) -> Dict[str, Any]:
    """The DeepSpeed-format config of ``mode`` at ZeRO ``stage``, the same for both libraries."""
    cfg: Dict[str, Any] = {"train_micro_batch_size_per_gpu": batch, "gradient_clipping": 1.0,
                           "steps_per_print": 10 ** 9, "zero_optimization": {"stage": stage},
                           "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}}}
    if mode == "autocast":
        cfg["torch_autocast"] = {"enabled": True, "dtype": "bfloat16"}
    elif mode == "bf16" or mode.startswith("muon"):
        cfg["bf16"] = {"enabled": True}
    elif mode.startswith("bf16_masters"):
        cfg["bf16"] = {"enabled": True, "bf16_master_weights_and_grads": True,
                       "bf16_optimizer_states": not mode.startswith("bf16_masters_f32")}
    if mode.startswith("muon"):  # DeepSpeed's Muon at stage 3 asks for reduce_scatter off (ours runs either way)
        cfg["optimizer"] = {"type": "Muon", "params": {"lr": 0.02, "adam_lr": 1e-4}}
        cfg["zero_optimization"]["reduce_scatter"] = stage != 3
    if mode.endswith("_off"):  # DeepSpeed: its DeepSpeedCPUAdam (a JIT-built op) steps the host masters
        cfg["zero_optimization"]["offload_optimizer"] = {"device": "cpu"}
    return cfg


def formula(mode: str, stage: int, psi: int, world: int, lib: str, muon: int = 0) -> float:
    """Model-state bytes per rank of ``mode``; DeepSpeed's bf16 masters add its bf16 clone of the master shard;
    Muon keeps one fp32 momentum, not Adam's two moments, on its ``muon`` elements."""
    from shardspeed.estimate.states import estimate_model_state_memory

    dtype = {"fp32": "fp32", "autocast": "fp32"}.get(mode, "bf16")
    states = estimate_model_state_memory(psi, world, stage, dtype, offload_optimizer=mode.endswith("_off"),
                                         bf16_masters=mode.startswith("bf16_masters"),
                                         bf16_states=not mode.startswith("bf16_masters_f32")).total  # one RAM
    if mode.startswith("muon"):
        states -= 4 * muon / (world if stage else 1)
    return states + (2 * psi / world if lib == "ds" and mode == "bf16_masters" else 0.0)


def _engine(lib: str, model, cfg: Dict[str, Any]):
    if lib == "ss":
        import shardspeed

        return shardspeed.initialize(model=model, config=cfg)[0]
    import deepspeed

    return deepspeed.initialize(model=model, config=cfg, dist_init_required=False)[0]


def warm_up(lib: str, mode: str, stage: int) -> None:
    """One step of a tiny GPT in the same library and mode, thrown away: the first engine of a process pays
    one-time costs (lazy imports, kernels, thread pools, gloo buffers) that no estimator of the model prices."""
    import torch

    from shardspeed.models import GPT, GPTConfig

    torch.manual_seed(0)
    engine = _engine(lib, GPT(GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=32)),
                     config(mode, stage, 1))
    x = torch.randint(0, 64, (1, 16))
    engine.backward(engine(x, x))
    engine.step()
    engine.destroy()


def worker(rank, world, port, lib, model_name, mode, stage, steps, q):
    try:
        worker_setup(rank, world, port, threads=1)
        init_gloo(rank, world)
        import gc

        import deepspeed  # noqa: F401  (both libraries in every process: the same baseline)
        import torch

        import shardspeed  # noqa: F401

        warm_up(lib, mode, stage)
        batches = [tuple(t[:, :seq(model_name)].contiguous() for t in make_batch(model_name, s, world, rank)) for s in range(steps)]
        gc.collect()
        torch.distributed.barrier()
        base = proc_status_kb("VmRSS")
        reset_peak_rss()
        model = build_model(model_name)
        psi = num_params(model)
        from shardspeed.optim.muon import use_muon

        muon = sum(p.numel() for n, p in model.named_parameters() if use_muon(n, p))
        if lib == "ds" and mode.startswith("muon"):  # its Muon step eager: no minutes of CPU compilation
            import torch._dynamo

            torch._dynamo.config.disable = True
        engine = _engine(lib, model, config(mode, stage, MODELS[model_name]["batch"]))
        del model
        gc.collect()
        build = proc_status_kb("VmHWM")
        torch.distributed.barrier()
        reset_peak_rss()
        losses = []
        for x, y in batches:
            loss = engine(x, y)
            engine.backward(loss)
            engine.step()
            losses.append(float(loss))
        row = {"rank": rank, "baseline_mib": base / 1024, "build_mib": (build - base) / 1024,
               "train_mib": (proc_status_kb("VmHWM") - base) / 1024, "psi": psi, "muon": muon, "losses": losses,
               "held_mib": engine.memory_breakdown()["total"] / MiB if lib == "ss" else None}
        rows: List[Any] = [None] * world
        torch.distributed.all_gather_object(rows, row)
        if rank == 0:
            q.put(("ok", rows))
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()
    except Exception:
        q.put(("error", traceback.format_exc()))


def predict(model_name: str, mode: str, stage: int, world: int) -> Dict[str, float]:
    """The estimator's start-up and training peaks (MiB; device + host: the same RAM here)."""
    from shardspeed.estimate import describe_gpt, estimate_peak
    from shardspeed.models import GPTConfig

    spec = dict(MODELS[model_name])
    cfg = config(mode, stage, spec["batch"])
    gpt = GPTConfig(**{k: spec[k] for k in ("vocab_size", "block_size", "n_layer", "n_head", "n_embd")})
    est = estimate_peak(describe_gpt(gpt, cfg, micro_batch=spec["batch"], seq_len=seq(model_name)), cfg, world_size=world)
    return {"build_mib": (est.startup_device + est.startup_host) / MiB,
            "train_mib": sum(est.terms.values()) / MiB, "total_mib": est.total / MiB, "phase": est.phase,
            "terms_mib": {k: v / MiB for k, v in est.terms.items()}}


def measure(lib: str, model_name: str, mode: str, stage: int, world: int, steps: int) -> Dict[str, Any]:
    rows = run_once(worker, world, (lib, model_name, mode, stage, steps), 3600, f"{lib} {mode} z{stage}")
    psi = rows[0]["psi"]
    out: Dict[str, Any] = {k: max(r[k] for r in rows) for k in ("baseline_mib", "build_mib", "train_mib")}
    out.update(peak_mib=max(out["build_mib"], out["train_mib"]), psi=psi, losses=rows[0]["losses"],
               held_mib=rows[0]["held_mib"], formula_mib=formula(mode, stage, psi, world, lib, rows[0]["muon"]) / MiB)
    return out


def add_estimate(r: Dict[str, Any], model_name: str, mode: str, stage: int, world: int) -> None:
    """The estimator's figures for a measured row, and its error against the measured peak."""
    r["estimate"] = predict(model_name, mode, stage, world)
    r["estimate_error"] = r["estimate"]["total_mib"] / r["peak_mib"] - 1


def table(results: Dict[str, Dict[str, Any]], world: int) -> str:
    head = ("| ZeRO | mode | library | build peak | train peak | peak | model states (formula) | held (counted) "
            "| estimate build / train / peak | estimate error | last loss |")
    lines = [head, "|" + "---|" * 11]
    for key, r in results.items():
        stage, mode, lib = key.split("/")
        held = f"{r['held_mib']:.0f}" if r.get("held_mib") is not None else "–"
        e = r.get("estimate")
        est = f"{e['build_mib']:.0f} / {e['train_mib']:.0f} / {e['total_mib']:.0f}" if e else "–"
        err = f"{100 * r['estimate_error']:+.1f}%" if e else "–"
        lines.append(f"| {stage} | {mode} | {lib} | {r['build_mib']:.0f} | {r['train_mib']:.0f} | {r['peak_mib']:.0f} "
                     f"| {r['formula_mib']:.0f} | {held} | {est} | {err} | {r['losses'][-1]:.4f} |")
    lines.append(f"MiB per rank over the post-import baseline, max over {world} ranks; build: model built + engine "
                 "initialised; train: the steps after it; estimate: estimate_peak (start-up, training phase, the larger)")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="gpt-113m")
    ap.add_argument("--world", type=int, default=4)
    ap.add_argument("--stages", default="3")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--libs", default="ss,ds")
    ap.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results", "precision_memory.json"))
    ap.add_argument("--from-json", help="estimate again for the measurements saved in this file (no run)")
    args = ap.parse_args()
    if args.from_json:
        reestimate(args.from_json)
        return
    os.environ["MALLOC_MMAP_THRESHOLD_"] = "65536"  # before any worker starts: glibc reads it once
    t0 = time.time()
    results: Dict[str, Dict[str, Any]] = {}
    for stage in (int(s) for s in args.stages.split(",")):
        for mode in args.modes.split(","):
            for lib in args.libs.split(","):
                r = results[f"{stage}/{mode}/{lib}"] = measure(lib, args.model, mode, stage, args.world, args.steps)
                if lib == "ss":
                    add_estimate(r, args.model, mode, stage, args.world)
                err = f"{100 * r['estimate_error']:+.1f}%" if "estimate" in r else "–"
                print(f"z{stage} {mode:12s} {lib}: build {r['build_mib']:.0f} train {r['train_mib']:.0f} MiB, formula "
                      f"{r['formula_mib']:.0f}, estimate error {err} ({time.time() - t0:.0f}s)", flush=True)
    meta = {"command": "python benchmarks/bench_precision_memory.py " + " ".join(sys.argv[1:]), "model": args.model,
            "world": args.world, "steps": args.steps, "seq": seq(args.model), "mmap_threshold": 65536,
            "wall_s": time.time() - t0}
    write(args.out, meta, results)


def write(path: str, meta: Dict[str, Any], results: Dict[str, Dict[str, Any]]) -> None:
    text = table(results, meta["world"])
    print(text)
    with open(path, "w") as f:
        json.dump({"meta": meta, "table": text, "results": results}, f, indent=1)
    print("wrote", os.path.relpath(path, ROOT))


def reestimate(path: str) -> None:
    with open(path) as f:
        saved = json.load(f)
    meta = saved["meta"]
    for key, r in saved["results"].items():
        stage, mode, lib = key.split("/")
        if lib == "ss":
            add_estimate(r, meta["model"], mode, int(stage), meta["world"])
    write(path, meta, saved["results"])


if __name__ == "__main__":
    main()
