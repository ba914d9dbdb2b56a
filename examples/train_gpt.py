#!/usr/bin/env python
"""Train a small byte-level GPT with shardspeed (or DeepSpeed, for comparison) from a DeepSpeed config.

    shardspeed run --nproc 2 examples/train_gpt.py --config examples/configs/zero2.json
    torchrun --nproc_per_node 2 examples/train_gpt.py --config examples/configs/zero3.json
    python examples/train_gpt.py                     # one process

The text is the Python standard library's own sources (built at run time, nothing downloaded) or any
file given with --text. At the defaults (model small, 200 steps, ZeRO-2, 2 CPU processes: about 1.5
minutes) the loss falls from about 5.3 (ln 256 = 5.55) to a validation loss of about 2.3.

Restart after a failure: with --save-every K the run saves a checkpoint every K steps (and at the end)
under --save-dir; run it under torchrun's elastic restart and a crashed rank costs at most K steps:

    shardspeed run --nproc 2 --max-restarts 3 examples/train_gpt.py \
        --config examples/configs/zero2.json --save-every 20 --save-dir checkpoints/run1

When a worker dies torchrun stops the others and starts the group again with TORCHELASTIC_RESTART_COUNT
> 0; the script then loads the newest checkpoint this job wrote (its parameters, optimizer state, LR
schedule, step counters, the data loader's position and, with load_rng_state=True, every rank's RNG
states) and trains on from its
step to --steps, ending with the same weights, bit for bit, as an uninterrupted run (fp32; the
run id in the checkpoint must be torchrun's TORCHELASTIC_RUN_ID of this job, so a checkpoint left in
--save-dir by an earlier job is never picked up by a restart). --resume loads the newest checkpoint in
--save-dir on any start, whoever wrote it. --steps is the total: a resumed run trains the steps left.
Fault drill: --fail-at-step N makes rank 1 exit (os._exit(1)) after step N on the first attempt only;
--out-dir DIR writes the final weights (final_weights.safetensors) and a summary (summary.json: steps,
losses, validation loss, the step resumed from, the weights' sha256) to compare runs:

    shardspeed run --nproc 2 --max-restarts 1 examples/train_gpt.py --config examples/configs/zero2.json \
        --save-every 20 --fail-at-step 50 --save-dir /tmp/ckpt --out-dir /tmp/crashed
    shardspeed run --nproc 2 examples/train_gpt.py --config examples/configs/zero2.json \
        --save-every 20 --save-dir /tmp/ckpt2 --out-dir /tmp/straight
    # the two "final weights sha256" lines (and summary.json's) are equal
"""

from __future__ import annotations

import argparse
import hashlib
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
from shardspeed.mesh.init import shutdown_distributed  # noqa: E402
from shardspeed.models import GPT, PRESETS, GPTConfig  # noqa: E402

DEFAULT_CONFIG = Path(__file__).resolve().parent / "configs" / "zero2.json"


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default=str(DEFAULT_CONFIG), help="DeepSpeed-format JSON config")
    p.add_argument("--model", default="small", choices=list(PRESETS), help="GPT preset (default small)")
    p.add_argument("--block-size", type=int, default=128, help="sequence length (default 128)")
    p.add_argument("--dropout", type=float, default=0.0, help="dropout probability (default 0)")
    p.add_argument("--steps", type=int, default=200, help="optimizer steps (default 200)")
    p.add_argument("--text", default=None, help="a text file to train on (default: the stdlib sources)")
    p.add_argument("--max-bytes", type=int, default=DEFAULT_MAX_BYTES, help="cap on the corpus size")
    p.add_argument("--eval-batches", type=int, default=8, help="validation batches per rank at the end")
    p.add_argument("--save-dir", default="checkpoints/train_gpt",
                   help="save a checkpoint here at the end (default checkpoints/train_gpt; '' to skip)")
    p.add_argument("--save-every", type=int, default=0, metavar="K",
                   help="also save a checkpoint every K steps (default 0: only at the end)")
    p.add_argument("--resume", action="store_true",
                   help="load the latest checkpoint from --save-dir first and train on from its step to "
                        "--steps (under torchrun a restarted job does this by itself, see above)")
    p.add_argument("--fail-at-step", type=int, default=0, metavar="N",
                   help="fault drill: on the first attempt (TORCHELASTIC_RESTART_COUNT 0) rank 1 exits "
                        "with status 1 right after step N")
    p.add_argument("--out-dir", default=None,
                   help="write final_weights.safetensors and summary.json here at the end")
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


