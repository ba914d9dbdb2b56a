"""Issue 24: mixture of experts. Tokens/s against DeepSpeed's MoE, peak RSS per rank against the formula as EP
grows, and all-to-all bytes per step against theory.

    python benchmarks/bench_moe.py              # 12 MoE layers x 8 experts, d 256 (51M parameters), world 4
    python benchmarks/bench_moe.py --quick      # 2 layers, fewer steps (a smoke run)

The model: ``layers`` residual blocks ``x + MoE(LayerNorm(x))``, each MoE of ``experts`` MLPs d -> 4d -> d (top-1,
capacity factor 1, DeepSpeed's defaults otherwise), then a linear head and an MSE loss; fp32, AdamW (torch's),
ZeRO stage 2 (DeepSpeed's MoE runs at ZeRO 0-2 here). World 4: shardspeed at EP 1, 2 and 4 (EP x DP = 4), DeepSpeed
at EP 1 and 2 (its CPU build trains MoE at EP 1-2), and shardspeed at EP 2 with the exchange overlapped with the
experts in 2 capacity chunks (off by default on gloo). Every system's 4 ranks are fresh processes, all alive at once;
the coordinator runs a block of steps of one system at a time, rotating the order each round (so the load of
this shared box hits all alike); tokens/s is the global tokens of a step over its median time, ratios from the
same rounds.

Peak RSS: each rank's VmHWM minus its resident size before the model was built (MALLOC_MMAP_THRESHOLD_ fixed);
the formula is the model states of :func:`shardspeed.estimate.experts.moe_model_states` (dense parameters over
data x expert, experts / EP over the expert-data group), activations and buffers excluded. All-to-all: message
bytes per step counted at torch.distributed (benchmarks/harness.CommCounter; the full buffer of each call)
against :func:`~shardspeed.estimate.experts.capacity_all_to_all` (4 calls of experts x capacity x d per layer;
(EP-1)/EP of each leaves the rank). Figures on this 2-core box are taken under load from other jobs.
Writes benchmarks/results/bench_moe.json.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import traceback

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", "65536")
from benchmarks.harness import (  # noqa: E402
    CommCounter,
    _ctx,
    _free_port,
    init_gloo,
    next_result,
    proc_status_kb,
    reset_peak_rss,
    worker_setup,
)

WORLD = 4


def _model(moe_cls, layers: int, d: int, experts: int, ep: int):
    import torch
    import torch.nn as nn
    import torch.nn.functional as F

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.norm = nn.LayerNorm(d)
            expert = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))
            self.moe = moe_cls(d, expert, num_experts=experts, ep_size=ep, k=1, min_capacity=4)

        def forward(self, x):
            h, l_aux, _ = self.moe(self.norm(x))
            return x + h, l_aux

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.blocks = nn.ModuleList(Block() for _ in range(layers))
            self.head = nn.Linear(d, d)

        def forward(self, x, y):
            aux = 0.0
            for b in self.blocks:
                x, l_aux = b(x)
                aux = aux + l_aux
            return F.mse_loss(self.head(x), y) + 0.01 * aux

    torch.manual_seed(0)
    return Net()


def _config(micro: int):
    return {"train_micro_batch_size_per_gpu": micro, "gradient_accumulation_steps": 1,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "weight_decay": 0.0, "torch_adam": True}},
            "zero_optimization": {"stage": 2, "reduce_bucket_size": 5e7}, "steps_per_print": 10**9}


def _worker(system: str, ep: int, shape: dict, rank: int, port: int, cmd_q, res_q):
    try:
        worker_setup(rank, WORLD, port, threads=1)
        import torch
        import torch.distributed as dist

        counter = CommCounter()
        counter.install()
        init_gloo(rank, WORLD)
        if system == "deepspeed":
            import deepspeed
            from deepspeed.moe.layer import MoE
            from deepspeed.moe.utils import split_params_into_different_moe_groups_for_optimizer as split

            deepspeed.init_distributed(dist_backend="gloo")
            initialize = deepspeed.initialize
        else:
            import shardspeed
            from shardspeed.moe.layer import MoE
            from shardspeed.moe.utils import split_params_into_different_moe_groups_for_optimizer as split

            initialize = shardspeed.initialize
        reset_peak_rss()
        before = proc_status_kb("VmRSS")
        net = _model(MoE, shape["layers"], shape["d"], shape["experts"], ep)
        if system == "shardspeed-overlap":  # the exchange in 2 capacity chunks overlapped with the experts
            for m in net.modules():
                if hasattr(m, "overlap_chunks"):
                    m.overlap_chunks = 2
        total = sum(p.numel() for p in net.parameters())
        engine, *_ = initialize(model=net, config=_config(shape["micro"]),
                                model_parameters=split({"params": list(net.parameters()), "name": "dense"}))
        g = torch.Generator().manual_seed(rank)
        x = torch.randn(shape["micro"], shape["seq"], shape["d"], generator=g)
        y = torch.randn(shape["micro"], shape["seq"], shape["d"], generator=g)
        res_q.put((rank, "ready", {"params_built": total}))
        while True:
            cmd = cmd_q.get()
            if cmd[0] == "exit":
                return
            if cmd[0] == "run":
                counter.reset()
                counter.active = cmd[2]
                times = []
                for _ in range(cmd[1]):
                    dist.barrier()
                    t0 = time.perf_counter()
                    loss = engine(x, y)
                    engine.backward(loss)
                    engine.step()
                    times.append(time.perf_counter() - t0)
                counter.active = False
                a2a = counter.totals.get("all_to_all", {"count": 0, "msg_bytes": 0.0})
                res_q.put((rank, "times", {"times": times, "a2a_bytes": a2a["msg_bytes"] / max(1, cmd[1]),
                                           "a2a_calls": a2a["count"] / max(1, cmd[1])}))
            if cmd[0] == "memory":
                res_q.put((rank, "memory", {"peak_delta": (proc_status_kb("VmHWM") - before) * 1024}))
    except BaseException:
        res_q.put((rank, "error", traceback.format_exc()))


class Group:
    """One system's 4 ranks, alive for the whole run."""

    def __init__(self, system: str, ep: int, shape: dict):
        ctx = _ctx()
        self.name = f"{system}@ep{ep}"
        self.system, self.ep = system, ep
        self.res_q, port = ctx.Queue(), _free_port()
        self.cmd_qs = [ctx.Queue() for _ in range(WORLD)]
        self.procs = [ctx.Process(target=_worker, daemon=True,
                                  args=(system, ep, shape, r, port, self.cmd_qs[r], self.res_q))
                      for r in range(WORLD)]
        for p in self.procs:
            p.start()

    def collect(self, kind: str, timeout: float = 1800):
        deadline, out = time.monotonic() + timeout, {}
        while len(out) < WORLD:
            rank, got, payload = next_result(self.res_q, self.procs, self.name, deadline)
            assert got == kind, (got, kind)
            out[rank] = payload
        return [out[r] for r in range(WORLD)]

    def send(self, *cmd):
        for q in self.cmd_qs:
            q.put(cmd)

    def close(self):
        self.send("exit")
        for p in self.procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()


