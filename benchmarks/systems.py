"""The systems under test, each built from the same model, data and hyper-parameters.

A *system* is an object with ``step(x, y) -> loss`` (forward, backward, optimizer step, gradient
clipping 1.0 and AdamW everywhere) plus a few introspection helpers. Names:

- ``ddp``                       torch DistributedDataParallel (defaults: 25 MB buckets), fp32
- ``fsdp2``                     ``fully_shard`` on every block, then on the root
- ``ds0`` .. ``ds3``            DeepSpeed ZeRO stage k; ``ds2-off`` / ``ds3-off`` with CPU offload
- ``ss0`` .. ``ss3``            shardspeed stage k;   ``ss2-off`` / ``ss3-off`` with CPU offload
- ``-c`` after any of these (``ss3-c``, ``fsdp2-c``, ``ds3-c``): compiled with inductor: shardspeed's
  ``engine.compile()`` (each block's forward), FSDP2 with ``torch.compile`` of each block's forward before
  ``fully_shard`` (torchtitan's per-block compile), DeepSpeed's ``engine.compile()`` (the whole module)

All use the same optimizer kernel (torch AdamW, fused where torch has it for the tensors involved), so
differences measure the data-parallel machinery and not the optimizer arithmetic.
"""
from __future__ import annotations

import importlib.util
import inspect
import os
from typing import Any, Dict, Optional

import torch
import torch.distributed as dist

LR, WD, CLIP = 1e-3, 0.01, 1.0
BUCKET = 2_000_000  # elements, for reduce / all-gather / prefetch buckets (DeepSpeed's keys, both libraries)
PERSIST = 10_000  # stage3_param_persistence_threshold (elements)


class Skip(Exception):
    """The system cannot run here (not installed, feature not landed); the message says why."""


def ds_config(system: str, micro_batch: int, dtype: str = "fp32") -> Dict[str, Any]:
    """One DeepSpeed-format config, given unchanged to DeepSpeed and to shardspeed. Suffixes of the system's
    name: ``-off`` offloads (optimizer; parameters too at stage 3), ``-dsb`` keeps DeepSpeed's default bucket
    sizes (no bucket keys: reduce 5e8, prefetch 5e7, persistence 1e5 elements) instead of the suite's 2M,
    ``-sync`` sets ``overlap_comm`` false (gradient reductions block instead of overlapping backward); ZeRO++ at
    stage 3: ``-qw`` quantized weight gathers, ``-qg`` / ``-qg4`` quantized gradients (int8 / int4), ``-hpzK`` a
    secondary partition over K ranks."""
    stage = int(system[2])
    flags = set(system.split("-")[1:])
    zero: Dict[str, Any] = {"stage": stage, "overlap_comm": "sync" not in flags, "contiguous_gradients": True}
    if "dsb" not in flags:
        zero.update(reduce_bucket_size=BUCKET, allgather_bucket_size=BUCKET)
        if stage == 3:
            zero.update(stage3_prefetch_bucket_size=BUCKET, stage3_param_persistence_threshold=PERSIST)
    zero.update({"zero_quantized_weights": True} if "qw" in flags else {})
    zero.update({"zero_quantized_gradients": True} if flags & {"qg", "qg4"} else {})
    zero.update({"zero_quantized_gradients_bits": 4} if "qg4" in flags else {})
    for f in flags:
        if f.startswith("hpz"):
            zero["zero_hpz_partition_size"] = int(f[3:])
    if "off" in flags:
        zero["offload_optimizer"] = {"device": "cpu"}
        if stage == 3:
            zero["offload_param"] = {"device": "cpu"}
    cfg: Dict[str, Any] = {
        "train_micro_batch_size_per_gpu": micro_batch, "gradient_accumulation_steps": 1,
        "gradient_clipping": CLIP, "zero_optimization": zero, "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
    }
    if dtype == "bf16":
        cfg["bf16"] = {"enabled": True}
    return cfg


def trainable(model) -> list:
    """The parameters an optimizer gets: those with ``requires_grad`` (all of them, but for a frozen base
    model under LoRA), each once."""
    return [p for p in dict.fromkeys(model.parameters()) if p.requires_grad]


def _adamw(params, **kw) -> torch.optim.Optimizer:
    params = list(params)
    try:
        opt = torch.optim.AdamW(params, lr=LR, weight_decay=WD, fused=True, **kw)
        opt.kernel = "fused"  # type: ignore[attr-defined]
    except (RuntimeError, ValueError):
        opt = torch.optim.AdamW(params, lr=LR, weight_decay=WD, **kw)
        opt.kernel = "default"  # type: ignore[attr-defined]
    return opt


class System:
    name = "?"
    kernel = "?"

    def step(self, x, y) -> torch.Tensor:  # pragma: no cover - interface
        raise NotImplementedError

    def library_memory(self) -> Optional[Dict[str, int]]:
        return None

    def library_comms(self) -> Optional[Dict[str, Dict[str, float]]]:
        return None

    def reset_library_comms(self) -> None:
        pass

    def extra_comm_bytes(self) -> Dict[str, float]:
        """Collectives the Python-level counter cannot see (DDP's C++ reducer): op -> message bytes/step."""
        return {}


