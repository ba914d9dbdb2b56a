"""Issue 6's GPU check: a ~1.3B-parameter GPT on one accelerator, plain torch vs FSDP2 vs shardspeed vs DeepSpeed.

    python benchmarks/gpu.py                    # on one GPU: gpt2-1.3b, bf16, micro-batch 8, seq 1024 (< 5 min on an H200)
    python benchmarks/gpu.py --dry-run          # anywhere: tiny preset on CPU, 2 timed steps, proves the script runs
    python benchmarks/gpu.py --systems torch,ss2,ss3

Model: ``shardspeed.models.gpt`` preset ``gpt2-1.3b`` (24 layers, hidden 2048, 16 heads, seq 1024, vocab
50257, tied LM head: 1.31B parameters), bf16, AdamW (lr 1e-4, wd 0.1), gradient clipping 1.0, random tokens.
Each system runs in its own fresh process (world 1: RANK=0, WORLD_SIZE=1; NCCL on CUDA), so the allocator
peak is that system's own and nothing is left over from the previous one:

- ``torch``    plain torch: fp32 parameters, ``torch.autocast(bfloat16)``, ``AdamW(fused=True)``
- ``fsdp2``    ``fully_shard`` per block and root, bf16 parameters, fp32 reduce (the anchor's FSDP2 setup)
- ``ss2``/``ss3``          shardspeed ZeRO stage 2 / 3, ``bf16: {enabled: true}`` (bf16 weights, fp32 master)
- ``ss2-off``/``ss3-off``  the same with ``offload_optimizer: {device: cpu}`` (ss3-off also asks ``offload_param``)
- ``ds2``/``ds3``/``ds2-off``/``ds3-off``  DeepSpeed with the same config, where ``import deepspeed`` works
- ``-c`` after a name (``fsdp2-c``, ``ss3-c``, ``ds3-c``, ``torch-c``): compiled with inductor: each block's
  forward (torch, FSDP2 before ``fully_shard``), shardspeed's and DeepSpeed's ``engine.compile()``;
  ``first_step_s`` (the first warm-up step) holds the compile time

Timing: ``--warmup`` untimed steps, then ``--steps`` steps each between two CUDA events (one sync at the end);
median s/step, tokens/s = micro-batch × seq / s, model TFLOP/s = ``GPT.flops_per_token(seq)`` × tokens/s /
1e12 (6·N·T plus attention 12·L·H·T per token, PaLM's convention; N without the position embedding),
peak allocator memory (``torch.cuda.max_memory_allocated``, after model build, so model states count).
Prints a table with ratios against the FSDP2 and DeepSpeed rows of the same run and against the anchor
figures (docs/benchmarks.md), and writes ``gpu.json`` under ``$OUT`` if set, else ``benchmarks/results/``.
A ``--budget-s`` (default 280) stops launching new systems when too little time is left.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from typing import List, Optional

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)

DEFAULT_SYSTEMS = ["torch", "fsdp2", "fsdp2-c", "ss2", "ss3", "ss3-c", "ss2-off", "ds2", "ds3", "ds3-c", "ds2-off",
                   "ss3-off", "ds3-off"]
LR, WD, CLIP = 1e-4, 0.1, 1.0

#: Figures to beat (one H200, same model and batch; /work/shared/reference/anchors.md): s/step, tokens/s,
#: TFLOP/s, peak GiB.
ANCHORS = {
    "fsdp2": (0.210, 39.1e3, 331.6, 42.1),
    "torch": (0.237, 34.6e3, 293.6, 54.9),
    "ds2": (0.253, 32.3e3, 274.3, 44.4),
    "ds3": (0.371, 22.1e3, 187.3, 47.8),
    "ds2-off": (0.899, 9.1e3, 77.3, 29.9),
    "ds3-off": (1.175, 7.0e3, 59.2, 30.1),
}


def ds_style_config(system: str, micro_batch: int, sub_group: int) -> dict:
    stage = int(system[2])
    zero: dict = {"stage": stage, "overlap_comm": True, "contiguous_gradients": True,
                  "reduce_bucket_size": int(5e8), "allgather_bucket_size": int(5e8)}
    if stage == 3:
        zero.update(stage3_prefetch_bucket_size=int(5e7), stage3_param_persistence_threshold=int(1e5))
    if system.endswith("-off"):
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": True}
        zero["sub_group_size"] = sub_group
        if stage == 3:
            zero["offload_param"] = {"device": "cpu", "pin_memory": True}
    return {"train_micro_batch_size_per_gpu": micro_batch, "gradient_accumulation_steps": 1,
            "gradient_clipping": CLIP, "bf16": {"enabled": True}, "zero_optimization": zero,
            "steps_per_print": 10**9, "wall_clock_breakdown": False}


# ---- one system, in its own process --------------------------------------------------------------------


def _child(args) -> dict:
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("LOCAL_RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    os.environ.setdefault("LOCAL_WORLD_SIZE", "1")
    if args.dry_run:
        os.environ["DS_ACCELERATOR"] = "cpu"
    import logging
    import warnings

    warnings.filterwarnings("ignore")
    logging.disable(logging.WARNING)
    import torch

    sys.path.insert(0, ROOT)
    import shardspeed
    from shardspeed.models.gpt import GPT, GPTConfig

    name = args.child
    compiled = name.endswith("-c")  # compiled with inductor
    system = name[:-2] if compiled else name
    cuda = torch.cuda.is_available() and not args.dry_run
    shardspeed.init_distributed()  # NCCL on CUDA, gloo on CPU; world 1
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(0)
        torch.backends.cuda.matmul.allow_tf32 = True
    cfg = GPTConfig.preset(args.preset)
    seq = cfg.block_size
    t_build = time.perf_counter()
    torch.manual_seed(0)
    with torch.device(device):  # initialise on the accelerator: seconds instead of a minute on the host
        model = GPT(cfg)
    n_params = model.num_params()
    if compiled and system in ("torch", "fsdp2"):  # each block's forward; FSDP2's hooks stay eager around it
        for blk in model.blocks:
            blk.forward = torch.compile(blk.forward, backend="inductor")
    flops_per_token = model.flops_per_token(seq)
    kernel = ""
    if system == "torch":
        opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WD, fused=True)
        kernel = "torch AdamW fused"

        def step(x, y):
            with torch.autocast(device.type, dtype=torch.bfloat16):
                loss = model(x, y)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
            opt.step()
            opt.zero_grad(set_to_none=True)
            return loss.detach()
    elif system == "fsdp2":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        mesh = init_device_mesh(device.type, (1,))
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        for blk in model.blocks:
            fully_shard(blk, mesh=mesh, mp_policy=mp)
        fully_shard(model, mesh=mesh, mp_policy=mp)
        opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WD, fused=True)
        kernel = "torch AdamW fused"

        def step(x, y):
            loss = model(x, y)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
            opt.step()
            opt.zero_grad(set_to_none=True)
            return loss.detach()
    elif system.startswith("ss"):
        config = ds_style_config(system, args.micro_batch, args.sub_group_size)
        config["optimizer"] = {"type": "AdamW", "params": {"lr": LR, "weight_decay": WD}}
        engine, *_ = shardspeed.initialize(model=model, config=config)
        if compiled:
            engine.compile(backend="inductor")
        kernel = "shardspeed host Adam (torch fused CPU kernel)" if system.endswith("-off") else "torch AdamW"

        def step(x, y):
            loss = engine(x, y)
            engine.backward(loss)
            engine.step()
            return loss.detach()
    elif system.startswith("ds"):
        try:
            import deepspeed
        except Exception as exc:
            return {"system": system, "status": "skipped", "message": f"DeepSpeed not importable: {type(exc).__name__}: {exc}"}
        logging.getLogger("DeepSpeed").setLevel(logging.ERROR)
        config = ds_style_config(system, args.micro_batch, args.sub_group_size)
        config["zero_allow_untested_optimizer"] = True
        opt = None
        if system.endswith("-off") and args.ds_cpu_adam:
            try:  # DeepSpeed's AVX CPU Adam (a JIT build at first use: minutes, outside the timed steps)
                from deepspeed.ops.adam import DeepSpeedCPUAdam

                opt = DeepSpeedCPUAdam(model.parameters(), lr=LR, weight_decay=WD, adamw_mode=True)
                kernel = "DeepSpeedCPUAdam"
            except Exception as exc:
                print(f"[{system}] DeepSpeedCPUAdam unavailable ({type(exc).__name__}); torch AdamW on the host",
                      file=sys.stderr)
        if opt is None:
            config["zero_force_ds_cpu_optimizer"] = False
            opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WD, fused=True)
            kernel = "torch AdamW fused" + (" (host)" if system.endswith("-off") else "")
        engine, *_ = deepspeed.initialize(model=model, optimizer=opt, config=config, dist_init_required=False)
        if compiled:
            engine.compile(backend="inductor")

        def step(x, y):
            loss = engine(x, y)
            engine.backward(loss)
            engine.step()
            return loss.detach()
    else:
        raise SystemExit(f"unknown system {system!r}")
    build_s = time.perf_counter() - t_build
    g = torch.Generator(device="cpu").manual_seed(1234)
    batches = []
    for _ in range(min(args.warmup + args.steps, 4)):
        data = torch.randint(0, cfg.vocab_size, (args.micro_batch, seq + 1), generator=g)
        batches.append((data[:, :-1].contiguous().to(device), data[:, 1:].contiguous().to(device)))
    first_step_s = None
    for i in range(args.warmup):
        t = time.perf_counter()
        float(step(*batches[i % len(batches)]))
        first_step_s = time.perf_counter() - t if first_step_s is None else first_step_s
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    losses, times = [], []
    if cuda:
        evs = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(args.steps)]
        for i in range(args.steps):
            evs[i][0].record()
            losses.append(step(*batches[(args.warmup + i) % len(batches)]))
            evs[i][1].record()
        torch.cuda.synchronize()
        times = [a.elapsed_time(b) / 1e3 for a, b in evs]
    else:
        for i in range(args.steps):
            t = time.perf_counter()
            losses.append(step(*batches[(args.warmup + i) % len(batches)]))
            float(losses[-1])
            times.append(time.perf_counter() - t)
    med = statistics.median(times)
    tokens = args.micro_batch * seq
    return {
        "system": name, "status": "ok", "first_step_s": first_step_s, "preset": args.preset, "params": n_params, "micro_batch": args.micro_batch,
        "seq": seq, "warmup": args.warmup, "timed_steps": args.steps, "optimizer_kernel": kernel,
        "build_s": round(build_s, 2), "s_per_step": med, "min_s_per_step": min(times), "max_s_per_step": max(times),
        "step_times": times, "tokens_per_s": tokens / med, "flops_per_token": flops_per_token,
        "tflops": flops_per_token * tokens / med / 1e12,
        "peak_gib": torch.cuda.max_memory_allocated() / 2**30 if cuda else None,
        "reserved_gib": torch.cuda.max_memory_reserved() / 2**30 if cuda else None,
        "losses": [float(v) for v in losses],
        "device": torch.cuda.get_device_name(0) if cuda else "cpu (dry run)",
        "torch": torch.__version__,
    }


# ---- the driver -----------------------------------------------------------------------------------------


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_system(system: str, args, timeout: float) -> dict:
    cmd = [sys.executable, os.path.abspath(__file__), "--child", system, "--preset", args.preset,
           "--micro-batch", str(args.micro_batch), "--warmup", str(args.warmup), "--steps", str(args.steps),
           "--sub-group-size", str(args.sub_group_size)] + (["--dry-run"] if args.dry_run else []) \
        + (["--ds-cpu-adam"] if args.ds_cpu_adam else [])
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()), RANK="0", WORLD_SIZE="1",
               LOCAL_RANK="0", LOCAL_WORLD_SIZE="1")
    t0 = time.time()
    try:
        p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout, cwd=ROOT)
    except subprocess.TimeoutExpired:
        return {"system": system, "status": "timeout", "message": f"no result within {timeout:.0f}s"}
    wall = time.time() - t0
    for line in reversed(p.stdout.splitlines()):
        if line.startswith("{"):
            r = json.loads(line)
            r["wall_s"] = round(wall, 1)
            return r
    tail = (p.stderr or p.stdout).strip().splitlines()
    return {"system": system, "status": "failed", "message": " | ".join(tail[-3:]) if tail else f"rc {p.returncode}",
            "wall_s": round(wall, 1)}


def _ratio(a: Optional[float], b: Optional[float]) -> Optional[float]:
    return a / b if a and b else None


def table(rows: List[dict], anchors: bool = True) -> str:
    by = {r["system"]: r for r in rows}
    f = lambda v, fmt="{:.2f}": fmt.format(v) if v is not None else "–"  # noqa: E731
    out = ["| system | s/step (median, min-max) | tokens/s | TFLOP/s | peak GiB | tok/s vs FSDP2 | vs DeepSpeed same | "
           "vs anchor | final loss | optimizer |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        s = r["system"]
        if r.get("status") != "ok":
            out.append(f"| {s} | {r.get('status')}: {r.get('message', '')[:160]} | | | | | | | | |")
            continue
        peer = "ds" + s[2:] if s.startswith("ss") else None
        fs = by.get("fsdp2-c" if s.endswith("-c") else "fsdp2", {})
        ds = by.get(peer, {}) if peer else {}
        anchor = (ANCHORS.get(s) or (ANCHORS.get(peer) if peer else None)) if anchors else None
        out.append(
            f"| {s} | {r['s_per_step']:.3f} ({r['min_s_per_step']:.3f}-{r['max_s_per_step']:.3f}) "
            f"| {r['tokens_per_s']:.0f} | {r['tflops']:.1f} | {f(r.get('peak_gib'), '{:.1f}')} "
            f"| {f(_ratio(r['tokens_per_s'], fs.get('tokens_per_s') if fs.get('status') == 'ok' else None))} "
            f"| {f(_ratio(r['tokens_per_s'], ds.get('tokens_per_s') if ds.get('status') == 'ok' else None))} "
            f"| {f(_ratio(r['tokens_per_s'], anchor[1] if anchor else None))} "
            f"| {r['losses'][-1]:.4f} | {r['optimizer_kernel']} |")
    return "\n".join(out)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dry-run", action="store_true", help="tiny preset on CPU, 1 warm-up + 2 timed steps")
    ap.add_argument("--systems", default=",".join(DEFAULT_SYSTEMS))
    ap.add_argument("--preset", default="gpt2-1.3b")
    ap.add_argument("--micro-batch", type=int, default=8)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--sub-group-size", type=int, default=int(1e8), help="offload tile / DeepSpeed sub-group (elements)")
    ap.add_argument("--ds-cpu-adam", action="store_true",
                    help="DeepSpeed offload with DeepSpeedCPUAdam (JIT-built at first use) instead of torch's AdamW")
    ap.add_argument("--budget-s", type=float, default=280.0, help="launch no new system after this many seconds")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.dry_run:
        args.preset, args.micro_batch, args.warmup, args.steps = "tiny", 2, 1, 2
    if args.child:
        try:
            r = _child(args)
        except Exception as exc:  # one line the driver can show
            import traceback

            traceback.print_exc()
            r = {"system": args.child, "status": "failed", "message": f"{type(exc).__name__}: {exc}"}
        print(json.dumps(r, default=float), flush=True)
        return 0
    import torch

    if not args.dry_run and not torch.cuda.is_available():
        print("no CUDA device here: run with --dry-run to check the script on CPU", file=sys.stderr)
        return 2
    t0 = time.time()
    rows = []
    for s in [s for s in args.systems.split(",") if s]:
        left = args.budget_s - (time.time() - t0)
        if left < (60 if s.endswith("-off") else 35) and not args.dry_run:
            rows.append({"system": s, "status": "skipped", "message": f"time budget ({args.budget_s:.0f}s) spent"})
            print(f"{s}: skipped (budget)", flush=True)
            continue
        r = run_system(s, args, timeout=max(left, 30) if not args.dry_run else 600)
        rows.append(r)
        if r.get("status") == "ok":
            print(f"{s}: {r['s_per_step']:.3f} s/step, {r['tokens_per_s']:.0f} tokens/s, {r['tflops']:.1f} TFLOP/s, "
                  f"peak {r['peak_gib'] if r['peak_gib'] is None else round(r['peak_gib'], 1)} GiB, "
                  f"loss {r['losses'][-1]:.4f} ({r['wall_s']}s)", flush=True)
        else:
            print(f"{s}: {r['status']}: {r.get('message', '')}", flush=True)
    text = table(rows, anchors=not args.dry_run)  # the anchors are 1.3B-on-H200 figures
    print(text)
    meta = {"command": "python benchmarks/gpu.py " + " ".join(argv if argv is not None else sys.argv[1:]),
            "date": time.strftime("%Y-%m-%d %H:%M"), "wall_s": round(time.time() - t0, 1), "dry_run": args.dry_run,
            "torch": torch.__version__, "anchors": ANCHORS}
    out_dir = os.environ.get("OUT") or os.path.join(HERE, "results")
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, "gpu-dry-run.json" if args.dry_run else "gpu.json")
    with open(path, "w") as f:
        json.dump({"meta": meta, "results": rows}, f, indent=1, default=float)
    with open(path[:-5] + ".md", "w") as f:
        f.write(text + "\n")
    print("wrote", path)
    return 0 if all(r.get("status") in ("ok", "skipped") for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
