#!/usr/bin/env python
"""Train a small byte-level GPT with shardspeed (or DeepSpeed, for comparison) from a DeepSpeed config.

    shardspeed run --nproc 2 examples/train_gpt.py --config examples/configs/zero2.json
    torchrun --nproc_per_node 2 examples/train_gpt.py --config examples/configs/zero3.json
    python examples/train_gpt.py                     # one process

The text is the Python standard library's own sources (built at run time, nothing downloaded) or any
file given with --text. At the defaults (model small, 200 steps, ZeRO-2, 2 CPU processes: about 1.5
minutes) the loss falls from about 5.3 (ln 256 = 5.55) to a validation loss of about 2.3.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from tqdm import tqdm

# Run from a checkout without installing: make `import shardspeed` find the repository's package.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from shardspeed.data import DEFAULT_MAX_BYTES, build_text_datasets  # noqa: E402
from shardspeed.models import GPT, PRESETS, GPTConfig  # noqa: E402

DEFAULT_CONFIG = Path(__file__).resolve().parent / "configs" / "zero2.json"


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default=str(DEFAULT_CONFIG), help="DeepSpeed-format JSON config")
    p.add_argument("--model", default="small", choices=list(PRESETS), help="GPT preset (default small)")
    p.add_argument("--block-size", type=int, default=128, help="sequence length (default 128)")
    p.add_argument("--steps", type=int, default=200, help="optimizer steps (default 200)")
    p.add_argument("--text", default=None, help="a text file to train on (default: the stdlib sources)")
    p.add_argument("--max-bytes", type=int, default=DEFAULT_MAX_BYTES, help="cap on the corpus size")
    p.add_argument("--eval-batches", type=int, default=8, help="validation batches per rank at the end")
    p.add_argument("--save-dir", default="checkpoints/train_gpt",
                   help="save a checkpoint here at the end (default checkpoints/train_gpt; '' to skip)")
    p.add_argument("--resume", action="store_true",
                   help="load the latest checkpoint from --save-dir first and train --steps more")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--backend", choices=["shardspeed", "deepspeed"], default="shardspeed",
                   help="deepspeed: run the same job with DeepSpeed, for comparison")
    return p.parse_args(argv)


def load_config(path: str, steps: int) -> dict:
    """The JSON config, with the decay schedule's length set to --steps (as DeepSpeed users do)."""
    with open(path) as f:
        config = json.load(f)
    sched = config.get("scheduler") or {}
    if "total_num_steps" in sched.get("params", {}):
        sched["params"]["total_num_steps"] = steps
    return config


def rank_and_world() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))


def initialize(backend: str, model: torch.nn.Module, config: dict, dataset):
    if backend == "deepspeed":
        os.environ.setdefault("DS_ACCELERATOR", "cuda" if torch.cuda.is_available() else "cpu")
        import deepspeed

        if not torch.cuda.is_available():
            # no fused kernels were built on a CPU machine: use torch's Adam
            config.get("optimizer", {}).get("params", {}).setdefault("torch_adam", True)
        return deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config,
                                    training_data=dataset)
    import shardspeed

    if not hasattr(shardspeed, "initialize"):
        sys.exit("shardspeed.initialize is not available in this checkout yet (the engine is in "
                 "progress); try --backend deepspeed")
    return shardspeed.initialize(model=model, model_parameters=model.parameters(), config=config,
                                 training_data=dataset)


def gradient_accumulation_steps(engine) -> int:
    gas = getattr(engine, "gradient_accumulation_steps", 1)
    return int(gas() if callable(gas) else gas)


def current_lr(engine, optimizer) -> float:
    if hasattr(engine, "get_lr"):
        return float(engine.get_lr()[0])
    return float(optimizer.param_groups[0]["lr"])


def batches(loader, fallback_dataset, micro_batch: int):
    """Yield (x, y) forever, epoch after epoch (reshuffled by the sampler each epoch)."""
    if loader is None:  # the engine built no loader: shard the data ourselves
        from torch.utils.data import DataLoader, DistributedSampler

        rank, world = rank_and_world()
        sampler = DistributedSampler(fallback_dataset, num_replicas=world, rank=rank, shuffle=True)
        loader = DataLoader(fallback_dataset, batch_size=micro_batch, sampler=sampler, drop_last=True)
    # shardspeed's loader moves to the next epoch and reshuffles by itself, and resumes mid-epoch after
    # load_checkpoint; other loaders (DeepSpeed's, the fallback) need set_epoch
    self_epoching = hasattr(loader, "state_dict") and hasattr(loader, "set_epoch")
    epoch = 0
    while True:
        sampler = getattr(loader, "sampler", None) or getattr(loader, "data_sampler", None)
        if not self_epoching and hasattr(sampler, "set_epoch"):
            sampler.set_epoch(epoch)
        for batch in loader:
            yield batch[0], batch[1]
        epoch += 1


