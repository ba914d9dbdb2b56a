"""Worker for tests/test_precision_modes.py, run by torchrun (world 2; world 4 too) with either the real DeepSpeed
or shardspeed's ``deepspeed`` package first on the path: ``torch_autocast`` (bf16, fp32 parameters) and bf16 master
weights with bf16 optimizer states, each at ZeRO stages 1-3 (``bf16_masters_off``: offloaded to the CPU;
``bf16_masters_f32_off``: offloaded with fp32 moments, DeepSpeedCPUAdam's default, trained 20 steps), trained 12
steps (2 micro-batches accumulated, clipped) on the same data. Rank 0 writes ``OUT/result.json``: per case the
losses, the dtypes of the optimizer's state tensors and their bytes on each rank, and the ``comm_dtype`` tags on the
Linear's and the LayerNorm's weights (the dtype their gradients are reduced in). ``argv[2]``, optional: the cases to
run, comma-separated (default: ``autocast_z1`` .. ``bf16_masters_off_z3``)."""
import datetime
import json
import os
import sys

import deepspeed
import torch
from worker_exit import end_distributed  # tests/, the folder of this script

OUT = sys.argv[1]
CASES = sys.argv[2].split(",") if len(sys.argv) > 2 else [f"{m}_z{s}" for m in ("autocast", "bf16_masters",
                                                                                "bf16_masters_off") for s in (1, 2, 3)]
STEPS, ACCUM = 12, 2
#: the modes trained longer (issue 40's 20 steps): bf16 masters with fp32 moments, offloaded
LONG_STEPS = {"bf16_masters_f32_off": 20}


def model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.LayerNorm(64), torch.nn.GELU(),
                               torch.nn.Linear(64, 64), torch.nn.GELU(), torch.nn.Linear(64, 8))


def config(stage: int, mode: str) -> dict:
    cfg = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": ACCUM, "gradient_clipping": 0.5,
           "zero_optimization": {"stage": stage}, "steps_per_print": 1000,
           "optimizer": {"type": "AdamW", "params": {"lr": 3e-3, "weight_decay": 0.01}}}
    if mode == "autocast":
        cfg["torch_autocast"] = {"enabled": True, "dtype": "bfloat16"}
    else:  # bf16_masters_f32_off: fp32 moments (DeepSpeedCPUAdam's default fp32_optimizer_states)
        cfg["bf16"] = {"enabled": True, "bf16_master_weights_and_grads": True,
                       "bf16_optimizer_states": "_f32" not in mode}
    if mode.endswith("_off"):  # DeepSpeed steps the host masters with its DeepSpeedCPUAdam (a JIT-built op)
        cfg["zero_optimization"]["offload_optimizer"] = {"device": "cpu"}
    return cfg


def state_tensors(engine) -> list:
    master = getattr(engine, "master_weights", None)  # shardspeed offloaded: Adam's moments live in its store
    if master is not None and master.is_tiled:
        return [t for tile in master.host_tiles for t in master.tile_state(tile)[1:]]
    inner = engine.optimizer
    inner = getattr(inner, "optimizer", inner)
    return [v for st in inner.state.values() for v in st.values() if torch.is_tensor(v) and v.dim() > 0]


def train(stage: int, mode: str, rank: int) -> dict:
    engine, _, _, _ = deepspeed.initialize(model=model(), config=config(stage, mode))
    gen = torch.Generator().manual_seed(100 + rank)
    dtype = torch.bfloat16 if mode.startswith("bf16_masters") else torch.float32
    losses = []
    for _ in range(LONG_STEPS.get(mode, STEPS)):
        for _ in range(ACCUM):
            x = torch.randn(4, 16, generator=gen)
            y = torch.sin(x[:, :8] * 2)
            out = engine(x.to(dtype))
            loss = (out.float() - y).pow(2).mean()
            engine.backward(loss)
            engine.step()
        total = loss.detach().clone()
        torch.distributed.all_reduce(total)
        losses.append(float(total) / torch.distributed.get_world_size())
    states = state_tensors(engine)
    return {"losses": losses, "state_dtypes": sorted({str(t.dtype) for t in states}),
            "state_bytes": sum(t.numel() * t.element_size() for t in states),
            "param_dtype": str(next(engine.module.parameters()).dtype),
            "comm_dtype": [str(getattr(engine.module[i].weight, "comm_dtype", None)) for i in (0, 1)],
            "wire_dtypes": wire_dtypes(engine)}


def wire_dtypes(engine) -> list:
    """shardspeed: per unit, the dtype its gradients are reduced in (None: the training dtype); [] for DeepSpeed."""
    if not hasattr(engine, "reducer"):
        return []
    return sorted(str(u.wire_dtype) for u in engine.reducer.units)


def main() -> None:
    deepspeed.init_distributed(dist_backend="gloo", timeout=datetime.timedelta(seconds=300),
                               auto_mpi_discovery=False)
    rank = torch.distributed.get_rank()
    results = {case: train(int(case[-1]), case[: -len("_z1")], rank) for case in CASES}
    gathered = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(gathered, results)
    if rank == 0:
        merged = {k: dict(v, state_bytes=[g[k]["state_bytes"] for g in gathered]) for k, v in results.items()}
        with open(os.path.join(OUT, "result.json"), "w") as f:
            json.dump(merged, f, indent=1)


if __name__ == "__main__":
    main()
    end_distributed()