class DDPSystem(System):
    def __init__(self, model, dtype: str = "fp32"):
        from torch.nn.parallel import DistributedDataParallel as DDP

        if dtype != "fp32":
            raise Skip("DDP baseline is fp32 only in this suite")
        self.name = "ddp"
        self.model = DDP(model)
        self.opt = _adamw(trainable(self.model))
        self.kernel = self.opt.kernel

    def step(self, x, y):
        loss = self.model(x, y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), CLIP)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        return loss.detach()

    def extra_comm_bytes(self):
        data = self.model._get_ddp_logging_data()
        sizes = [int(s) for s in str(data.get("bucket_sizes", "")).split(",") if s.strip()]
        return {"all_reduce": float(sum(sizes))}


def compiled(system: str) -> bool:
    """``-c`` in the system's name: compiled with inductor."""
    return "c" in system.split("-")[1:]


class FSDP2System(System):
    def __init__(self, model, dtype: str = "fp32", system: str = "fsdp2"):
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        self.name = system
        if compiled(system):  # each block's forward, FSDP2's hooks eager around it (as shardspeed's)
            for block in model.blocks:
                block.forward = torch.compile(block.forward, backend="inductor")
        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        mp = MixedPrecisionPolicy()
        if dtype == "bf16":  # bf16 compute and bf16 reduce, fp32 sharded master (shardspeed's bf16 default)
            mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16)
        for block in model.blocks:
            fully_shard(block, mesh=mesh, mp_policy=mp)
        fully_shard(model, mesh=mesh, mp_policy=mp)
        self.model = model
        self.opt = _adamw(trainable(model))
        self.kernel = self.opt.kernel
        try:  # fused on DTensor may be refused only at the first step
            self.step_checked = False
        except Exception:
            pass

    def step(self, x, y):
        loss = self.model(x, y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), CLIP)
        try:
            self.opt.step()
        except RuntimeError:
            if self.step_checked:
                raise
            self.opt = torch.optim.AdamW(trainable(self.model), lr=LR, weight_decay=WD)
            self.kernel = "default"
            self.opt.step()
        self.step_checked = True
        self.opt.zero_grad(set_to_none=True)
        return loss.detach()


class DeepSpeedSystem(System):
    def __init__(self, model, system: str, micro_batch: int, dtype: str = "fp32"):
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
        try:
            import deepspeed  # noqa: F401
        except Exception as exc:  # not installed, or broken
            raise Skip(f"DeepSpeed not importable ({type(exc).__name__}: {exc})") from exc
        import logging

        logging.getLogger("DeepSpeed").setLevel(logging.ERROR)
        self.name = system
        cfg = ds_config(system, micro_batch, dtype)
        cfg["zero_allow_untested_optimizer"] = True
        cfg["zero_force_ds_cpu_optimizer"] = False  # offload with torch's AdamW (DeepSpeedCPUAdam needs a build)
        opt = _adamw(trainable(model))
        self.kernel = opt.kernel
        self.engine, *_ = deepspeed.initialize(model=model, optimizer=opt, config=cfg, dist_init_required=False)
        if compiled(system):
            self.engine.compile(backend="inductor")

    def step(self, x, y):
        loss = self.engine(x, y)
        self.engine.backward(loss)
        self.engine.step()
        return loss.detach()


def shardspeed_has_offload() -> bool:
    try:
        from shardspeed.runtime import builder
    except Exception:
        return False
    return "offload_optimizer" in inspect.getsource(builder) or importlib.util.find_spec("shardspeed.zero.offload") is not None


def shardspeed_has_stage3() -> bool:
    return any(importlib.util.find_spec(f"shardspeed.zero.{m}") is not None for m in ("root", "stage3"))


class ShardspeedSystem(System):
    def __init__(self, model, system: str, micro_batch: int, dtype: str = "fp32"):
        import shardspeed

        stage = int(system[2])
        if stage == 3 and not shardspeed_has_stage3():
            raise Skip("shardspeed stage 3 has not landed on this branch yet")
        if "off" in system.split("-")[1:] and not shardspeed_has_offload():
            raise Skip("shardspeed offload has not landed on this branch yet")
        self.name = system
        cfg = ds_config(system, micro_batch, dtype)
        cfg["optimizer"] = {"type": "AdamW", "params": {"lr": LR, "weight_decay": WD}}
        self.engine, *_ = shardspeed.initialize(model=model, config=cfg)
        if compiled(system):
            self.engine.compile(backend="inductor")
        opt = self.engine.optimizer
        self.kernel = "fused" if any(g.get("fused") for g in opt.param_groups) else (
            "foreach" if any(g.get("foreach") for g in opt.param_groups) else "default")

    def step(self, x, y):
        loss = self.engine(x, y)
        self.engine.backward(loss)
        self.engine.step()
        return loss.detach()

    def library_memory(self):
        return self.engine.memory_breakdown()

    def library_comms(self):
        return self.engine.comms_summary()

    def reset_library_comms(self):
        log = getattr(self.engine, "comms_logger", None)  # None: an older shardspeed of a paired run (--base)
        if log is not None:
            log.reset()


def build_system(system: str, model, micro_batch: int, dtype: str = "fp32") -> System:
    if system == "ddp":
        return DDPSystem(model, dtype)
    if system.split("-")[0] == "fsdp2":
        return FSDP2System(model, dtype, system)
    if system.startswith("ds"):
        return DeepSpeedSystem(model, system, micro_batch, dtype)
    if system.startswith("ss"):
        return ShardspeedSystem(model, system, micro_batch, dtype)
    raise ValueError(f"unknown system {system!r}")
