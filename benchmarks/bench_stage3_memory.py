"""Issue 9, part 3: stage-3 memory per rank beside FSDP2 (does stage 3 free what it gathers?).

    python benchmarks/bench_stage3_memory.py            # GPT 112.6M, world 4, fp32, 2 steps: ~4-6 min here
                                                        # (fsdp2, ss3 at the suite's 2M buckets, ss3-dsb at
                                                        # DeepSpeed's default bucket sizes)
    python benchmarks/bench_stage3_memory.py --quick    # GPT 4.2M, world 2: well under a minute
    python benchmarks/bench_stage3_memory.py --systems ddp,fsdp2,ss3    # DDP too (16Ψ per rank: ~1.8 GB each)

Systems (built by benchmarks/systems.py, as in the suite): ``fsdp2`` (``fully_shard`` on every block, then the
root, ``reshard_after_forward=True``, the default), ``ss3`` (shardspeed, the suite's DeepSpeed-format config
with ``zero_optimization.stage: 3``), optionally ``ddp`` (activations with every parameter resident: a
reference for what forward costs without any gathering). Every system starts from the same weights
(``build_model``, seed 0), sees the same batches (``make_batch``) and runs fp32 AdamW with clipping.

How memory is measured (per rank, on the process itself; one group of ``world`` gloo processes per
system, all under one coordinator; the groups run one after the other so that the ~20 GB box is not
asked to hold every system at once, except with ``--quick`` (or ``--together``), where they run at once):
- glibc's mmap threshold is fixed: ``MALLOC_MMAP_THRESHOLD_`` (default 65536) is put in the coordinator's
  environment before the first worker (or the forkserver) starts, so every allocation of 64 KiB or more
  is its own mapping and is returned to the system when freed. Without it glibc raises the threshold
  dynamically after the first large free, freed tensors stay in the heap, and RSS only ever grows.
  Each worker checks that it took effect: it allocates 100 x 1 MiB tensors interleaved with 48 KiB
  long-lived ones (which pin the heap), frees the big ones and requires RSS to drop by >= 80 MiB.
- phase boundaries: ``VmRSS`` after imports and process-group setup (the baseline, before the model is
  built), after building the system, and in every step before forward, after forward, after backward
  and after the optimizer step.
- the exact peak of each phase: ``VmHWM`` is reset (``/proc/self/clear_refs`` <- 5) when the phase
  starts and read when it ends; the peak of the run is the largest of them.
- a background thread samples ``VmRSS`` every ``--sample-ms`` ms (default 5) for a timeline and as a
  cross-check of the high-water marks (sampling can miss short spikes; VmHWM cannot).

Reported per system, max over ranks: peak RSS (absolute, as issue 9 quotes it, and over the baseline),
forward growth (RSS after forward - RSS before forward, and the forward phase's peak over its start), in
MiB and in units of one transformer block's fp32 parameters; beside them the ZeRO-3 formula for fp32
model states, params 4Ψ/N + grads 4Ψ/N + Adam m,v 8Ψ/N = 16Ψ/N (the fp32 parameter is the master: no
separate copy), and the ratio shardspeed/FSDP2 of both. JSON: benchmarks/results/stage3_memory.json
(``--quick``: stage3_memory-quick.json).
"""
from __future__ import annotations

import argparse
import gc
import importlib
import json
import os
import sys
import threading
import time
import traceback
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from benchmarks.harness import (  # noqa: E402
    init_gloo,
    next_result,
    proc_status_kb,
    reset_peak_rss,
    spawn_workers,
    worker_setup,
)
from benchmarks.models import MODELS  # noqa: E402

MiB = 2**20
PHASES = ("forward", "backward", "step")

# The models of this benchmark (added to the shared table so build_model/make_batch work on them).
# gpt-113m: GPT-2 small's body (12 heads, width 768) with 14 blocks and a 16384-token vocabulary,
# 112.6M parameters (tied embedding/head counted once): the size issue 9 quotes.
MODELS.setdefault("gpt-113m", {"kind": "gpt", "vocab_size": 16384, "block_size": 1024, "n_layer": 14, "n_head": 12,
                                   "n_embd": 768, "batch": 2})
SEQ = {"gpt-113m": 128}  # tokens per sample actually fed (block_size is the number of learned positions)


def _batch(model_name: str, step: int, world: int, rank: int):
    from benchmarks.models import make_batch

    x, y = make_batch(model_name, step, world, rank)
    t = SEQ.get(model_name)
    return (x[:, :t].contiguous(), y[:, :t].contiguous()) if t else (x, y)


