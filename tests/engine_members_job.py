"""One world-2 job that records DeepSpeedEngine members, run the same under real DeepSpeed and under shardspeed's
``deepspeed`` package (``tests/test_engine_deepspeed_members.py``). ``import deepspeed`` is whichever the
PYTHONPATH finds. Writes ``$MEMBERS_OUT/rank{r}.json``; with ``MEMBERS_LIST`` (a JSON file of DeepSpeed's member
names), also classifies each on our engine."""
import json
import os
import sys

import deepspeed
import torch
import torch.distributed as dist
import torch.nn as nn
from worker_exit import end_distributed  # tests/, the folder of this script

CASES = [(1, "fp32"), (3, "fp32"), (1, "bf16"), (3, "bf16")]
STEPS = 3  # optimizer steps per case (gradient_accumulation_steps 2: 6 micro-steps)


def model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))


def config(stage, dtype, scheduler):
    cfg = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2, "steps_per_print": 1000,
           "gradient_clipping": 0.5, "wall_clock_breakdown": False,
           "optimizer": {"type": "AdamW", "params": {"lr": 0.01, "betas": [0.9, 0.99], "weight_decay": 0.0}},
           "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
           "bf16": {"enabled": dtype == "bf16"}}
    if scheduler:
        cfg["scheduler"] = {"type": "OneCycle", "params": {"cycle_min_lr": 0.001, "cycle_max_lr": 0.01,
                                                            "cycle_first_step_size": 2, "cycle_min_mom": 0.85,
                                                            "cycle_max_mom": 0.9}}
    return cfg


def batches(rank, dtype):
    g = torch.Generator().manual_seed(100 + rank)
    out = [(torch.randn(2, 8, generator=g), torch.randn(2, 4, generator=g)) for _ in range(2 * STEPS)]
    cast = torch.bfloat16 if dtype == "bf16" else torch.float32
    return [(x.to(cast), y.to(cast)) for x, y in out]


def floats(values):
    return None if values is None else [list(map(float, v)) if isinstance(v, (tuple, list)) else float(v)
                                        for v in values]


def offload_block(section):
    return None if section is None else str(getattr(section.device, "value", section.device))


def train(engine, rank, dtype):
    losses, applied = [], []
    for x, y in batches(rank, dtype):
        loss = ((engine(x.to(engine.device)) - y.to(engine.device)).float() ** 2).mean()
        engine.backward(loss)
        engine.step()
        losses.append(float(loss))
        applied.append(engine.was_step_applied())
    return losses, applied


def record(engine, stage, dtype, rank, cfg):
    r = {"local_rank": engine.local_rank, "world_size": engine.world_size, "mp_world_size": engine.mp_world_size,
         "dp_world_size": engine.dp_world_size, "global_rank": engine.global_rank,
         "fp16_enabled": engine.fp16_enabled(), "bfloat16_enabled": engine.bfloat16_enabled(),
         "zero_optimization": bool(engine.zero_optimization()), "stage": engine.zero_optimization_stage(),
         "offload_optimizer": offload_block(engine.zero_offload_optimizer()),
         "offload_param": offload_block(engine.zero_offload_param()), "zero_cpu_offload": engine.zero_cpu_offload(),
         "gradient_clipping": engine.gradient_clipping(), "steps_per_print": engine.steps_per_print(),
         "wall_clock_breakdown": engine.wall_clock_breakdown(), "loss_scale": engine.loss_scale(),
         "get_mom_before": floats(engine.get_mom()), "get_lr_before": floats(engine.get_lr()),
         "config_is_dict": isinstance(engine.config, dict), "config_same": engine.config is cfg,
         "dp_group_size": dist.get_world_size(group=engine.data_parallel_group),
         "is_compiled": engine.is_compiled, "gather_16bit": bool(engine.zero_gather_16bit_weights_on_model_save()),
         "has_overflow": hasattr(engine.optimizer, "overflow"),
         "names": [engine.optimizer_name(), engine.scheduler_name()], "was_step_applied_before": engine.was_step_applied()}
    info = engine.get_batch_info()
    r["batch_info"] = [v() if callable(v) else v for v in info]
    r["losses"], r["applied"] = train(engine, rank, dtype)
    r.update(global_steps=engine.global_steps, global_samples=engine.global_samples, micro_steps=engine.micro_steps,
             skipped_steps=engine.skipped_steps, overflow=bool(engine.optimizer.overflow),
             grad_norm=float(engine.get_global_grad_norm()), get_mom=floats(engine.get_mom()),
             get_lr=floats(engine.get_lr()))
    try:
        sd = engine._consolidated_16bit_state_dict()
        r["consolidated"] = None if sd is None else {k: v.float().sum().item() for k, v in sd.items()}
    except ValueError as e:
        r["consolidated"] = ["ValueError", str(e)]
    engine.empty_partition_cache()
    loader = engine.deepspeed_io(torch.utils.data.TensorDataset(torch.arange(12.0).view(6, 2)))
    r["io"] = [len(loader), [b[0].tolist() for b in loader]]
    path = os.path.join(os.environ["MEMBERS_OUT"], f"16bit-{stage}-{dtype}")
    try:
        r["fp16_saved"] = engine.save_fp16_model(path, "w.bin")
    except RuntimeError as e:  # ours at stage 3 without stage3_gather_16bit_weights_on_model_save
        r["fp16_saved"] = [type(e).__name__, str(e)]
    engine.set_train_batch_size(16)
    r["after_set_train_batch_size"] = [engine.train_batch_size(), engine.gradient_accumulation_steps(),
                                       engine.train_micro_batch_size_per_gpu()]
    engine.set_train_micro_batch_size(1)
    r["after_set_micro"] = [engine.train_batch_size(), engine.gradient_accumulation_steps(),
                            engine.train_micro_batch_size_per_gpu()]
    return r


def members(engine):
    """DeepSpeed's run: the engine's public members (class and instance) that nn.Module lacks."""
    base = set(dir(nn.Module))
    own = {n for n in dir(type(engine)) if not n.startswith("_")} | {n for n in vars(engine) if not n.startswith("_")}
    return sorted(own - base)


def classify(engine, names):
    """Ours: each DeepSpeed name is the engine's own ("own"), or raises the one line ("one line: ...")."""
    out = {}
    for n in names:
        if n in dir(type(engine)) or n in vars(engine) or n in engine._modules:
            out[n] = "own"
            continue
        try:
            getattr(engine, n)
            out[n] = "module fallback"
        except AttributeError as e:
            out[n] = f"{type(e).__name__}: {e}"
    return out


def main():
    deepspeed.init_distributed("gloo")
    rank = dist.get_rank()
    result = {"deepspeed": deepspeed.__version__, "cases": {}}
    for stage, dtype in CASES:
        cfg = config(stage, dtype, scheduler=(stage, dtype) == (1, "fp32"))
        engine, *_ = deepspeed.initialize(model=model(), config=cfg)
        result["cases"][f"{stage}-{dtype}"] = record(engine, stage, dtype, rank, cfg)
        if stage == 1 and dtype == "fp32":
            result["members"] = members(engine)
            if os.environ.get("MEMBERS_LIST"):
                with open(os.environ["MEMBERS_LIST"]) as f:
                    result["classified"] = classify(engine, json.load(f))
        engine.destroy()
    with open(os.path.join(os.environ["MEMBERS_OUT"], f"rank{rank}.json"), "w") as f:
        json.dump(result, f)
    dist.barrier()
    return 0


if __name__ == "__main__":
    code = main()
    end_distributed()
    sys.exit(code)