RUN_FILE = "train_gpt_run.json"  # in --save-dir: {"run_id", "tag"} of the newest checkpoint this script saved


def own_checkpoint_tag(save_dir: str, run_id: str) -> str | None:
    """The tag of the newest checkpoint saved in ``save_dir`` by the torchrun job ``run_id``, or None."""
    try:
        with open(os.path.join(save_dir, RUN_FILE)) as f:
            record = json.load(f)
    except (OSError, ValueError):
        return None
    return record.get("tag") if run_id and record.get("run_id") == run_id else None


def save(engine, save_dir: str, step: int, args, run_id: str, rank: int) -> str:
    """A checkpoint of ``step`` (every rank), then rank 0 records that this job wrote it."""
    tag = f"global_step{engine.global_steps}"
    engine.save_checkpoint(save_dir, tag=tag,
                           client_state={"step": step, "steps": args.steps, "seed": args.seed, "run_id": run_id})
    if rank == 0:  # after save_checkpoint returned: the checkpoint and `latest` are complete on disk
        tmp = os.path.join(save_dir, RUN_FILE + ".tmp")
        with open(tmp, "w") as f:
            json.dump({"run_id": run_id, "tag": tag, "step": step}, f)
        os.replace(tmp, os.path.join(save_dir, RUN_FILE))
    return tag


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

    model_config = GPTConfig.preset(args.model, vocab_size=256, block_size=args.block_size, dropout=args.dropout)
    model = GPT(model_config)
    n_params, flops_per_token = model.num_params(), model.flops_per_token()  # before ZeRO-3 shards them
    train_set, val_set = build_text_datasets(args.block_size, args.text, args.max_bytes)
    config = load_config(args.config, args.steps)

    engine, optimizer, loader, _scheduler = initialize(args.backend, model, config, train_set)
    if hasattr(engine, "set_tokens_per_sample"):  # shardspeed's monitors then write Train/Samples/tokens_per_sec
        engine.set_tokens_per_sample(args.block_size)
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

    # torchrun sets these: the attempt (0 first, then one more per restart) and the job's id (kept
    # across restarts)
    restart_count = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    run_id = os.environ.get("TORCHELASTIC_RUN_ID", "")
    start_step = 0
    if args.save_dir and (args.resume or restart_count > 0):
        # --resume: the newest checkpoint in --save-dir; a restart: the newest one this job saved
        tag = None if args.resume else own_checkpoint_tag(args.save_dir, run_id)
        if world > 1 and dist.is_initialized():  # rank 0's reading, so that every rank loads the same tag
            box = [tag]
            dist.broadcast_object_list(box, src=0)
            tag = box[0]
        path, client = (None, None)
        if args.resume or tag is not None:
            # load_rng_state: dropout after the restart draws what the uninterrupted run draws (DeepSpeed
            # restores no RNG; shardspeed does when asked)
            path, client = engine.load_checkpoint(args.save_dir, tag=tag, load_rng_state=True)
        if path is not None:
            start_step = int((client or {}).get("step", engine.global_steps))
        if rank == 0:
            attempt = f" (restart {restart_count})" if restart_count else ""
            print(f"resumed from {path} at step {start_step}{attempt}" if path else
                  f"nothing to resume in {args.save_dir}{attempt}: starting afresh", flush=True)

    data = batches(loader, train_set, micro)
    losses: dict[int, float] = {}  # step number (1-based) -> rank 0's loss
    fail_rank = min(1, world - 1)
    start = time.perf_counter()
    if hasattr(engine, "progress"):  # shardspeed: loss, LR and samples/s from the engine; off when not a TTY
        progress = engine.progress(range(start_step, args.steps), initial=start_step, total=args.steps,
                                   desc="train", dynamic_ncols=True)
    else:
        progress = tqdm(range(start_step, args.steps), initial=start_step, total=args.steps, disable=rank != 0,
                        desc="train", dynamic_ncols=True)
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
        done = step + 1
        losses[done] = step_loss
        elapsed = time.perf_counter() - start
        if not hasattr(engine, "progress"):  # shardspeed's bar shows the engine's own numbers
            progress.set_postfix(loss=f"{step_loss:.3f}", lr=f"{current_lr(engine, optimizer):.2e}",
                                 tok_s=f"{(done - start_step) * tokens_per_step / elapsed:,.0f}")
        if args.fail_at_step == done and restart_count == 0 and rank == fail_rank:
            print(f"fault drill: rank {rank} exits after step {done}", flush=True)
            os._exit(1)
        if args.save_dir and args.save_every and done % args.save_every == 0 and done < args.steps:
            save(engine, args.save_dir, done, args, run_id, rank)  # the last step's is the final save
    progress.close()
    train_time = time.perf_counter() - start

    trained = args.steps - start_step
    val_loss = evaluate(engine, val_set, micro, args.eval_batches, device)
    if args.save_dir and trained > 0:
        tag = save(engine, args.save_dir, args.steps, args, run_id, rank)
        if rank == 0:
            print(f"checkpoint saved under {args.save_dir} (tag {tag}); "
                  f"export it with: shardspeed consolidate {args.save_dir} {args.save_dir}-fp32", flush=True)
    if args.out_dir:
        if rank == 0:
            os.makedirs(args.out_dir, exist_ok=True)
        weights = os.path.join(args.out_dir, "final_weights.safetensors")
        engine.save_16bit_model(args.out_dir, "final_weights.safetensors")  # every rank (ZeRO-3 gathers)

    if rank == 0:
        if losses:
            tail = list(losses.values())[-10:]
            first = next(iter(losses))
            print(f"loss at step {first} {losses[first]:.4f} (ln 256 = {math.log(256):.4f}); "
                  f"last loss {losses[args.steps]:.4f} (mean of last {len(tail)}: {sum(tail) / len(tail):.4f}); "
                  f"val loss {val_loss:.4f}")
            print(f"{trained} steps in {train_time:.1f}s: "
                  f"{trained * tokens_per_step / train_time:,.0f} tokens/s over {world} rank(s)")
        else:
            print(f"nothing to train: the checkpoint is at step {start_step} of {args.steps}; "
                  f"val loss {val_loss:.4f}")
        if args.out_dir:
            with open(weights, "rb") as f:
                digest = hashlib.sha256(f.read()).hexdigest()
            print(f"final weights sha256 {digest} ({weights})", flush=True)
            with open(os.path.join(args.out_dir, "summary.json"), "w") as f:
                json.dump({"steps": args.steps, "start_step": start_step, "restart_count": restart_count,
                           "losses": {str(k): v for k, v in losses.items()}, "val_loss": val_loss,
                           "weights_sha256": digest}, f, indent=1)
    # every rank, after its last collective: a barrier, then the groups destroyed with rank 0 (the host of
    # torchrun's store under --max-restarts) leaving last. A bare barrier + destroy_process_group lets a
    # rank exit while a slower one still talks to it, and a worker that fails there makes torchrun
    # restart a job that had finished.
    shutdown_distributed()
    return 0


if __name__ == "__main__":
    sys.exit(main())