# ---- the worker --------------------------------------------------------------------------------------


class Sampler(threading.Thread):
    """Samples VmRSS every ``period`` seconds; keeps (t, kB, phase) and the max per phase label."""

    def __init__(self, period: float):
        super().__init__(daemon=True)
        self.period, self.phase, self.samples = period, "init", []
        self.max_by_phase: dict[str, int] = {}
        self._stop_ev = threading.Event()
        self.t0 = time.perf_counter()

    def run(self):
        while not self._stop_ev.is_set():
            kb = proc_status_kb("VmRSS")
            ph = self.phase
            self.samples.append((round(time.perf_counter() - self.t0, 4), kb, ph))
            if kb > self.max_by_phase.get(ph, 0):
                self.max_by_phase[ph] = kb
            self._stop_ev.wait(self.period)

    def stop(self):
        self._stop_ev.set()
        self.join()


def mmap_threshold_check() -> dict[str, Any]:
    """Does freeing memory return it to the system? 100 x 1 MiB tensors interleaved with 48 KiB ones that
    stay alive (large enough not to be served from the heap's free lists, so they sit between the big ones): with a fixed 64 KiB mmap threshold each 1 MiB block is its own mapping and RSS drops by
    ~100 MiB when they are freed; under glibc's dynamic threshold (raised to >1 MiB by the first free
    below) they come from the heap, which the small survivors pin, and RSS stays."""
    import torch

    warm = torch.ones(1 << 18)  # 1 MiB: freeing an mmapped chunk raises a dynamic threshold above it
    del warm
    big, pins = [], []
    for _ in range(100):
        big.append(torch.ones(1 << 18))
        pins.append(torch.ones(12 << 10))  # 48 KiB: below the fixed threshold, fresh from the heap's top
    before = proc_status_kb("VmRSS")
    del big
    gc.collect()
    after = proc_status_kb("VmRSS")
    del pins
    drop = (before - after) / 1024
    return {"env": os.environ.get("MALLOC_MMAP_THRESHOLD_"), "rss_drop_mib": drop, "ok": drop >= 80}


def _phased(sysobj):
    """(forward, backward, optimizer step) of one of benchmarks/systems.py's systems, split apart."""
    from benchmarks.systems import CLIP, DeepSpeedSystem, ShardspeedSystem

    if isinstance(sysobj, (ShardspeedSystem, DeepSpeedSystem)):
        eng = sysobj.engine
        return (lambda x, y: eng(x, y)), eng.backward, eng.step

    import torch

    def step():  # as DDPSystem.step / FSDP2System.step do after backward
        torch.nn.utils.clip_grad_norm_(sysobj.model.parameters(), CLIP)
        try:
            sysobj.opt.step()
        except RuntimeError:  # FSDP2System's fallback when fused AdamW refuses DTensors
            if getattr(sysobj, "step_checked", True):
                raise
            sysobj.opt = torch.optim.AdamW(sysobj.model.parameters(), lr=sysobj.opt.defaults["lr"],
                                           weight_decay=sysobj.opt.defaults["weight_decay"])
            sysobj.kernel = "default"
            sysobj.opt.step()
        sysobj.step_checked = True
        sysobj.opt.zero_grad(set_to_none=True)

    return (lambda x, y: sysobj.model(x, y)), (lambda loss: loss.backward()), step


