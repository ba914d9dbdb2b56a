"""Issue 40: the bytes Muon adds over AdamW per step, shardspeed beside DeepSpeed 0.19.8, counted at torch.distributed.

    python benchmarks/bench_muon_bytes.py [--preset small] [--stages 1,2,3] [--steps 3]

World 2, gloo, fp32, the GPT of ``shardspeed.models``, clipping 1.0, each system run by its own ``initialize``
(DeepSpeed with ``DS_ACCELERATOR=cpu``, its Muon step not compiled; stage 3 with ``reduce_scatter: false``,
which DeepSpeed needs with Muon, for both optimizers). Each collective of ``torch.distributed`` is wrapped in the
worker (before the process group starts: DeepSpeed's backend keeps the functions it finds) and each call counts
the bytes this rank puts on the wire under the ring model (exact at world 2): ``all_reduce`` ``2 (n-1)/n`` of the
tensor, reduce-scatters ``(n-1)/n`` of the input, all-gathers ``(n-1)`` times the input, ``broadcast`` the
tensor on its source only, ``all_to_all_single`` the input less this rank's own split, ``send`` the tensor
(torch's deprecated names call the new ones: the outermost call counts). The two systems reach
torch.distributed by other routes (shardspeed's gloo all-gathers run as broadcasts, DeepSpeed all-reduces a
bucket holding a matrix split over ranks where it would reduce-scatter it), so the table compares each system's
Muon with its own AdamW, and the totals. Per rank, per step after 2 warm-up steps. JSON:
benchmarks/results/muon_bytes.json.
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import sys
from typing import Any, Callable, Dict, List

import torch
import torch.multiprocessing as mp

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

OPTIMIZERS = {"adamw": {"type": "AdamW", "params": {"lr": 1e-3}},
              "muon": {"type": "Muon", "params": {"lr": 0.02, "adam_lr": 1e-3}}}
#: name -> the argument (keyword, position) holding what this rank sends, and the group's position
_SENDS = {"all_reduce": "tensor", "broadcast": "tensor", "all_gather_into_tensor": "input_tensor",
          "reduce_scatter_tensor": "input", "all_to_all_single": "input", "all_gather": "tensor",
          "reduce_scatter": "input_list", "send": "tensor", "isend": "tensor", "all_gather_single": "input_tensor",
          "reduce_scatter_single": "input"}
_POSITION = {"all_reduce": 0, "broadcast": 0, "all_gather_into_tensor": 1, "reduce_scatter_tensor": 1,
             "all_to_all_single": 1, "all_gather": 1, "reduce_scatter": 1, "send": 0, "isend": 0,
             "all_gather_single": 1, "reduce_scatter_single": 1}
_GROUP = {"all_reduce": 2, "broadcast": 2, "all_gather_into_tensor": 2, "reduce_scatter_tensor": 3,
          "all_to_all_single": 4, "all_gather": 2, "reduce_scatter": 3, "send": 2, "isend": 2,
          "all_gather_single": 2, "reduce_scatter_single": 3}


def _nbytes(x: Any) -> int:
    if torch.is_tensor(x):
        return x.numel() * x.element_size()
    if isinstance(x, (list, tuple)):
        return sum(_nbytes(t) for t in x)
    return 0


def _count_collectives(counter: Dict[str, float]) -> None:
    """Wrap torch.distributed's collectives so that each call adds the bytes this rank sends (the ring model of
    the module doc) to ``counter[name]``."""
    import torch.distributed as dist

    depth = [0]

    def arg(args: Any, kwargs: Any, key: str, pos: int) -> Any:
        return kwargs[key] if key in kwargs else (args[pos] if len(args) > pos else None)

    def wire(name: str, args: Any, kwargs: Any) -> float:
        sent = _nbytes(arg(args, kwargs, _SENDS[name], _POSITION[name]))
        group = arg(args, kwargs, "group", _GROUP[name])
        n = dist.get_world_size(group)
        if n == 1:
            return 0.0
        if name == "all_reduce":
            return 2 * (n - 1) / n * sent
        if name.startswith("reduce_scatter"):
            return (n - 1) / n * sent
        if name.startswith("all_gather"):
            return (n - 1) * sent
        if name == "broadcast":
            return sent if arg(args, kwargs, "src", 1) == dist.get_rank() else 0.0
        if name == "all_to_all_single":
            splits = arg(args, kwargs, "input_split_sizes", 3)
            if not splits:
                return (n - 1) / n * sent
            t = arg(args, kwargs, "input", 1)
            own = splits[dist.get_rank(group)] * t[0].numel() * t.element_size() if t.numel() else 0
            return sent - own
        return float(sent)

    def wrap(name: str, fn: Callable) -> Callable:
        def counted(*args: Any, **kwargs: Any) -> Any:
            if not depth[0]:
                counter[name] = counter.get(name, 0) + wire(name, args, kwargs)
            depth[0] += 1
            try:
                return fn(*args, **kwargs)
            finally:
                depth[0] -= 1
        return counted

    for name in _SENDS:
        if hasattr(dist, name):
            setattr(dist, name, wrap(name, getattr(dist, name)))


def _config(stage: int, opt: str) -> Dict[str, Any]:
    zero: Dict[str, Any] = {"stage": stage}
    if stage == 3:
        zero["reduce_scatter"] = False
    return {"train_micro_batch_size_per_gpu": 4, "gradient_clipping": 1.0, "zero_optimization": zero,
            "optimizer": OPTIMIZERS[opt], "steps_per_print": 10**6}


def _measure(system: str, preset: str, stage: int, opt: str, batches: List[torch.Tensor],
             counter: Dict[str, float]) -> Dict[str, float]:
    from shardspeed.models.gpt import GPT, GPTConfig

    torch.manual_seed(0)
    model = GPT(GPTConfig.preset(preset))
    if system == "deepspeed":
        import deepspeed as init_module
    else:
        import shardspeed as init_module  # type: ignore[no-redef]
    engine, *_ = init_module.initialize(model=model, config=_config(stage, opt), model_parameters=model.parameters())
    for i, idx in enumerate(batches):
        if i == 2:
            counter.clear()
        loss = engine(idx, idx)
        engine.backward(loss)
        engine.step()
    steps = len(batches) - 2
    return {name: b / steps for name, b in counter.items()}


def _worker(rank: int, port: int, system: str, args: argparse.Namespace, out: Any) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE="2",
                      LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE="2", DS_ACCELERATOR="cpu")
    torch.set_num_threads(1)
    import torch.distributed as dist

    counter: Dict[str, float] = {}
    _count_collectives(counter)  # before init: DeepSpeed's backend keeps the functions it finds there
    if system == "deepspeed":
        import logging

        import deepspeed
        from torch import _dynamo

        _dynamo.config.disable = True  # eager Muon step: the same math, no minutes of CPU compilation
        deepspeed.init_distributed(dist_backend="gloo")
        deepspeed.utils.logger.setLevel(logging.WARNING)
    else:
        from shardspeed.mesh import init_distributed

        init_distributed(backend="gloo")
    from shardspeed.models.gpt import GPTConfig

    seq = GPTConfig.preset(args.preset).block_size
    g = torch.Generator().manual_seed(1 + rank)
    batches = [torch.randint(0, 256, (4, seq), generator=g) for _ in range(args.steps + 2)]
    rows = {f"{opt}{stage}": _measure(system, args.preset, stage, opt, batches, counter)
            for stage in args.stages for opt in ("adamw", "muon")}
    dist.barrier()
    out.put((rank, rows))


def _run(system: str, args: argparse.Namespace) -> Dict[int, Dict[str, Dict[str, float]]]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=_worker, args=(r, port, system, args, out)) for r in range(2)]
    for p in procs:
        p.start()
    per_rank = dict(out.get() for _ in procs)
    for p in procs:
        p.join()
    return per_rank


def _table(results: Dict[str, Dict[int, Dict[str, Dict[str, float]]]], stages: List[int]) -> str:
    lines = ["| system | stage | rank | AdamW MB sent/step | Muon MB sent/step | extra MB | extra % | Muon's extra by op "
             "(MB) |",
             "|---|---|---|---|---|---|---|---|"]
    for system, per_rank in results.items():
        for stage in stages:
            for rank, rows in sorted(per_rank.items()):
                a, m = rows[f"adamw{stage}"], rows[f"muon{stage}"]
                ta, tm = sum(a.values()), sum(m.values())
                ops = ", ".join(f"{op} {(m.get(op, 0) - a.get(op, 0)) / 1e6:+.3f}" for op in sorted(set(a) | set(m))
                                if abs(m.get(op, 0) - a.get(op, 0)) >= 1e3)
                lines.append(f"| {system} | {stage} | {rank} | {ta / 1e6:.3f} | {tm / 1e6:.3f} | {(tm - ta) / 1e6:+.4f} | "
                             f"{100 * (tm - ta) / ta:+.2f} | {ops} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--preset", default="small")
    ap.add_argument("--stages", default="1,2,3", type=lambda s: [int(x) for x in s.split(",")])
    ap.add_argument("--steps", type=int, default=3)
    args = ap.parse_args()
    results = {system: _run(system, args) for system in ("shardspeed", "deepspeed")}
    print(_table(results, args.stages))
    os.makedirs(os.path.join(ROOT, "benchmarks", "results"), exist_ok=True)
    with open(os.path.join(ROOT, "benchmarks", "results", "muon_bytes.json"), "w") as f:
        json.dump({"preset": args.preset, "steps": args.steps, "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
