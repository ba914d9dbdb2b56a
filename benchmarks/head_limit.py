"""Issue 23: where the head count stops Ulysses, and ring attention goes on.

    python benchmarks/head_limit.py        # world 4, SP 4, a Llama with 6 query heads and 2 KV heads

Launches ``torchrun --nproc-per-node 4`` three times on the same tiny LlamaConfig model (6 heads: SP 4 does
not divide them): DeepSpeed 0.19.8's ALST (``UlyssesSPAttentionHF``), shardspeed's Ulysses and shardspeed's
ring attention, each one ZeRO-3 training step on a 64-token sample, and prints what each did.
"""
from __future__ import annotations

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SP, TOKENS = 4, 64


def _model():
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=256, hidden_size=96, intermediate_size=192, num_hidden_layers=2,
                      num_attention_heads=6, num_key_value_heads=2, tie_word_embeddings=False)
    torch.manual_seed(0)
    return LlamaForCausalLM._from_config(cfg, attn_implementation="sdpa")


def _step(which: str) -> str:
    import torch

    cfg = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 3}, "sequence_parallel_size": SP,
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}}
    ids = torch.randint(0, 256, (1, TOKENS), generator=torch.Generator().manual_seed(0))
    if which == "deepspeed":
        import deepspeed
        from deepspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPAttentionHF as DSUlysses

        deepspeed.init_distributed(dist_backend="gloo")
        m = _model()
        mpu = DSUlysses.register_with_transformers(m, "sdpa", SP, 1)
        engine, *_ = deepspeed.initialize(model=m, config=cfg, mpu=mpu)
        n, r = TOKENS // SP, mpu.get_sequence_parallel_rank()
        out = engine(input_ids=ids[:, r * n:(r + 1) * n], position_ids=torch.arange(r * n, (r + 1) * n)[None]).logits
        engine.backward(out.float().mean())
        engine.step()
        return "trained one step"
    import shardspeed
    from shardspeed.parallel.sp import sequence_parallel_loss, shard_batch
    from shardspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPAttentionHF

    shardspeed.init_distributed(backend="gloo")
    m = _model()
    mpu = UlyssesSPAttentionHF.register_with_transformers(m, "sdpa", SP, 1, attention=which)
    engine, *_ = shardspeed.initialize(model=m, config=cfg, mpu=mpu)
    b = shard_batch({"input_ids": ids, "labels": ids.clone()}, mpu.get_sequence_parallel_rank(), SP,
                    layout="zigzag" if which == "ring" else "contiguous")
    logits = engine(input_ids=b["input_ids"], position_ids=b["position_ids"]).logits
    loss = sequence_parallel_loss(logits, b["shift_labels"], mpu.get_sequence_parallel_group())
    engine.backward(loss)
    engine.step()
    return f"trained one step, loss {float(loss):.4f}"


def worker(which: str) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    try:
        result = _step(which)
    except Exception as exc:  # the refusal is the result
        result = f"refused: {type(exc).__name__}: {str(exc).splitlines()[0]}"
    if dist.get_rank() == 0:
        print(f"{which:<10} {result}", flush=True)
    os._exit(0)  # a refused rank leaves its process groups as they are


def main() -> int:
    if len(sys.argv) == 3 and sys.argv[1] == "--worker":
        worker(sys.argv[2])
        return 0
    env = dict(os.environ, DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")])))
    print(f"SP {SP} on world 4, a Llama with 6 query heads and 2 KV heads, ZeRO 3, {TOKENS} tokens:")
    for which in ("deepspeed", "ulysses", "ring"):
        run = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                              f"--nproc-per-node={SP}", os.path.abspath(__file__), "--worker", which], env=env,
                             check=False, capture_output=True, text=True)
        lines = [line for line in run.stdout.splitlines() if line.startswith(which)]
        print(lines[0] if lines else f"{which:<10} no result (exit {run.returncode}): {run.stderr[-400:]}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
