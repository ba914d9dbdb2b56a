"""Issue 40: Muon against AdamW at ZeRO 1-3: step time (paired), bytes per step against theory, Newton-Schulz time.

    python benchmarks/bench_muon.py [--preset small] [--stages 1,2,3] [--steps 6] [--pairs 3] [--tp 1] [--offload cpu]

World 2, gloo, fp32, the GPT of ``shardspeed.models`` (``small``: 4 x 256, 3.3M parameters; DeepSpeed's routing
puts the block matrices and the position table ``wpe`` on Muon, ``wte``/``lm_head``, norms and biases on AdamW).
Each pair builds an AdamW engine and a Muon engine in turn (the same model, data and stage), runs 2 warm-up steps,
then times ``--steps`` steps; the median over the steps of all pairs is reported per optimizer, with their ratio.

Bytes per step per rank: every collective's message bytes (the comms logger's totals after warm-up, divided by
the steps). Muon's theory: AdamW's bytes plus ``4 x (sent_elements(rank) + tp_sent_elements())`` (the exchange's
count from the layout: the pieces of the matrices this rank does not own that it sends to their owners, and the
pieces of its own matrices' results it sends back; with ``--tp 2``, the slices each rank sends to the model rank
that orthogonalises the full matrix and the slices of the results sent back), plus the 4-byte all-reduce of the
update norm (DeepSpeed's gradient norm over the orthogonalised updates; 4 more under TP, over the model group),
below the table's precision. ``ns ms`` is the Newton-Schulz time per step on the rank (each matrix once in
the job). JSON: benchmarks/results/muon.json.
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys
import time
from typing import Any, Dict, List

import torch
import torch.multiprocessing as mp

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

OPTIMIZERS = {"adamw": {"type": "AdamW", "params": {"lr": 1e-3}},
              "muon": {"type": "Muon", "params": {"lr": 0.02, "adam_lr": 1e-3}}}


def _engine(preset: str, stage: int, opt: str, tp: int, offload: str = "none"):
    import tempfile

    import shardspeed
    from shardspeed.models.gpt import GPT, GPTConfig

    torch.manual_seed(0)
    model = GPT(GPTConfig.preset(preset))
    zero: Dict[str, Any] = {"stage": stage}
    if offload != "none":
        zero["offload_optimizer"] = {"device": offload, "nvme_path": tempfile.gettempdir()}
    cfg = {"train_micro_batch_size_per_gpu": 4, "gradient_clipping": 1.0, "zero_optimization": zero,
           "optimizer": OPTIMIZERS[opt]}
    if tp > 1:
        cfg["tensor_parallel"] = {"autotp_size": tp}
    engine, *_ = shardspeed.initialize(model=model, config=cfg, model_parameters=model.parameters())
    return engine


def _run(engine, batches: List[torch.Tensor], steps: int) -> List[float]:
    times = []
    for i, idx in enumerate(batches):
        if i == 2:
            engine.comms_logger.reset()
        t0 = time.perf_counter()
        loss = engine(idx, idx)
        engine.backward(loss)
        engine.step()
        if i >= 2:
            times.append(time.perf_counter() - t0)
    return times[:steps]


def _worker(rank: int, port: int, args: argparse.Namespace, out: Any) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE="2",
                      LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE="2")
    torch.set_num_threads(1)
    from shardspeed.mesh import init_distributed
    from shardspeed.models.gpt import GPTConfig

    init_distributed(backend="gloo")
    seq = GPTConfig.preset(args.preset).block_size
    g = torch.Generator().manual_seed(1 + rank // args.tp)  # a model group's ranks take the same batch
    batches = [torch.randint(0, 256, (4, seq), generator=g) for _ in range(args.steps + 2)]
    rows: Dict[str, Dict[str, Any]] = {}
    for stage in args.stages:
        times: Dict[str, List[float]] = {"adamw": [], "muon": []}
        for _ in range(args.pairs):
            for opt in ("adamw", "muon"):
                engine = _engine(args.preset, stage, opt, args.tp, args.offload)
                times[opt] += _run(engine, batches, args.steps)
                msg = sum(s["msg_bytes"] for s in engine.comms_logger.summary().values()) / args.steps
                rows[f"{opt}{stage}"] = {"bytes_per_step": msg, "step_s": statistics.median(times[opt])}
                if opt == "muon":
                    ex = engine.optimizer.router
                    rows[f"muon{stage}"].update(sent_elements=ex.sent_elements(ex.rank) + ex.tp_sent_elements(),
                                                ns_ms=1e3 * ex.ns_seconds / max(ex.steps, 1),
                                                matrices=len(ex.matrices), owned=ex.orthogonalised_here(),
                                                muon_elements=sum(m.numel for m in ex.matrices))
                engine.destroy() if hasattr(engine, "destroy") else None
    out.put((rank, rows))


def _table(per_rank: Dict[int, Dict[str, Dict[str, Any]]], stages: List[int]) -> str:
    lines = ["| stage | rank | AdamW ms | Muon ms | Muon/AdamW | AdamW MB/step | Muon MB/step | extra MB | theory "
             "extra MB | matrices owned | ns ms/step |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for stage in stages:
        for rank, rows in sorted(per_rank.items()):
            a, m = rows[f"adamw{stage}"], rows[f"muon{stage}"]
            extra, theory = m["bytes_per_step"] - a["bytes_per_step"], 4 * m["sent_elements"]
            lines.append(f"| {stage} | {rank} | {a['step_s'] * 1e3:.1f} | {m['step_s'] * 1e3:.1f} | "
                         f"{m['step_s'] / a['step_s']:.3f} | {a['bytes_per_step'] / 1e6:.3f} | "
                         f"{m['bytes_per_step'] / 1e6:.3f} | {extra / 1e6:.4f} | {theory / 1e6:.4f} | "
                         f"{m['owned']}/{m['matrices']} | {m['ns_ms']:.1f} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--preset", default="small")
    ap.add_argument("--stages", default="1,2,3", type=lambda s: [int(x) for x in s.split(",")])
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--pairs", type=int, default=3)
    ap.add_argument("--tp", type=int, default=1, help="tensor-parallel size (1 or 2; world 2)")
    ap.add_argument("--offload", default="none", choices=("none", "cpu", "nvme"),
                    help="offload_optimizer device for both optimizers (Muon: the host step, or two passes over "
                         "the NVMe tiles)")
    args = ap.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=_worker, args=(r, port, args, out)) for r in range(2)]
    for p in procs:
        p.start()
    per_rank = dict(out.get() for _ in procs)
    for p in procs:
        p.join()
    print(_table(per_rank, args.stages))
    os.makedirs(os.path.join(ROOT, "benchmarks", "results"), exist_ok=True)
    name = "muon" + (f"_tp{args.tp}" if args.tp > 1 else "") + (f"_{args.offload}" if args.offload != "none" else "")
    with open(os.path.join(ROOT, "benchmarks", "results", name + ".json"), "w") as f:
        json.dump({"preset": args.preset, "steps": args.steps, "pairs": args.pairs, "tp": args.tp,
                   "offload": args.offload, "ranks": per_rank}, f, indent=1)


if __name__ == "__main__":
    main()
