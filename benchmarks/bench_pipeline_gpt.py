"""A real GPT at PP=2: shardspeed's pipeline engine against DeepSpeed 0.19.8's PipelineEngine, and
DeepSpeed's gradient norm under its pipeline grid against the true one.

The same script for both (shardspeed.models.gpt_pipe's layers, ``PipelineModule(num_stages=2,
partition_method="uniform")``, the same weights set by name, the same batches), world 2 over gloo on CPU,
fp32 AdamW, 1F1B (DeepSpeed's only schedule), ZeRO 0 and 1. Both engines live in the same two processes;
their steps are interleaved (DeepSpeed, shardspeed, DeepSpeed, ...) so both see the same machine load, and
the median of the timed steps (after ``--warmup``) is kept.

Gradient norm (``--clip``, default 1.0): at the first step both engines see the same weights and batch.
Rank 0 also runs the whole model in one process (plain torch) on that batch and computes the true norm
and the norm of the first stage's gradients alone; DeepSpeed's norm is the value its ``clip_grad_norm_``
returns (ZeRO 0) or ``get_global_grad_norm()`` (ZeRO 1).

    DS_ACCELERATOR=cpu python benchmarks/bench_pipeline_gpt.py [--steps 6] [--warmup 2] [--stages 0 1]

Writes benchmarks/results/bench_pipeline_gpt.json.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import traceback
import zlib
from typing import Any, Dict, List, Optional

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from benchmarks.harness import init_gloo, run_once, worker_setup  # noqa: E402

SHAPE = dict(vocab_size=8192, block_size=64, n_layer=8, n_head=8, n_embd=256)  # 10.5M parameters
MICRO, GAS, SEQ = 2, 8, 64
_DS_NORMS: List[float] = []  # what DeepSpeed's clip_grad_norm_ returned (its ZeRO 0 fp32 path)


def _set_weights(model) -> None:
    """GPT-2-style values by parameter name (the same under both engines, whatever rank builds them)."""
    import torch

    with torch.no_grad():
        for name, p in model.named_parameters():
            g = torch.Generator().manual_seed(zlib.crc32(name.encode()))
            if name.endswith("bias"):
                p.zero_()
            elif p.dim() == 1:
                p.fill_(1.0)  # LayerNorm weights
            else:
                p.copy_(torch.randn(p.shape, generator=g) * 0.02)


def _model(pipe):
    from shardspeed.models.gpt import GPTConfig
    from shardspeed.models.gpt_pipe import gpt_layer_specs, gpt_loss

    model = pipe.PipelineModule(gpt_layer_specs(GPTConfig(**SHAPE), pipe), num_stages=2, loss_fn=gpt_loss,
                                partition_method="uniform")
    _set_weights(model)
    return model


def _batches(n: int) -> List[List[tuple]]:
    import torch

    g = torch.Generator().manual_seed(0)
    out = []
    for _ in range(n):
        x = torch.randint(0, SHAPE["vocab_size"], (GAS * MICRO, SEQ + 1), generator=g)
        out.append([(x[k * MICRO:(k + 1) * MICRO, :-1], x[k * MICRO:(k + 1) * MICRO, 1:]) for k in range(GAS)])
    return out


def _config(stage: int, clip: float) -> Dict[str, Any]:
    return {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": GAS, "gradient_clipping": clip,
            "optimizer": {"type": "AdamW", "params": {"lr": 3e-4, "weight_decay": 0.01}},
            "zero_optimization": {"stage": stage}, "steps_per_print": 10 ** 6}


def _engines(stage: int, clip: float):
    import deepspeed
    import deepspeed.pipe

    import shardspeed
    import shardspeed.pipe

    ds_cfg = _config(stage, clip)
    ds_cfg["optimizer"]["params"]["torch_adam"] = True
    ds_model = _model(deepspeed.pipe)
    ds, *_ = deepspeed.initialize(model=ds_model, config=ds_cfg, model_parameters=list(ds_model.parameters()))
    ss_model = _model(shardspeed.pipe)
    ss_cfg = dict(_config(stage, clip), pipeline={"schedule": "1f1b"})
    ss, *_ = shardspeed.initialize(model=ss_model, config=ss_cfg)
    return ds, ss


def _reference_norms(batch: List[tuple], stage0_names: List[str]) -> Dict[str, float]:
    """One process, the whole model: the true gradient norm of the first step and its first stage's part."""
    model = _model_whole()
    for x, y in batch:
        (model.loss_fn(model(x), y) / len(batch)).backward()
    sq = {n: float(p.grad.float().pow(2).sum()) for n, p in model.named_parameters()}
    return {"true": sum(sq.values()) ** 0.5, "stage0_only": sum(sq[n] for n in stage0_names) ** 0.5}


