"""Issue 25: ZeRO++ (qwZ, qgZ, hpZ) beside plain stage 3 and DeepSpeed's plain stage 3, in one interleaved run.

    python benchmarks/bench_zeropp.py                       # the suite's GPT (23M), world 4, fp32: ~6 min here
    python benchmarks/bench_zeropp.py --dtype bf16 --tag zeropp_bf16
    python benchmarks/bench_zeropp.py --world 2 --systems ss3,ss3-qw-qg,ds3 --blocks 2   # quicker

Systems (``benchmarks/systems.py``, the suite's config: 2M-element buckets, AdamW, clipping 1.0): ``ss3``
(plain), ``ss3-qw`` (qwZ int8 weight gathers), ``ss3-qg`` (qgZ int8 gradients), ``ss3-qw-qg``, ``ss3-qw-qg4``
(int4 gradients), ``ss3-hpz2`` (hpZ over pairs of ranks), ``ss3-qw-qg-hpz2``, and ``ds3``: DeepSpeed's stage 3
(its ZeRO++ quantizers are CUDA kernels, so only its plain stage 3 runs on this box). Each system runs in its own
group of gloo workers; timed blocks rotate between them (``benchmarks/harness.run_interleaved``).

Reported per system: median step time and its ratio to ``ss3`` and ``ds3`` of the same run; bytes per step
handed to ``torch.distributed`` (shardspeed's comms log, which logs each coded collective with its real bytes;
DeepSpeed: a counter wrapped around ``torch.distributed``, a lower bound at stage 3) and their ratio to ``ss3``;
backward gathers inside the node (hpZ); the final loss of the same data. Then the codec's cost measured on this
CPU (encode + decode of one step's volumes), and the modelled step communication on a real network: the
measured bytes per parameter scaled to a 1.3B GPT on 8 nodes x 8 H200 with 400 Gb/s per GPU across nodes (hpZ's
backward gathers inside a node ride NVLink, 900 GB/s). JSON: ``benchmarks/results/<tag>.json`` (default
``zeropp``).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

SYSTEMS = "ss3,ss3-qw,ss3-qg,ss3-qw-qg,ss3-qw-qg4,ss3-hpz2,ss3-qw-qg-hpz2,ds3"
INTER_NODE_GB_S = 50.0  # 400 Gb/s per GPU
INTRA_NODE_GB_S = 900.0  # NVLink on H200
MODEL_PSI = 1.31e9  # shardspeed.models.gpt preset gpt2-1.3b


def codec_cost(psi: int, world: int, flags: set, dtype) -> float:
    """Seconds per step this CPU spends coding one rank's share: weights encoded (own shard) and decoded (whole
    unit) for the forward and backward gathers, gradients encoded (whole bucket) and decoded (world rows of
    this rank's chunk)."""
    import torch

    from shardspeed.comm.quantize import BlockCodec

    x = torch.randn(1, psi).to(dtype)
    out = torch.empty(1, psi, dtype=dtype)
    shard = x[:, : psi // world].contiguous()
    w, g = BlockCodec(8, 256), BlockCodec(4 if "qg4" in flags else 8, 256)
    w_codes, g_codes = w.encode(x), g.encode(x.float())
    acc = torch.zeros(1, psi // world)

    def once() -> None:
        if "qw" in flags:
            for _ in range(2):  # the forward's and the backward's gathers
                w.encode(shard)
                w.decode(*w_codes, out)
        if flags & {"qg", "qg4"}:
            g.encode(x.float())
            for _ in range(world):  # this rank's chunk from every rank, summed
                g.decode(g_codes[0][:, : g.code_bytes(psi // world)], g_codes[1][:, : g.blocks(psi // world)],
                         acc, accumulate=True)

    once()  # warm-up
    times = []
    for _ in range(3):
        t0 = time.perf_counter()
        once()
        times.append(time.perf_counter() - t0)
    return min(times)


def modelled_comm(bytes_per_psi: float, backward_gather_share: float, hpz: bool) -> float:
    """Seconds of communication per step for the 1.3B GPT on 64 GPUs: bytes per parameter × Ψ; with hpZ the
    backward gathers (their share of the bytes) go over NVLink."""
    total = bytes_per_psi * MODEL_PSI
    inside = total * backward_gather_share if hpz else 0.0
    return (total - inside) / (INTER_NODE_GB_S * 1e9) + inside / (INTRA_NODE_GB_S * 1e9)


def table(results: dict, world: int, dtype: str) -> str:
    ss3, ds3 = results.get("ss3", {}), results.get("ds3", {})
    rows = ["| system | step s | vs ss3 | vs ds3 | bytes/step MB | bytes vs ss3 | final loss | codec CPU s/step "
            "| modelled comm s/step (1.3B, 64 H200) |", "|---|---|---|---|---|---|---|---|---|"]
    base_bytes = sum(ss3.get("comm_bytes_per_step", {}).values()) or 1.0
    for name, r in results.items():
        if r.get("status") != "ok":
            rows.append(f"| {name} | {r.get('status')}: {r.get('message', '')} |||||||")
            continue
        b = sum(r["comm_bytes_per_step"].values())
        flags = set(name.split("-")[1:])
        per_psi = b / r["params"]
        gather = r["comm_bytes_per_step"].get("all_gather", 0) + r["comm_bytes_per_step"].get("broadcast", 0)
        model = modelled_comm(per_psi, 0.5 * gather / b if b else 0.0, any(f.startswith("hpz") for f in flags))
        step = r["median_step_s"]
        vs_ds = f"{step / ds3['median_step_s']:.2f}×" if ds3.get("status") == "ok" else "–"
        rows.append(f"| {name} | {step:.3f} | {step / ss3['median_step_s']:.2f}× | {vs_ds} | {b / 1e6:.1f} | "
                    f"{b / base_bytes:.2f}× | {r['final_loss']:.4f} | {r.get('codec_cpu_s', 0.0):.3f} | {model:.3f} |")
    return "\n".join(rows)


def main(argv=None) -> int:
    import torch

    from benchmarks.harness import run_interleaved

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--systems", default=SYSTEMS)
    ap.add_argument("--model", default="gpt")
    ap.add_argument("--dtype", default="fp32", choices=["fp32", "bf16"])
    ap.add_argument("--world", type=int, default=4)
    ap.add_argument("--blocks", type=int, default=3)
    ap.add_argument("--steps-per-block", type=int, default=3)
    ap.add_argument("--tag", default="zeropp")
    args = ap.parse_args(argv)
    systems = args.systems.split(",")
    t0 = time.time()
    load = os.getloadavg()
    results = run_interleaved(systems, args.model, dtype=args.dtype, world=args.world, warmup=2,
                              blocks=args.blocks, steps_per_block=args.steps_per_block)
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    for name, r in results.items():
        if r.get("status") == "ok" and name.startswith("ss"):
            r["codec_cpu_s"] = codec_cost(r["params"], args.world, set(name.split("-")[1:]), dtype)
    text = table(results, args.world, args.dtype)
    print(text)
    meta = {"command": "python benchmarks/bench_zeropp.py " + " ".join(argv if argv is not None else sys.argv[1:]),
            "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "load_average_at_start": load,
            "world": args.world, "dtype": args.dtype, "wall_s": time.time() - t0,
            "network_model": {"inter_node_GB_s": INTER_NODE_GB_S, "intra_node_GB_s": INTRA_NODE_GB_S,
                              "psi": MODEL_PSI}}
    os.makedirs(os.path.join(ROOT, "benchmarks", "results"), exist_ok=True)
    with open(os.path.join(ROOT, "benchmarks", "results", f"{args.tag}.json"), "w") as f:
        json.dump({"meta": meta, "table": text, "results": results}, f, indent=1, default=str)
    return 0


if __name__ == "__main__":
    sys.exit(main())