@torch.no_grad()
def evaluate(engine, val_dataset, micro_batch: int, n_batches: int, device) -> float:
    """Mean loss over n_batches micro-batches per rank, each rank on its own windows; averaged over ranks.

    Every rank runs the same number of forwards (ZeRO-3 gathers parameters collectively)."""
    rank, world = rank_and_world()
    if hasattr(engine, "eval"):
        engine.eval()
    total, count = 0.0, 0
    n_windows = len(val_dataset)
    for b in range(n_batches):
        first = ((b * world + rank) * micro_batch) % max(1, n_windows - micro_batch)
        xs, ys = zip(*(val_dataset[first + j] for j in range(micro_batch)))
        x, y = torch.stack(xs), torch.stack(ys)
        if device is not None:
            x, y = x.to(device), y.to(device)
        total += float(engine(x, y))
        count += 1
    if hasattr(engine, "train"):
        engine.train()
    mean = torch.tensor([total / max(1, count)], dtype=torch.float64)
    if world > 1 and dist.is_initialized():
        dist.all_reduce(mean)
        mean /= world
    return mean.item()


def main(argv=None) -> int:
    args = parse_args(argv)
    torch.manual_seed(args.seed)  # same initial weights on every rank
    if not torch.cuda.is_available() and "OMP_NUM_THREADS" not in os.environ:
        # CPU: share the cores among the local processes instead of oversubscribing them
        local = int(os.environ.get("LOCAL_WORLD_SIZE", 1))
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // local))

    model_config = GPTConfig.preset(args.model, vocab_size=256, block_size=args.block_size)
    model = GPT(model_config)
    n_params, flops_per_token = model.num_params(), model.flops_per_token()  # before ZeRO-3 shards them
    train_set, val_set = build_text_datasets(args.block_size, args.text, args.max_bytes)
    config = load_config(args.config, args.steps)

    engine, optimizer, loader, _scheduler = initialize(args.backend, model, config, train_set)
    rank, world = rank_and_world()
    device = getattr(engine, "device", None)
    gas = gradient_accumulation_steps(engine)
    micro = int(config.get("train_micro_batch_size_per_gpu", 8))
    tokens_per_step = micro * gas * world * args.block_size

    if rank == 0:
        print(f"model {args.model}: {n_params:,} parameters, "
              f"{flops_per_token / 1e6:.1f} MFLOP/token; {len(train_set):,} train windows of "
              f"{args.block_size} bytes; {world} rank(s) x micro-batch {micro} x accumulation {gas} "
              f"= {tokens_per_step:,} tokens/step; config {args.config}", flush=True)

    if args.resume and args.save_dir:
        path, client = engine.load_checkpoint(args.save_dir)
        if rank == 0:
            print(f"resumed from {path} at step {engine.global_steps}" if path else
                  f"nothing to resume in {args.save_dir}: starting afresh", flush=True)

    data = batches(loader, train_set, micro)
    losses: list[float] = []
    start = time.perf_counter()
    progress = tqdm(range(args.steps), disable=rank != 0, desc="train", dynamic_ncols=True)
    for step in progress:
        step_loss = 0.0
        for _ in range(gas):
            x, y = next(data)
            if device is not None:
                x, y = x.to(device), y.to(device)
            loss = engine(x, y)
            engine.backward(loss)
            engine.step()
            step_loss += loss.item() / gas  # rank-local loss (a host sync per micro-batch)
        losses.append(step_loss)
        elapsed = time.perf_counter() - start
        progress.set_postfix(loss=f"{step_loss:.3f}", lr=f"{current_lr(engine, optimizer):.2e}",
                             tok_s=f"{(step + 1) * tokens_per_step / elapsed:,.0f}")
    progress.close()
    train_time = time.perf_counter() - start

    val_loss = evaluate(engine, val_set, micro, args.eval_batches, device)
    if args.save_dir:
        engine.save_checkpoint(args.save_dir, client_state={"steps": args.steps, "seed": args.seed})
        if rank == 0:
            print(f"checkpoint saved under {args.save_dir} (tag global_step{engine.global_steps}); "
                  f"export it with: shardspeed consolidate {args.save_dir} {args.save_dir}-fp32", flush=True)

    if rank == 0:
        tail = losses[-min(10, len(losses)):]
        print(f"first loss {losses[0]:.4f} (ln 256 = {math.log(256):.4f}); "
              f"last loss {losses[-1]:.4f} (mean of last {len(tail)}: {sum(tail) / len(tail):.4f}); "
              f"val loss {val_loss:.4f}")
        print(f"{args.steps} steps in {train_time:.1f}s: "
              f"{args.steps * tokens_per_step / train_time:,.0f} tokens/s over {world} rank(s)")
    if dist.is_available() and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