def _model_whole():
    """The same layers and weights in one stage (built outside any pipeline grid)."""
    import torch.nn as nn

    from shardspeed.models.gpt import GPTConfig
    from shardspeed.models.gpt_pipe import gpt_layer_specs, gpt_loss

    class Whole(nn.Sequential):
        loss_fn = staticmethod(gpt_loss)

    import shardspeed.pipe as pipe

    model = Whole(*[s.build() for s in gpt_layer_specs(GPTConfig(**SHAPE), pipe)])
    _set_weights(model)
    return model


def _worker(rank: int, world: int, port: int, stages: List[int], steps: int, warmup: int, clip: float, q) -> None:
    worker_setup(rank, world, port, threads=1)
    try:
        import torch.distributed as dist

        init_gloo(rank, world)
        import deepspeed

        deepspeed.init_distributed(dist_backend="gloo")
        import deepspeed.runtime.engine as ds_engine_mod

        original = ds_engine_mod.clip_grad_norm_

        def recording(*a, **k):
            n = original(*a, **k)
            _DS_NORMS.append(float(n))
            return n

        ds_engine_mod.clip_grad_norm_ = recording
        out: Dict[str, Any] = {}
        for stage in stages:
            out[f"zero{stage}"] = _one_stage(stage, steps, warmup, clip, rank)
        if rank == 0:
            q.put(("ok", out))
        dist.destroy_process_group()
    except BaseException:
        q.put(("error", traceback.format_exc()))


def _one_stage(stage: int, steps: int, warmup: int, clip: float, rank: int) -> Dict[str, Any]:
    import torch.distributed as dist

    ds, ss = _engines(stage, clip)
    _DS_NORMS.clear()
    data = _batches(warmup + steps)
    stage0 = [n for n, _ in ds.module.named_parameters()]  # rank 0 holds DeepSpeed's first stage
    times: Dict[str, List[float]] = {"deepspeed": [], "shardspeed": []}
    losses: Dict[str, List[float]] = {"deepspeed": [], "shardspeed": []}
    norms: Dict[str, List[Optional[float]]] = {"deepspeed": [], "shardspeed": []}
    for i, batch in enumerate(data):
        for name, engine in (("deepspeed", ds), ("shardspeed", ss)):
            dist.barrier()
            t0 = time.perf_counter()
            loss = engine.train_batch(iter(batch))
            dist.barrier()
            if i >= warmup:
                times[name].append(time.perf_counter() - t0)
            losses[name].append(float(loss))
            norm = engine.get_global_grad_norm()
            if name == "deepspeed" and stage == 0 and _DS_NORMS:
                norm = _DS_NORMS[-1]
            norms[name].append(None if norm is None else float(norm))
    ref = _reference_norms(data[0], stage0) if clip > 0 and rank == 0 else {}
    med = {k: statistics.median(v) for k, v in times.items()}
    return {"step_s": {k: round(v, 4) for k, v in med.items()},
            "ratio_ss_over_ds": round(med["shardspeed"] / med["deepspeed"], 3),
            "losses": losses, "norms": norms, "first_step_norm": ref}


def main(argv: Optional[List[str]] = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=6, help="timed steps per engine (interleaved)")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--stages", type=int, nargs="+", default=[0, 1])
    ap.add_argument("--clip", type=float, default=1.0)
    ap.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results", "bench_pipeline_gpt.json"))
    args = ap.parse_args(argv)
    value = run_once(_worker, 2, (args.stages, args.steps, args.warmup, args.clip), 3000, "PP=2 GPT")
    result = {"load_average_after": os.getloadavg(), "shape": SHAPE, "micro": MICRO, "gas": GAS, "seq": SEQ, "clip": args.clip, "steps": args.steps,
              "warmup": args.warmup, "results": value}
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