def _formulas(shape: dict, total: int, ep: int) -> dict:
    from shardspeed.estimate.experts import capacity_all_to_all, moe_model_states
    from shardspeed.plan import ModelFacts, decide

    d, e, L = shape["d"], shape["experts"], shape["layers"]
    expert_total = L * e * (2 * 4 * d * d + 5 * d)
    dense = total - expert_total // ep  # the built model holds this rank's experts only
    plan = decide(_config(shape["micro"]), WORLD, ModelFacts(ep_size=ep))
    states = moe_model_states(plan, dense, expert_total).total
    tokens = shape["micro"] * shape["seq"]
    a2a = capacity_all_to_all(tokens, d, e, ep, k=1, dtype_bytes=4, layers=L)
    buffer_msgs = a2a.per_step / ((ep - 1) / ep) if ep > 1 else 0.0  # message bytes: whole buffers
    return {"states_bytes": states, "a2a_msg_bytes": buffer_msgs, "a2a_sent_bytes": a2a.per_step}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=2, help="steps per block (after one warm-up block)")
    args = ap.parse_args(argv)
    shape = dict(layers=2 if args.quick else 12, d=256, experts=8, micro=2, seq=32)
    systems = [("shardspeed", 1), ("shardspeed", 2), ("shardspeed", 4), ("shardspeed-overlap", 2), ("deepspeed", 1),
               ("deepspeed", 2)]
    groups = [Group(s, ep, shape) for s, ep in systems]
    built = {g.name: g.collect("ready")[0]["params_built"] for g in groups}
    times = {g.name: [] for g in groups}
    a2a = {}
    for rnd in range(args.rounds + 1):
        order = groups[rnd % len(groups):] + groups[:rnd % len(groups)]
        for g in order:
            g.send("run", args.steps, rnd == 1)
            out = g.collect("times")
            if rnd > 0:
                times[g.name] += [max(o["times"][i] for o in out) for i in range(args.steps)]
            if rnd == 1:
                a2a[g.name] = (out[0]["a2a_bytes"], out[0]["a2a_calls"])
    rows = []
    tokens = WORLD * shape["micro"] * shape["seq"]
    for g in groups:
        g.send("memory")
        mem = g.collect("memory")
        g.close()
        f = _formulas(shape, built[g.name], g.ep)
        med = statistics.median(times[g.name])
        rows.append({"system": g.name, "params": built[g.name], "step_s": med, "tokens_per_s": tokens / med,
                     "peak_rss_delta_mib": max(m["peak_delta"] for m in mem) / 2**20,
                     "states_formula_mib": f["states_bytes"] / 2**20, "a2a_msg_bytes": a2a[g.name][0],
                     "a2a_calls": a2a[g.name][1], "a2a_theory_msg_bytes": f["a2a_msg_bytes"],
                     "a2a_theory_sent_bytes": f["a2a_sent_bytes"]})
    by = {r["system"]: r for r in rows}
    for name, ep in (("shardspeed", 1), ("shardspeed", 2), ("shardspeed-overlap", 2)):
        by[f"{name}@ep{ep}"]["vs_deepspeed"] = by[f"deepspeed@ep{ep}"]["step_s"] / by[f"{name}@ep{ep}"]["step_s"]
    print(f"{'system':22} {'params':>10} {'step s':>8} {'tok/s':>8} {'vs DS':>6} {'RSS MiB':>8} {'formula':>8} "
          f"{'a2a B/step':>12} {'theory':>12}")
    for r in rows:
        print(f"{r['system']:22} {r['params']:>10} {r['step_s']:>8.3f} {r['tokens_per_s']:>8.1f} "
              f"{r.get('vs_deepspeed', float('nan')):>6.2f} {r['peak_rss_delta_mib']:>8.1f} "
              f"{r['states_formula_mib']:>8.1f} {r['a2a_msg_bytes']:>12.0f} {r['a2a_theory_msg_bytes']:>12.0f}")
    out = os.path.join(ROOT, "benchmarks", "results", "bench_moe" + ("-quick" if args.quick else "") + ".json")
    with open(out, "w") as fh:
        json.dump({"shape": shape, "world": WORLD, "rounds": args.rounds, "steps": args.steps, "rows": rows}, fh,
                  indent=2)
    print("wrote", out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
