"""Issue 10: tensor parallelism. Per-rank parameter memory and bytes per step against the formulas, and
step time against DeepSpeed's AutoTP.

    python benchmarks/bench_tp.py            # GPT "small" (3.3M) at TP 1/2/4, Llama-style 4.5M vs DeepSpeed
    python benchmarks/bench_tp.py --quick    # smaller shapes, fewer steps

1. Memory: shardspeed.models.GPT at TP t (world t, data 1, ZeRO 0, fp32). Measured: the bytes of the
   parameters a rank holds. Formula: (Ψ_split / t + Ψ_replicated) × 4 bytes, where Ψ_split counts the
   split weights (q/k/v, the MLP's first layer and their biases, both output projections' weights, the
   token embedding = LM head) and Ψ_replicated the rest (position embedding, norms, output biases).
2. Bytes per step (the comms log, steps after two warm-up steps; b micro-batch, s sequence, h hidden, L
   layers, V vocabulary, 4-byte floats): without sequence parallelism all-reduces of b·s·h: 2 per block
   forward + 2 backward, one for the embedding (forward) and one into the head (backward): (4L + 2)·b·s·h,
   plus the vocabulary-parallel loss's 3 all-reduces of b·s floats (max, target logit, sum of
   exponentials) and the gradient norm's one float. With sequence parallelism the same messages become
   all-gathers (2 per block forward + 2 backward, the head's input forward) and reduce-scatters (2 per
   block forward + 2 backward, the embedding's forward, the head's backward), plus the position
   embedding's gradient all-gather of s·h (its forward only keeps this rank's rows), and all-reduces of
   the gradients of the replicated parameters used on sequence shards (norms, output biases). Counted
   by benchmarks/harness.CommCounter, which wraps torch.distributed (a one-rank data group sends nothing
   and is not counted); an all-gather or reduce-scatter counts its full (gathered) message.
3. Step time: world 2, a Llama-style model (HF LlamaForCausalLM), fp32 AdamW, ZeRO 0, median step of
   ``--steps`` after warm-up: shardspeed TP 2 against ``deepspeed.initialize`` with ``tensor_parallel.
   autotp_size: 2`` (DeepSpeed 0.19.8 AutoTP runs on CPU/gloo here), and TP 1 (plain data parallelism)
   for both. Timing on this shared 2-core box is noisy: compare within one run.
Writes benchmarks/results/bench_tp.json.
"""
from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import sys
import time
import traceback

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from benchmarks.harness import CommCounter, _free_port, init_gloo, worker_setup  # noqa: E402


def _gpt_config(quick: bool):
    from shardspeed.models.gpt import GPTConfig

    return GPTConfig.preset("tiny") if quick else GPTConfig.preset("small")


def _gpt_formula(cfg, t: int) -> dict:
    h, L, V, T = cfg.n_embd, cfg.n_layer, cfg.vocab_size, cfg.block_size
    split = L * (3 * h * h + 3 * h + h * h + 4 * h * h + 4 * h + 4 * h * h) + V * h
    replicated = T * h + L * (4 * h + 2 * h) + 2 * h
    return {"split": split, "replicated": replicated, "bytes": 4 * (split // t + replicated)}


def _theory_bytes(cfg, t: int, b: int, s: int, sp: bool) -> dict:
    h, L = cfg.n_embd, cfg.n_layer
    act = b * s * h * 4
    if t == 1:
        return {}
    if not sp:
        return {"all_reduce": (4 * L + 2) * act + 3 * b * s * 4 + 4}
    # replicated parameters used on sequence shards (norms, output biases): their gradients are summed
    sp_grads = ((4 * L + 2) * h + 2 * L * h) * 4
    return {"all_gather": (4 * L + 2) * act + s * h * 4, "reduce_scatter": (4 * L + 2) * act,
            "all_reduce": 3 * b * s * 4 + 4 + sp_grads}


def _memory_and_bytes(t: int, sp: bool, quick: bool, steps: int) -> dict:
    import torch

    import shardspeed
    from shardspeed.models.gpt import GPT

    cfg = _gpt_config(quick)
    torch.manual_seed(0)
    b, s = 4, cfg.block_size
    counter = CommCounter()  # counts what reaches torch.distributed (a group of 1 sends nothing)
    counter.install()
    engine, *_ = shardspeed.initialize(model=GPT(cfg), config={
        "train_micro_batch_size_per_gpu": b, "gradient_accumulation_steps": 1, "gradient_clipping": 1.0,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}}, "zero_optimization": {"stage": 0},
        "tensor_parallel": {"autotp_size": t, "sequence_parallel": sp}})
    held = sum(p.numel() * p.element_size() for p in engine.module.parameters())
    x = torch.randint(0, cfg.vocab_size, (b, s), generator=torch.Generator().manual_seed(1))
    for i in range(2 + steps):
        counter.active = i >= 2
        engine.backward(engine(x, x))
        engine.step()
    measured = {op: v["msg_bytes"] / steps for op, v in counter.totals.items()}
    return {"tp": t, "sp": sp, "param_bytes": held, "formula": _gpt_formula(cfg, t),
            "bytes_per_step": measured, "theory": _theory_bytes(cfg, t, b, s, sp)}


