"""Worker for tests/test_precision_modes.py, run by torchrun (world 2; world 4 too) with either the real DeepSpeed
or shardspeed's ``deepspeed`` package first on the path: ``torch_autocast`` (bf16, fp32 parameters) and bf16 master
weights with bf16 optimizer states, each at ZeRO stages 1-3 (``bf16_masters_off``: offloaded to the CPU;
``bf16_masters_f32_off``: offloaded with fp32 moments, DeepSpeedCPUAdam's default, trained 20 steps), trained 12
steps (2 micro-batches accumulated, clipped) on the same data; ``fp16_masters_off`` (fp16 master weights offloaded
with fp32 moments, a static loss scale) and ``fp16_dyn_off`` (the same with a dynamic scale that overflows first), 20
steps, with shardspeed only (DeepSpeed's CPU accelerator runs no fp16: the real side skips them; the test holds
them to tests/precision_reference.py's plain-torch reference). Rank 0 writes ``OUT/result.json``: per case the
losses, the dtypes of the optimizer's state tensors and their bytes on each rank, and the ``comm_dtype`` tags on the
Linear's and the LayerNorm's weights (the dtype their gradients are reduced in); fp16 cases also the loss scale and
whether the step was skipped, per step, and the final parameters. ``argv[2]``, optional: the cases to
run, comma-separated (default: ``autocast_z1`` .. ``bf16_masters_off_z3``)."""
import datetime
import json
import os
import sys

import deepspeed
import torch
from precision_reference import batch, model  # tests/, the folder of this script
from worker_exit import end_distributed

OUT = sys.argv[1]
CASES = sys.argv[2].split(",") if len(sys.argv) > 2 else [f"{m}_z{s}" for m in ("autocast", "bf16_masters",
                                                                                "bf16_masters_off") for s in (1, 2, 3)]
STEPS, ACCUM = 12, 2
#: the modes trained longer (issue 40's 20 steps): 16-bit masters with fp32 moments, offloaded
LONG_STEPS = {"bf16_masters_f32_off": 20, "fp16_masters_off": 20, "fp16_dyn_off": 20}
#: the fp16 modes: a static scale, or a dynamic one that starts too high (it overflows, skips and halves first)
FP16 = {"fp16_masters_off": {"loss_scale": 1024}, "fp16_dyn_off": {"initial_scale_power": 20, "loss_scale_window": 4}}
#: shardspeed's ``deepspeed`` package (the real DeepSpeed on its CPU accelerator runs no fp16)
OURS = hasattr(deepspeed, "__shardspeed__")


def config(stage: int, mode: str) -> dict:
    cfg = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": ACCUM, "gradient_clipping": 0.5,
           "zero_optimization": {"stage": stage}, "steps_per_print": 1000,
           "optimizer": {"type": "AdamW", "params": {"lr": 3e-3, "weight_decay": 0.01}}}
    if mode == "autocast":
        cfg["torch_autocast"] = {"enabled": True, "dtype": "bfloat16"}
    elif mode in FP16:  # DeepSpeedCPUAdam's fp16 masters: fp32 moments
        cfg["fp16"] = dict(FP16[mode], enabled=True, fp16_master_weights_and_grads=True)
        cfg["gradient_clipping"] = 0.05  # below the gradients' norm: every step is clipped
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
    dtype = {"bf": torch.bfloat16, "fp": torch.float16}.get(mode[:2], torch.float32)
    losses, scales, skipped = [], [], []
    for _ in range(LONG_STEPS.get(mode, STEPS)):
        scales.append(float(engine.cur_scale) if mode in FP16 else 1.0)
        before = engine.skipped_steps
        for _ in range(ACCUM):
            x, y = batch(gen)
            out = engine(x.to(dtype))
            loss = (out.float() - y).pow(2).mean()
            engine.backward(loss)
            engine.step()
        total = loss.detach().clone()
        torch.distributed.all_reduce(total)
        losses.append(float(total) / torch.distributed.get_world_size())
        skipped.append(engine.skipped_steps > before)
    states = state_tensors(engine)
    extra = {}
    if mode in FP16:  # the full parameters (stage 3: gathered)
        with deepspeed.zero.GatheredParameters(list(engine.module.parameters())):
            params = [float(v) for p in engine.module.parameters() for v in p.detach().reshape(-1)]
        extra = {"scales": scales, "skipped": skipped, "params": params}
    return {**extra, "losses": losses, "state_dtypes": sorted({str(t.dtype) for t in states}),
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
    results = {case: train(int(case[-1]), case[: -len("_z1")], rank) for case in CASES
               if OURS or not case.startswith("fp16")}
    gathered = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(gathered, results)
    if rank == 0:
        merged = {k: dict(v, state_bytes=[g[k]["state_bytes"] for g in gathered]) for k, v in results.items()}
        with open(os.path.join(OUT, "result.json"), "w") as f:
            json.dump(merged, f, indent=1)


if __name__ == "__main__":
    main()
    end_distributed()