def _worker(system: str, model_name: str, rank: int, world: int, port: int, steps: int, sample_ms: float,
            res_q) -> None:
    worker_setup(rank, world, port, threads=1)
    try:
        import torch
        import torch.distributed as dist

        init_gloo(rank, world)
        # import everything any system needs, in every system, so the baseline is the same for all
        import torch.distributed.fsdp  # noqa: F401

        import shardspeed  # noqa: F401
        from benchmarks.models import build_model, num_params
        from benchmarks.systems import build_system

        mmap = mmap_threshold_check()
        batches = [_batch(model_name, i, world, rank) for i in range(steps)]
        gc.collect()
        sampler = Sampler(sample_ms / 1e3)
        sampler.start()
        hwm_ok = reset_peak_rss()
        rss = {"baseline": proc_status_kb("VmRSS")}
        sampler.phase = "build"
        model = build_model(model_name)
        n_params = num_params(model)
        block_params = sum(p.numel() for p in model.blocks[0].parameters())
        sysobj = build_system(system, model, MODELS[model_name]["batch"], "fp32")
        del model
        gc.collect()
        dist.barrier()
        rss["after_init"] = proc_status_kb("VmRSS")
        peaks = {"build": proc_status_kb("VmHWM")}
        fwd, bwd, opt_step = _phased(sysobj)
        per_step: list[dict[str, Any]] = []
        for i in range(steps):
            x, y = batches[i]
            dist.barrier()
            gc.collect()
            rec: dict[str, Any] = {"before_forward": proc_status_kb("VmRSS")}
            for phase in PHASES:
                sampler.phase = f"{phase}{i}"
                reset_peak_rss()
                start = proc_status_kb("VmRSS")
                t = time.perf_counter()
                if phase == "forward":
                    loss = fwd(x, y)
                elif phase == "backward":
                    bwd(loss)
                else:
                    opt_step()
                rec[f"{phase}_s"] = time.perf_counter() - t
                rec[f"after_{phase}"] = proc_status_kb("VmRSS")
                rec[f"{phase}_peak"] = proc_status_kb("VmHWM")
                rec[f"{phase}_start"] = start
            rec["loss"] = float(loss)
            del loss
            per_step.append(rec)
        sampler.phase = "end"
        time.sleep(2 * sample_ms / 1e3)
        sampler.stop()
        lib_mem = None
        try:
            lib_mem = sysobj.library_memory()
        except Exception as exc:  # an API that moved while the library is being reworked
            lib_mem = {"error": f"{type(exc).__name__}: {exc}"}
        res_q.put((rank, "ok", {
            "params": n_params, "block_params": block_params, "mmap_check": mmap, "hwm_reset": hwm_ok,
            "rss_kb": rss, "build_peak_kb": peaks["build"], "steps": per_step,
            "sampled_max_kb": sampler.max_by_phase, "samples": sampler.samples[:: max(1, len(sampler.samples) // 400)],
            "n_samples": len(sampler.samples), "library_memory": lib_mem, "kernel": getattr(sysobj, "kernel", "?"),
        }))
        dist.barrier()
        dist.destroy_process_group()
    except BaseException:
        res_q.put((rank, "error", traceback.format_exc()))


# ---- the coordinator ---------------------------------------------------------------------------------


class Group:
    """The ``world`` worker processes of one system (fresh processes: nothing inherited from another system)."""

    def __init__(self, system: str, model_name: str, world: int, steps: int, sample_ms: float):
        self.system, self.world = system, world
        target = importlib.import_module("benchmarks.bench_stage3_memory")._worker  # picklable by module name
        self.t0 = time.perf_counter()
        self.procs, self.res_q = spawn_workers(
            target, world, lambda r, port, q: (system, model_name, r, world, port, steps, sample_ms, q))

    def collect(self, timeout: float, log=print) -> dict[str, Any]:
        got: dict[int, Any] = {}
        try:
            deadline = time.monotonic() + timeout
            while len(got) < self.world:
                rank, _, payload = next_result(self.res_q, self.procs, self.system, deadline)
                got[rank] = payload
            for p in self.procs:
                p.join(timeout=60)
        except RuntimeError as exc:
            log(str(exc))
            return {"system": self.system, "status": "failed", "message": str(exc).splitlines()[-1]}
        finally:
            for p in self.procs:
                if p.is_alive():
                    p.kill()
                    p.join()
        return summarise(self.system, self.world, [got[r] for r in range(self.world)], time.perf_counter() - self.t0)


def summarise(system: str, world: int, reps: list[dict], wall: float) -> dict[str, Any]:
    r0 = reps[0]
    psi, blk = r0["params"], r0["block_params"]
    block_mib = 4 * blk / MiB

    def mx(f):
        return max(f(r) for r in reps)

    def kb(v):
        return v / 1024

    peak_kb = mx(lambda r: max([r["build_peak_kb"]] + [s[f"{p}_peak"] for s in r["steps"] for p in PHASES]))
    base = [kb(r["rss_kb"]["baseline"]) for r in reps]
    last = lambda r: r["steps"][-1]  # noqa: E731  (steady state: optimizer states exist)
    fwd_growth = mx(lambda r: kb(last(r)["after_forward"] - last(r)["before_forward"]))
    fwd_peak_growth = mx(lambda r: kb(last(r)["forward_peak"] - last(r)["forward_start"]))
    fwd_growth_first = mx(lambda r: kb(r["steps"][0]["after_forward"] - r["steps"][0]["before_forward"]))
    phase_rss = {k: mx(lambda r, k=k: kb(last(r)[k])) for k in
                 ("before_forward", "after_forward", "after_backward", "after_step")}
    phase_peak = {p: mx(lambda r, p=p: kb(max(s[f"{p}_peak"] for s in r["steps"]))) for p in PHASES}
    sampled_peak = mx(lambda r: kb(max(r["sampled_max_kb"].values())))
    formula = {"params": 4 * psi / world, "grads": 4 * psi / world, "adam": 8 * psi / world}
    formula["total"] = sum(formula.values())
    losses = [sum(r["steps"][i]["loss"] for r in reps) / len(reps) for i in range(len(r0["steps"]))]
    return {
        "system": system, "status": "ok", "world": world, "params": psi, "block_params": blk, "block_mib": block_mib,
        "optimizer_kernel": r0["kernel"], "wall_s": wall,
        "peak_rss_mib": kb(peak_kb), "peak_rss_delta_mib": mx(lambda r: kb(max(
            [r["build_peak_kb"]] + [s[f"{p}_peak"] for s in r["steps"] for p in PHASES]) - r["rss_kb"]["baseline"])),
        "sampled_peak_rss_mib": sampled_peak,
        "baseline_rss_mib": max(base), "after_init_rss_mib": mx(lambda r: kb(r["rss_kb"]["after_init"])),
        "forward_growth_mib": fwd_growth, "forward_growth_blocks": fwd_growth / block_mib,
        "forward_peak_growth_mib": fwd_peak_growth, "forward_peak_growth_blocks": fwd_peak_growth / block_mib,
        "forward_growth_first_step_mib": fwd_growth_first,
        "phase_rss_last_step_mib": phase_rss, "phase_peak_mib": phase_peak,
        "zero3_formula_bytes": formula, "zero3_formula_mib": formula["total"] / MiB,
        "losses": losses, "phase_seconds_last_step": {p: max(r["steps"][-1][f"{p}_s"] for r in reps) for p in PHASES},
        "mmap_check": [r["mmap_check"] for r in reps], "hwm_reset": all(r["hwm_reset"] for r in reps),
        "library_memory": r0["library_memory"],
        "per_rank": [{"rss_kb": r["rss_kb"], "build_peak_kb": r["build_peak_kb"], "steps": r["steps"],
                      "sampled_max_kb": r["sampled_max_kb"], "n_samples": r["n_samples"]} for r in reps],
        "timeline_rank0": r0["samples"],
    }


def table(rows: dict[str, dict]) -> str:
    ok = {s: r for s, r in rows.items() if r.get("status") == "ok"}
    ref = ok.get("fsdp2")
    anyr = next(iter(ok.values()), None)
    out = []
    if anyr:
        psi, n = anyr["params"], anyr["world"]
        out.append(f"GPT {psi / 1e6:.1f}M parameters (Ψ), world {n}, fp32 AdamW; one block (unit) = "
                   f"{anyr['block_params'] / 1e6:.2f}M params = {anyr['block_mib']:.1f} MiB fp32; whole fp32 model "
                   f"{4 * psi / MiB:.0f} MiB; ZeRO-3 model states per rank 16Ψ/N = {anyr['zero3_formula_mib']:.0f} MiB "
                   f"(params 4Ψ/N {anyr['zero3_formula_bytes']['params'] / MiB:.0f} + grads 4Ψ/N "
                   f"{anyr['zero3_formula_bytes']['grads'] / MiB:.0f} + Adam 8Ψ/N {anyr['zero3_formula_bytes']['adam'] / MiB:.0f})")
    out += ["| system | peak RSS MiB | peak Δ over baseline MiB | forward growth MiB | forward growth (blocks) "
            "| forward peak growth (blocks) | ZeRO-3 formula MiB | peak / FSDP2 | peak Δ / FSDP2 | final loss |",
            "|---|---|---|---|---|---|---|---|---|---|"]
    for s, r in rows.items():
        if r.get("status") != "ok":
            out.append(f"| {s} | {r.get('status')}: {r.get('message', '')} | | | | | | | | |")
            continue
        ratio = r["peak_rss_mib"] / ref["peak_rss_mib"] if ref else None
        dratio = r["peak_rss_delta_mib"] / ref["peak_rss_delta_mib"] if ref else None
        r["peak_vs_fsdp2"], r["peak_delta_vs_fsdp2"] = ratio, dratio
        f = lambda v: f"{v:.2f}×" if v is not None else "–"  # noqa: E731
        out.append(f"| {s} | {r['peak_rss_mib']:.0f} | {r['peak_rss_delta_mib']:.0f} | {r['forward_growth_mib']:.0f} "
                   f"| {r['forward_growth_blocks']:.1f} | {r['forward_peak_growth_blocks']:.1f} "
                   f"| {r['zero3_formula_mib']:.0f} | {f(ratio)} | {f(dratio)} | {r['losses'][-1]:.5f} |")
    if anyr:
        out.append("peak: max over ranks of VmHWM over the run; Δ: minus the rank's RSS before the model was built; "
                   "forward growth: RSS after forward - before forward (last step); forward peak growth: "
                   "VmHWM during forward - RSS at its start.")
    return "\n".join(out)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="small GPT (gpt-quick, 4.2M), world 2")
    ap.add_argument("--systems", default="fsdp2,ss3,ss3-dsb",
                    help="from ddp, fsdp2, ss3 (also ss0-ss2, ds0-ds3; -dsb: DeepSpeed's default buckets)")
    ap.add_argument("--model", default=None, help=f"default gpt-113m (--quick: gpt-quick); from {sorted(MODELS)}")
    ap.add_argument("--world", type=int, default=None, help="default 4 (--quick: 2)")
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--sample-ms", type=float, default=5.0)
    ap.add_argument("--mmap-threshold", type=int, default=65536,
                    help="MALLOC_MMAP_THRESHOLD_ for the workers; 0 = leave glibc's dynamic threshold (control)")
    ap.add_argument("--together", action=argparse.BooleanOptionalAction, default=None,
                    help="run every system's workers at once (default: only with --quick, where memory is small)")
    ap.add_argument("--tag", default=None, help="results/<tag>.json (default stage3_memory[-quick])")
    args = ap.parse_args(argv)
    model = args.model or ("gpt-quick" if args.quick else "gpt-113m")
    world = args.world or (2 if args.quick else 4)
    tag = args.tag or ("stage3_memory-quick" if args.quick else "stage3_memory")
    # Must be in the environment when each worker process (and the forkserver they are forked from) starts:
    # glibc reads it once, at its first malloc.
    if args.mmap_threshold:
        os.environ["MALLOC_MMAP_THRESHOLD_"] = str(args.mmap_threshold)
    else:
        os.environ.pop("MALLOC_MMAP_THRESHOLD_", None)
    from benchmarks.report import machine

    together = args.together if args.together is not None else args.quick

    meta = dict(machine(), command="python benchmarks/bench_stage3_memory.py " + " ".join(
        argv if argv is not None else sys.argv[1:]), model=model, model_spec=MODELS[model], seq=SEQ.get(model),
        world=world, steps=args.steps, mmap_threshold=args.mmap_threshold or None, together=together)
    print(f"{model}, world {world}, {args.steps} steps, MALLOC_MMAP_THRESHOLD_={os.environ.get('MALLOC_MMAP_THRESHOLD_')}"
          f"; systems {args.systems}, " + ("all at once" if together else "one after the other"))
    t0 = time.time()
    rows: dict[str, dict] = {}
    systems = [s for s in args.systems.split(",") if s]
    waves = [systems] if together else [[s] for s in systems]
    for wave in waves:
        groups = [Group(s, model, world, args.steps, args.sample_ms) for s in wave]
        for g in groups:
            rows[g.system] = g.collect(timeout=900)
    for s, r in rows.items():
        if r.get("status") == "ok":
            chk = r["mmap_check"]
            print(f"  {s}: {r['wall_s']:.0f}s, peak {r['peak_rss_mib']:.0f} MiB (sampled max {r['sampled_peak_rss_mib']:.0f})"
                  f", forward +{r['forward_growth_mib']:.0f} MiB, losses {[round(v, 5) for v in r['losses']]}, mmap check RSS drop "
                  f"{min(c['rss_drop_mib'] for c in chk):.0f} MiB ({'ok' if all(c['ok'] for c in chk) else 'NOT RETURNED'})")
            if args.mmap_threshold and not all(c["ok"] for c in chk):
                print("  WARNING: freed memory was not returned to the system: RSS figures overstate the live set")
    text = table(rows)
    print(text)
    write_results(tag, meta, text, rows, t0)
    return 0


def write_results(tag: str, meta: dict, text: str, rows: dict, t0: float) -> str:
    """benchmarks/results/<tag>.json: the run's meta (wall time added), its table and per-system rows."""
    meta["wall_s"] = time.time() - t0
    os.makedirs(os.path.join(ROOT, "benchmarks", "results"), exist_ok=True)
    path = os.path.join(ROOT, "benchmarks", "results", f"{tag}.json")
    with open(path, "w") as f:
        json.dump({"meta": meta, "table": text, "results": rows}, f, indent=1, default=float)
    print("wrote", os.path.relpath(path), f"({meta['wall_s']:.0f}s)")
    return path


if __name__ == "__main__":
    import signal

    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    sys.exit(main())
