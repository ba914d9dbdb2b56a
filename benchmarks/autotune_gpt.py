#!/usr/bin/env python
"""A trial script for `shardspeed autotune`: a GPT on random tokens, trained from a DeepSpeed config.

    shardspeed autotune --nproc 2 benchmarks/autotune_gpt.py --deepspeed_config cfg.json --n-embd 128

It trains ``--steps`` optimizer steps (each of the config's gradient_accumulation_steps micro-batches);
under a tuner the config's ``autotuning`` block makes the engine write its metrics and exit at
``end_profile_step``. ``--hang-stage S`` sleeps forever when the config's ZeRO stage is S (the tests'
hung trial); ``--backend deepspeed`` trains the same job with DeepSpeed (to check a config loads there).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from shardspeed.models import GPT, GPTConfig  # noqa: E402


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--deepspeed_config", "--deepspeed", required=True, dest="config")
    p.add_argument("--n-layer", type=int, default=4)
    p.add_argument("--n-embd", type=int, default=128)
    p.add_argument("--n-head", type=int, default=4)
    p.add_argument("--block-size", type=int, default=64)
    p.add_argument("--steps", type=int, default=1000)
    p.add_argument("--hang-stage", type=int, default=None)
    p.add_argument("--backend", choices=["shardspeed", "deepspeed"], default="shardspeed")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    with open(args.config) as f:
        config = json.load(f)
    if args.hang_stage is not None and (config.get("zero_optimization") or {}).get("stage", 0) == args.hang_stage:
        while True:  # a trial that never finishes: the tuner must kill it
            time.sleep(1)
    torch.manual_seed(args.seed)
    torch.set_num_threads(1)
    model = GPT(GPTConfig(vocab_size=256, block_size=args.block_size, n_layer=args.n_layer, n_head=args.n_head,
                          n_embd=args.n_embd))
    if args.backend == "deepspeed":
        os.environ.setdefault("DS_ACCELERATOR", "cuda" if torch.cuda.is_available() else "cpu")
        import deepspeed

        config.get("optimizer", {}).get("params", {}).setdefault("torch_adam", True)
        engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    else:
        import shardspeed

        engine, *_ = shardspeed.initialize(model=model, config=config)
    mbs, gas = engine.train_micro_batch_size_per_gpu(), engine.gradient_accumulation_steps()
    # one stream per data-parallel rank: the ranks of a tensor-parallel group must see the same batches
    dp_rank = engine.mpu.get_data_parallel_rank() if args.backend == "shardspeed" else int(os.environ.get("RANK", 0))
    gen = torch.Generator().manual_seed(args.seed + dp_rank)
    for _ in range(args.steps):
        for _ in range(gas):
            x = torch.randint(0, 256, (mbs, args.block_size + 1), generator=gen).to(engine.device)
            loss = engine(x[:, :-1], x[:, 1:])
            engine.backward(loss)
            engine.step()
    print(f"done: {args.steps} steps, loss {float(loss):.4f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
