"""Issue 23: the longest trainable sequence on this box, per configuration, beside DeepSpeed's ALST.

    python benchmarks/bench_long_context.py                 # Llama 105.9M (LlamaConfig, fp32), every config
    python benchmarks/bench_long_context.py --quick         # Llama 6.9M: the machinery in a few minutes
    python benchmarks/bench_long_context.py --configs ss-sp2-w2,ds-sp2-w2 --cap-gib 1.5

Configurations (``CONFIGS``): shardspeed at world 4 with SP 1 (DP 4), 2 (SP 2 x DP 2) and 4, each plain
(checkpointing every layer) and with tiling + offload (tiled MLP, tiled fused loss, cpu_checkpointing); ring
attention at SP 4; and, at SP 2 on world 2, shardspeed and DeepSpeed 0.19.8's ALST (its
``UlyssesSPAttentionHF``, HF gradient checkpointing) on the same model, config and batches. All ZeRO 3,
fp32 AdamW (torch's, passed in), micro-batch 1, one sample per data replica.

The search, per configuration, in one group of fresh processes (restarted after a trial over the cap):
the global length doubles from ``--start`` until a trial goes over the cap, then bisects between the
longest that fit and the shortest that did not, to ``--resolution`` (default 1/8). A trial is one training
step at that length. The cap is a per-rank RSS budget (``--cap-gib``): a watchdog thread in every rank reads
VmRSS every 2 ms and ends the process when it passes the cap, so the shared box never sees more than
world x cap from this benchmark; the coordinator also waits for ``free`` memory of world x cap + 1 GiB
before it starts a group. One configuration's group runs at a time.

Each group first trains one untimed step of ``WARMUP_TOKENS_PER_RANK`` tokens per rank, so that every
trial runs with the optimizer's states allocated, as a training run's steps do. Measured per trial, max
over ranks: the step's peak RSS (VmHWM reset before the step; glibc's mmap threshold fixed by
``MALLOC_MMAP_THRESHOLD_`` so freed tensors leave the process), the step time and the time per token (step
time / global tokens). Predicted: the RSS before the model is built (measured) + the estimator's peak,
:func:`shardspeed.estimate.long_context.long_context_peak` (the long-context activations priced with the
plan's model states, stage 3's gathered units and gradient buckets; on a CPU the offloaded bytes stay in
the process, so device + host). DeepSpeed's longest length is also run by shardspeed at SP 2 on world 2 if
its search did not try it, for the step-time ratio. JSON: benchmarks/results/long_context.json
(``--quick``: -quick.json). ``--reprice FILE...`` prices stored trials again after an estimator change.
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import threading
import time
import traceback
from typing import Any, Dict, List, Optional

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from benchmarks.harness import (  # noqa: E402
    init_gloo,
    next_result,
    proc_status_kb,
    reset_peak_rss,
    spawn_workers,
    stop_workers,
    worker_setup,
)

GiB = 2**30
MODELS = {  # LlamaConfig keywords
    "llama-106m": dict(vocab_size=32000, hidden_size=768, intermediate_size=2048, num_hidden_layers=9,
                       num_attention_heads=12, num_key_value_heads=4),
    "llama-7m": dict(vocab_size=8000, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
                     num_attention_heads=4, num_key_value_heads=2),
}
# name: (system, world, sp, attention, tiled: MLP tiles / loss tiles / cpu_checkpointing)
CONFIGS = {
    "ss-sp1-w4": ("shardspeed", 4, 1, "ulysses", False),
    "ss-sp1-w4-tiled": ("shardspeed", 4, 1, "ulysses", True),
    "ss-sp2-w4": ("shardspeed", 4, 2, "ulysses", False),
    "ss-sp2-w4-tiled": ("shardspeed", 4, 2, "ulysses", True),
    "ss-sp4-w4": ("shardspeed", 4, 4, "ulysses", False),
    "ss-sp4-w4-tiled": ("shardspeed", 4, 4, "ulysses", True),
    "ss-ring4-w4-tiled": ("shardspeed", 4, 4, "ring", True),
    "ss-sp2-w2": ("shardspeed", 2, 2, "ulysses", False),
    "ds-sp2-w2": ("deepspeed", 2, 2, "ulysses", False),
}
TILES = 8  # MLP and loss tiles when tiled
WARMUP_TOKENS_PER_RANK = 64  # each group's untimed first step
LR = 1e-4


def _config(sp: int, tiled: bool) -> Dict[str, Any]:
    return {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1, "gradient_clipping": 1.0,
            "zero_optimization": {"stage": 3}, "sequence_parallel_size": sp,
            "activation_checkpointing": {"enabled": True, "cpu_checkpointing": bool(tiled)}}


def _build(model_name: str):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(max_position_embeddings=1 << 20, tie_word_embeddings=False, attention_dropout=0.0,
                      **MODELS[model_name])
    torch.manual_seed(0)
    return LlamaForCausalLM._from_config(cfg, attn_implementation="sdpa")


def _engine(system: str, model, sp: int, attention: str, tiled: bool):
    """(step(batch) -> loss, mpu) of one system."""
    import torch

    from shardspeed.parallel.sp import causal_lm_loss, enable_tiled_mlp, sequence_parallel_loss

    cfg = _config(sp, tiled)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0)
    if system == "deepspeed":
        import deepspeed
        from deepspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPAttentionHF

        deepspeed.init_distributed(dist_backend="gloo")
        mpu = UlyssesSPAttentionHF.register_with_transformers(model, "sdpa", sp, 1)
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        del cfg["activation_checkpointing"]
        engine, *_ = deepspeed.initialize(model=model, config=cfg, mpu=mpu, optimizer=opt)
    else:
        import shardspeed
        from shardspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPAttentionHF, sequence_parallel_mpu

        mpu = UlyssesSPAttentionHF.register_with_transformers(model, "sdpa", sp, 1, attention=attention) \
            if sp > 1 else sequence_parallel_mpu(1)
        if tiled:
            enable_tiled_mlp(model, TILES)
        engine, *_ = shardspeed.initialize(model=model, config=cfg, mpu=mpu, optimizer=opt)
    group = mpu.get_sequence_parallel_group()

    def step(b: Dict[str, Any]):
        if tiled:
            hidden = engine.module.model(input_ids=b["input_ids"], position_ids=b["position_ids"]).last_hidden_state
            loss = causal_lm_loss(engine.module, hidden, b["shift_labels"], group, shards=TILES)
        else:
            logits = engine(input_ids=b["input_ids"], position_ids=b["position_ids"]).logits
            loss = sequence_parallel_loss(logits, b["shift_labels"], group)
            del logits
        engine.backward(loss)
        engine.step()
        return float(loss.detach())

    return step, mpu


def _watchdog(cap_kb: int, rank: int, res_q) -> None:
    """End this process when its RSS passes the cap (a trial over budget), before the box feels it."""
    def run() -> None:
        while True:
            kb = proc_status_kb("VmRSS")
            if kb > cap_kb:
                res_q.put((rank, "over", kb))
                time.sleep(0.05)
                os._exit(3)
            time.sleep(0.002)

    threading.Thread(target=run, daemon=True).start()


def _warm_up() -> None:
    """Load the code a step runs (transformers' Llama, autograd, sdpa, AdamW) on a toy model before the
    baseline is read: library pages are the process's, not the estimator's."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                      num_attention_heads=4, num_key_value_heads=2)
    toy = LlamaForCausalLM._from_config(cfg, attn_implementation="sdpa")
    opt = torch.optim.AdamW(toy.parameters())
    ids = torch.randint(0, 64, (1, 16))
    toy(input_ids=ids, labels=ids).loss.backward()
    opt.step()


def _worker(name: str, model_name: str, cap_kb: int, rank: int, world: int, port: int, cmd_q, res_q) -> None:
    system, world_, sp, attention, tiled = CONFIGS[name]
    worker_setup(rank, world, port, threads=1)
    try:
        import torch
        import torch.distributed as dist

        init_gloo(rank, world)
        import transformers  # noqa: F401  (every system imports the same before the baseline)

        import shardspeed  # noqa: F401
        from shardspeed.parallel.sp import shard_batch

        if system == "deepspeed":
            import deepspeed  # noqa: F401
        _warm_up()
        gc.collect()
        baseline = proc_status_kb("VmRSS")
        _watchdog(cap_kb, rank, res_q)
        step, mpu = _engine(system, _build(model_name), sp, attention, tiled)
        sp_rank, dp_rank = mpu.get_sequence_parallel_rank(), dist.get_rank() // sp  # sequence ranks adjacent
        gc.collect()
        after_init = proc_status_kb("VmRSS")
        vocab = MODELS[model_name]["vocab_size"]
        layout = "zigzag" if attention == "ring" else "contiguous"

        def batch(seq: int, seed: int) -> Dict[str, Any]:
            ids = torch.randint(0, vocab, (1, seq), generator=torch.Generator().manual_seed(seed))
            return shard_batch({"input_ids": ids, "labels": ids.clone()}, sp_rank, sp, layout=layout)

        # one step at a short length first: the optimizer's states exist from the first step on, and a
        # trial must see them (the first step of a group would otherwise peak without them)
        step(batch(WARMUP_TOKENS_PER_RANK * sp, 999))
        gc.collect()
        res_q.put((rank, "ready", {"baseline_kb": baseline, "after_init_kb": after_init,
                                   "after_warmup_kb": proc_status_kb("VmRSS")}))
        while True:
            seq = cmd_q.get()
            if seq is None:
                break
            b = batch(seq, 1000 + dp_rank)
            gc.collect()
            dist.barrier()
            reset_peak_rss()
            start = proc_status_kb("VmRSS")
            t = time.perf_counter()
            loss = step(b)
            dist.barrier()
            elapsed = time.perf_counter() - t
            res_q.put((rank, "trial", {"seq": seq, "peak_kb": proc_status_kb("VmHWM"), "start_kb": start,
                                       "time_s": elapsed, "loss": loss}))
    except BaseException:
        res_q.put((rank, "error", traceback.format_exc()))


class Group:
    """One configuration's ranks, alive across trials until one goes over the cap."""

    def __init__(self, name: str, model_name: str, cap_kb: int, timeout: float):
        import multiprocessing as mp

        self.name, self.world, self.timeout = name, CONFIGS[name][1], timeout
        ctx = mp.get_context("forkserver")
        self.cmd = [ctx.Queue() for _ in range(self.world)]
        self.procs, self.q = spawn_workers(_worker, self.world,
                                           lambda r, port, q: (name, model_name, cap_kb, r, self.world, port,
                                                               self.cmd[r], q))
        self.info = self._collect("ready")

    def _collect(self, kind: str) -> Optional[List[Dict[str, Any]]]:
        """Every rank's report of ``kind``, or None when a rank went over the cap."""
        got: Dict[int, Any] = {}
        deadline = time.monotonic() + self.timeout
        while len(got) < self.world:
            rank, k, payload = next_result(self.q, [p for p in self.procs if _not_failed(p)], self.name, deadline)
            if k == "over":
                return None
            got[rank] = payload
        return [got[r] for r in range(self.world)]

    def trial(self, seq: int) -> Optional[List[Dict[str, Any]]]:
        for q in self.cmd:
            q.put(seq)
        return self._collect("trial")

    def close(self, kill: bool = False) -> None:
        if not kill:
            for q in self.cmd:
                q.put(None)
        stop_workers(self.procs, 0.1 if kill else 30)


def _not_failed(p) -> bool:
    """A worker that has not died with an error (an over-cap exit is reported on the queue first)."""
    return p.exitcode in (None, 0, 3)


def wait_for_memory(need_gib: float, log=print) -> float:
    """Wait (up to 10 minutes) until the box has ``need_gib`` available; the available GiB."""
    for _ in range(60):
        with open("/proc/meminfo") as f:
            avail = next(int(line.split()[1]) for line in f if line.startswith("MemAvailable")) / 2**20
        if avail >= need_gib:
            return avail
        log(f"  waiting: {avail:.1f} GiB available, need {need_gib:.1f}")
        time.sleep(10)
    raise RuntimeError(f"the box never had {need_gib:.1f} GiB available")


# ---- the estimator's prediction -----------------------------------------------------------------------


def predict(model_name: str, name: str, seq: int, baseline_kb: int) -> Dict[str, float]:
    """Bytes per rank the estimator gives (:func:`shardspeed.estimate.long_context.long_context_peak`: the
    long-context activations priced with the plan's model states, gathered units and buckets), plus the
    measured baseline (the process before the model is built)."""
    import torch

    from shardspeed.estimate.long_context import long_context_peak
    from shardspeed.estimate.model import describe_module

    system, world, sp, attention, tiled = CONFIGS[name]
    m = MODELS[model_name]
    cfg = dict(_config(sp, tiled), optimizer={"type": "AdamW", "params": {"lr": LR}})
    with torch.device("meta"):
        spec = describe_module(_build(model_name), cfg, shape=_shape(model_name, seq))
    est, act = long_context_peak(spec, cfg, world, seq, 4, sp=sp, attention=attention, offload=tiled,
                                 mlp_tiles=TILES if tiled else 1, loss_tiles=TILES if tiled else 1,
                                 kv_heads=m["num_key_value_heads"])
    terms = est.terms
    act_bytes = terms.get("activations", 0.0)
    return {"psi": spec.num_params, "states": sum(terms.get(k, 0.0) for k in ("params", "master", "optimizer", "grads")),
            "stage3_buffers": sum(terms.get(k, 0.0) for k in ("gathered", "grad_buckets")),
            "activations": act_bytes, "total": baseline_kb * 1024.0 + est.total, "phase": est.phase}


def _shape(model_name: str, seq: int):
    from shardspeed.estimate.activations import TransformerShape

    m = MODELS[model_name]
    return TransformerShape(n_layer=m["num_hidden_layers"], hidden=m["hidden_size"], n_head=m["num_attention_heads"],
                            vocab=m["vocab_size"], ffn_hidden=m["intermediate_size"], max_seq=seq)


# ---- the search -------------------------------------------------------------------------------------------


def _round(n: float, unit: int) -> int:
    return max(unit, int(round(n / unit)) * unit)


def search(name: str, args, log=print) -> Dict[str, Any]:
    """Double then bisect the global length under the cap; every trial's measurements."""
    world, sp = CONFIGS[name][1], CONFIGS[name][2]
    unit = 2 * sp * 8
    cap_kb = int(args.cap_gib * GiB / 1024)
    trials: List[Dict[str, Any]] = []
    group: Optional[Group] = None
    fit, over = 0, 0
    seq = _round(args.start, unit)
    info: List[Dict[str, Any]] = []
    try:
        while seq and (seq <= args.max_seq):
            if group is None:
                wait_for_memory(world * args.cap_gib + 1.0, log)
                group = Group(name, args.model, cap_kb, args.timeout)
                info = group.info or []
            res = group.trial(seq)
            if res is None:
                log(f"  {name}: {seq:>7} tokens: over the {args.cap_gib} GiB cap")
                group.close(kill=True)
                group, over = None, seq
                trials.append({"seq": seq, "over": True})
            else:
                peak = max(r["peak_kb"] for r in res)
                t = max(r["time_s"] for r in res)
                pred = predict(args.model, name, seq, max(i["baseline_kb"] for i in info))
                row = {"seq": seq, "over": False, "peak_kb": peak, "time_s": t,
                       "start_kb": max(r["start_kb"] for r in res),
                       "s_per_token": t / (seq * world // sp), "loss": res[0]["loss"],
                       "predicted_kb": pred["total"] / 1024, "prediction": pred}
                trials.append(row)
                log(f"  {name}: {seq:>7} tokens: peak {peak / 2**20:.2f} GiB (predicted "
                    f"{row['predicted_kb'] / 2**20:.2f}), {t:.1f} s")
                fit = max(fit, seq)
            if not over:
                seq = seq * 2
            elif over - fit > max(unit, fit * args.resolution):
                seq = _round((fit + over) / 2, unit) if fit else _round(over / 2, unit)
                if seq in (fit, over):
                    break
            else:
                break
    finally:
        if group is not None:
            group.close()
    return {"config": name, "longest": fit, "first_over": over, "trials": trials, "ready": info}


def table(results: Dict[str, Dict[str, Any]], args) -> str:
    head = (f"{'config':<20} {'longest':>8} {'peak GiB':>9} {'pred GiB':>9} {'err':>6} {'s/step':>8} "
            f"{'ms/token':>9}")
    lines = [head, "-" * len(head)]
    for name, r in results.items():
        best = [t for t in r["trials"] if not t["over"] and t["seq"] == r["longest"]]
        if not best:
            lines.append(f"{name:<20} {'-':>8}")
            continue
        t = best[0]
        err = t["predicted_kb"] / t["peak_kb"] - 1
        lines.append(f"{name:<20} {t['seq']:>8} {t['peak_kb'] / 2**20:>9.2f} {t['predicted_kb'] / 2**20:>9.2f} "
                     f"{err:>+6.1%} {t['time_s']:>8.1f} {1e3 * t['s_per_token']:>9.2f}")
    ss, ds = results.get("ss-sp2-w2"), results.get("ds-sp2-w2")
    if ss and ds and ss["longest"] and ds["longest"]:
        at = [t for t in ss["trials"] if not t["over"] and t["seq"] == ds["longest"]]
        dt = [t for t in ds["trials"] if not t["over"] and t["seq"] == ds["longest"]]
        if at and dt:
            lines.append(f"shardspeed / DeepSpeed at SP 2, world 2: longest {ss['longest'] / ds['longest']:.2f}x, "
                         f"step time at DeepSpeed's longest {at[0]['time_s'] / dt[0]['time_s']:.2f}x")
    lines.append(f"model {args.model}, fp32, ZeRO 3, micro-batch 1, cap {args.cap_gib} GiB per rank; "
                 f"load average at the end {' '.join(f'{x:.1f}' for x in os.getloadavg())} (a shared 2-core box)")
    return "\n".join(lines)


def reprice(paths: List[str]) -> str:
    """Prices every measured trial of stored results again with today's estimator (the measurements and
    the measured baseline unchanged), writes the new predictions into the files (the one made at run time is
    kept as ``predicted_kb_at_run``) and returns a table of every trial's error."""
    head = f"{'file':<26} {'config':<18} {'tokens':>7} {'peak GiB':>9} {'pred GiB':>9} {'err':>6}  phase"
    lines, worst = [head, "-" * len(head)], 0.0
    for path in paths:
        with open(path) as f:
            data = json.load(f)
        for name, r in data["results"].items():
            base = max(i["baseline_kb"] for i in r["ready"])
            for t in (t for t in r["trials"] if not t["over"] and not name.startswith("ds")):
                t.setdefault("predicted_kb_at_run", t["predicted_kb"])
                t["prediction"] = predict(data["model"], name, t["seq"], base)
                t["predicted_kb"] = t["prediction"]["total"] / 1024
                err = t["predicted_kb"] / t["peak_kb"] - 1
                worst = max(worst, abs(err))
                lines.append(f"{os.path.basename(path):<26} {name:<18} {t['seq']:>7} {t['peak_kb'] / 2**20:>9.2f} "
                             f"{t['predicted_kb'] / 2**20:>9.2f} {err:>+6.1%}  {t['prediction']['phase']}")
        with open(path, "w") as f:
            json.dump(data, f, indent=1)
    lines.append(f"largest error {worst:.1%} over {len(lines) - 2} trials")
    return "\n".join(lines)


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--reprice", nargs="+", metavar="JSON", default=None,
                    help="price the stored trials of these result files again with today's estimator, and stop")
    ap.add_argument("--quick", action="store_true", help="llama-7m, a 0.9 GiB cap, start 256")
    ap.add_argument("--model", default=None, choices=sorted(MODELS))
    ap.add_argument("--configs", default=",".join(CONFIGS))
    ap.add_argument("--cap-gib", type=float, default=None, help="per-rank RSS budget (default 2.0; quick 0.9)")
    ap.add_argument("--start", type=int, default=None, help="first global length (default 1024; quick 256)")
    ap.add_argument("--max-seq", type=int, default=1 << 17)
    ap.add_argument("--resolution", type=float, default=0.125)
    ap.add_argument("--timeout", type=float, default=1800.0, help="seconds per trial")
    ap.add_argument("--mmap-threshold", type=int, default=65536)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    if args.reprice:
        print(reprice(args.reprice))
        return 0
    args.model = args.model or ("llama-7m" if args.quick else "llama-106m")
    args.cap_gib = args.cap_gib or (0.9 if args.quick else 2.0)
    args.start = args.start or (256 if args.quick else 1024)
    os.environ["MALLOC_MMAP_THRESHOLD_"] = str(args.mmap_threshold)  # before the forkserver starts
    names = [n.strip() for n in args.configs.split(",") if n.strip()]
    unknown = [n for n in names if n not in CONFIGS]
    if unknown:
        ap.error(f"unknown configs {unknown}; choose from {sorted(CONFIGS)}")
    out = args.out or os.path.join(ROOT, "benchmarks", "results",
                                   "long_context-quick.json" if args.quick else "long_context.json")
    results: Dict[str, Dict[str, Any]] = {}
    for name in names:
        print(f"{name} ({CONFIGS[name]})", flush=True)
        results[name] = search(name, args, log=lambda s: print(s, flush=True))
        with open(out, "w") as f:
            json.dump({"model": args.model, "cap_gib": args.cap_gib, "results": results}, f, indent=1)
    ss, ds = results.get("ss-sp2-w2"), results.get("ds-sp2-w2")
    if ss and ds and ds["longest"] and not any(t["seq"] == ds["longest"] for t in ss["trials"]):
        print(f"ss-sp2-w2 at DeepSpeed's longest, {ds['longest']} tokens", flush=True)
        at = argparse.Namespace(**dict(vars(args), start=ds["longest"], max_seq=ds["longest"]))
        ss["trials"] += search("ss-sp2-w2", at, log=lambda s: print(s, flush=True))["trials"]
        with open(out, "w") as f:
            json.dump({"model": args.model, "cap_gib": args.cap_gib, "results": results}, f, indent=1)
    print(table(results, args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