def _llama(quick: bool):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    h = 128 if quick else 256
    return LlamaForCausalLM(LlamaConfig(vocab_size=256, hidden_size=h, intermediate_size=int(2.75 * h),
                                        num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=4,
                                        max_position_embeddings=128, tie_word_embeddings=False))


def _step_time(system: str, t: int, quick: bool, steps: int) -> dict:
    import torch
    import torch.distributed as dist

    model = _llama(quick)
    world = dist.get_world_size()
    counter = CommCounter()
    counter.install()
    cfg = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 1, "gradient_clipping": 1.0,
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "torch_adam": True}},
           "zero_optimization": {"stage": 0}, "tensor_parallel": {"autotp_size": t}}
    if system == "deepspeed":
        import deepspeed

        engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    else:
        import shardspeed

        cfg["optimizer"]["params"].pop("torch_adam")
        engine, *_ = shardspeed.initialize(model=model, config=cfg)
    dp_rank = dist.get_rank() // t
    g = torch.Generator().manual_seed(1 + dp_rank)
    x = torch.randint(0, 256, (4, 128), generator=g)
    times = []
    for i in range(2 + steps):
        counter.active = False
        dist.barrier()
        counter.active = i >= 2
        t0 = time.perf_counter()
        loss = engine(input_ids=x, labels=x).loss
        engine.backward(loss)
        engine.step()
        if i >= 2:
            times.append(time.perf_counter() - t0)
    held = sum(p.numel() for p in engine.module.parameters())
    return {"system": system, "tp": t, "world": world, "median_s": statistics.median(times), "params_per_rank": held,
            "loss": float(loss), "bytes_per_step": {op: v["msg_bytes"] / steps for op, v in counter.totals.items()}}


def _worker(fn_name, args, rank, world, port, q):
    try:
        worker_setup(rank, world, port, threads=1)
        init_gloo(rank, world)
        out = globals()[fn_name](*args)
        q.put((rank, "ok", out))
    except BaseException:
        q.put((rank, "error", traceback.format_exc()))


def _run(fn_name: str, world: int, *args, timeout: float = 900):
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_worker, args=(fn_name, args, r, world, port, q), daemon=True) for r in range(world)]
    for p in procs:
        p.start()
    out = {}
    deadline = time.monotonic() + timeout
    while len(out) < world:
        rank, status, value = q.get(timeout=max(deadline - time.monotonic(), 1))
        if status != "ok":
            for p in procs:
                p.kill()
            raise RuntimeError(f"{fn_name}{args} rank {rank} failed:\n{value}")
        out[rank] = value
    for p in procs:
        p.join()
    return out[0]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--steps", type=int, default=None)
    ap.add_argument("--time-only", action="store_true", help="skip the memory and bytes part")
    ap.add_argument("--rounds", type=int, default=1, help="step-time rounds, the systems' order rotated each round")
    a = ap.parse_args()
    steps = a.steps or (3 if a.quick else 8)
    result: dict = {"memory_bytes": [], "step_time": []}
    print("== per-rank parameter memory and bytes per step (shardspeed.models.GPT, ZeRO 0, fp32) ==")
    for t, sp in () if a.time_only else ((1, False), (2, False), (4, False), (2, True), (4, True)):
        r = _run("_memory_and_bytes", t, t, sp, a.quick, steps)
        result["memory_bytes"].append(r)
        f = r["formula"]["bytes"]
        print(f"TP {t} sp={int(sp)}: params {r['param_bytes'] / 2**20:.3f} MiB/rank (formula {f / 2**20:.3f}, "
              f"ratio {r['param_bytes'] / f:.4f})")
        for op, want in r["theory"].items():
            got = r["bytes_per_step"].get(op, 0.0)
            print(f"    {op:<15} {got / 2**20:9.3f} MiB/step  theory {want / 2**20:9.3f}  ratio {got / want:.4f}")
        extra = set(r["bytes_per_step"]) - set(r["theory"])
        if extra and t > 1:
            print(f"    also logged: {sorted(extra)}")
    print("== step time, world 2, Llama-style model, ZeRO 0, fp32 ==")
    runs = [(system, t) for system in ("shardspeed", "deepspeed") for t in (1, 2)]
    for k in range(a.rounds):
        for system, t in runs[k % len(runs):] + runs[:k % len(runs)]:
            try:
                r = _run("_step_time", 2, system, t, a.quick, steps)
            except Exception as exc:  # say so rather than hide it
                r = {"system": system, "tp": t, "error": str(exc).splitlines()[-1]}
            r["round"] = k
            result["step_time"].append(r)
            if "error" in r:
                print(f"{system:<11} TP {t}: did not run: {r['error']}")
            else:
                mib = ", ".join(f"{op} {v / 2**20:.2f}" for op, v in sorted(r["bytes_per_step"].items()))
                print(f"{system:<11} TP {t}: {r['median_s'] * 1e3:8.1f} ms/step, {r['params_per_rank']} params/rank, "
                      f"loss {r['loss']:.4f}, MiB/step: {mib}")
    os.makedirs(os.path.join(ROOT, "benchmarks", "results"), exist_ok=True)
    name = "bench_tp-quick" if a.quick else "bench_tp-time" if a.time_only else "bench_tp"
    path = os.path.join(ROOT, "benchmarks", "results", name + ".json")
    with open(path, "w") as fh:
        json.dump(result, fh, indent=1)
    print("wrote", path)


if __name__ == "__main__":
    main()
