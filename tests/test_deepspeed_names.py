"""DeepSpeed's names at DeepSpeed's module paths, inside shardspeed, against real DeepSpeed (the oracle, run on its
CPU accelerator in the same worker processes): the optimizer ops step equal (fp32, 1e-6), the loss scalers
follow the same scale sequence, ``DeepSpeedConfig`` exposes the same attributes, ``set_random_seed`` gives the
same streams, ``log_dist`` logs on the same ranks, ``zero_to_fp32`` reads DeepSpeed's checkpoints as its own
converter does (and ours), the accelerator answers as DeepSpeed's CPU accelerator. The opt-in ``deepspeed``
package resolves every name in a fresh process without touching CUDA (tests/test_deepspeed_names_package.py)."""
from __future__ import annotations

import logging
import os
from typing import Any, Dict, List

import pytest
import torch
from distributed import run_distributed

pytest.importorskip("deepspeed")
os.environ.setdefault("DS_ACCELERATOR", "cpu")

#: (class path under deepspeed./shardspeed., kwargs): every op class, its defaults and its modes
OPT_CASES = [
    ("ops.adam.FusedAdam", {}),
    ("ops.adam.FusedAdam", {"weight_decay": 0.1}),
    ("ops.adam.FusedAdam", {"adam_w_mode": False, "weight_decay": 0.1}),
    ("ops.adam.FusedAdam", {"bias_correction": False, "weight_decay": 0.1}),
    ("ops.adam.DeepSpeedCPUAdam", {}),
    ("ops.adam.DeepSpeedCPUAdam", {"weight_decay": 0.1, "betas": (0.8, 0.99)}),
    ("ops.adam.DeepSpeedCPUAdam", {"adamw_mode": False, "weight_decay": 0.1}),
    ("ops.adam.DeepSpeedCPUAdam", {"bias_correction": False}),
    ("ops.adagrad.DeepSpeedCPUAdagrad", {}),
    ("ops.adagrad.DeepSpeedCPUAdagrad", {"weight_decay": 0.1, "lr": 0.1}),
    ("ops.lion.DeepSpeedCPULion", {}),
    ("ops.lion.DeepSpeedCPULion", {"weight_decay": 0.5, "lr": 0.01}),
]

CONFIGS = [
    {"train_batch_size": 8, "gradient_accumulation_steps": 2, "fp16": {"enabled": True},
     "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}},
     "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}, "steps_per_print": 5},
    {"train_micro_batch_size_per_gpu": 3, "bf16": {"enabled": True}, "gradient_clipping": 0.5,
     "zero_optimization": {"stage": 3}, "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 5}},
     "optimizer": {"type": "Adam", "params": {"lr": 3e-4, "weight_decay": 0.01}}},
    {"train_batch_size": 4, "zero_optimization": {"stage": 0}},
]
CONFIG_ATTRS = ["train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps",
                "zero_optimization_stage", "zero_enabled", "gradient_clipping", "steps_per_print", "optimizer_name",
                "optimizer_params", "scheduler_name", "scheduler_params", "world_size", "prescale_gradients",
                "gradient_predivide_factor", "wall_clock_breakdown", "dataloader_drop_last"]


def _resolve(root: str, path: str):
    import importlib

    module, name = path.rsplit(".", 1)
    return getattr(importlib.import_module(f"{root}.{module}"), name)


def _steps(root: str, path: str, kwargs: Dict[str, Any]) -> Dict[str, Any]:
    """Three steps of the optimizer on two parameter groups (the second at another lr) with seeded gradients."""
    g = torch.Generator().manual_seed(3)
    params = [torch.nn.Parameter(torch.randn(7, 5, generator=g)), torch.nn.Parameter(torch.randn(13, generator=g))]
    opt = _resolve(root, path)([{"params": params[:1]}, {"params": params[1:], "lr": 2e-3}], **kwargs)
    for _ in range(3):
        for p in params:
            p.grad = torch.randn(p.shape, generator=g)
        opt.step()
    states = [{k: v.clone() for k, v in opt.state[p].items() if torch.is_tensor(v)} for p in params]
    return {"params": [p.detach().clone() for p in params], "states": states,
            "steps": [opt.state[p].get("step") for p in params], "groups": [sorted(gr) for gr in opt.param_groups]}


def _scalers(root: str) -> List[float]:
    loss_scaler = __import__(f"{root}.runtime.fp16.loss_scaler", fromlist=["DynamicLossScaler"])
    s = loss_scaler.DynamicLossScaler(init_scale=2 ** 8, scale_window=2, min_scale=2, delayed_shift=2,
                                      consecutive_hysteresis=False, raise_error_at_min_scale=False)
    seq = []
    for overflow in [True, True, False, False, False, True, True, True, True, True, True, False, False]:
        s.update_scale(overflow)
        seq.append(s.cur_scale)
    static = loss_scaler.LossScaler(scale=4)
    static.update_scale(True)
    return seq + [static.cur_scale, static.loss_scale, float(s.dynamic), float(static.dynamic), s.cur_hysteresis]


def _seeded(root: str) -> List[Any]:
    import random

    import numpy

    _resolve(root, "runtime.utils.set_random_seed")(2 ** 40 + 7)
    return [random.random(), float(numpy.random.rand()), torch.rand(3).tolist()]


def _logged(root: str) -> List[str]:
    """What log_dist writes, on this rank, for rank lists [0], [1], [-1], None."""
    logging_mod = __import__(f"{root}.utils.logging", fromlist=["logger"])
    logger = logging_mod.logger
    seen: List[str] = []

    class Keep(logging.Handler):
        def emit(self, record):
            seen.append(record.getMessage())

    h = Keep()
    logger.addHandler(h)
    old = logger.level
    logger.setLevel(logging.INFO)
    try:
        for ranks in ([0], [1], [-1], None):
            logging_mod.log_dist(f"hello {ranks}", ranks=ranks, level=logging.WARNING)
    finally:
        logger.removeHandler(h)
        logger.setLevel(old)
    return seen


def _configs(root: str) -> List[Dict[str, Any]]:
    cls = _resolve(root, "runtime.config.DeepSpeedConfig")
    out = []
    for cfg in CONFIGS:
        c = cls(cfg)
        row = {a: getattr(c, a) for a in CONFIG_ATTRS}
        row.update(fp16=c.float16_config.enabled, bf16=c.bfloat16_config.enabled, zstage=int(c.zero_config.stage),
                   offload=str(getattr(c.zero_config.offload_optimizer, "device", None)))
        out.append(row)
    return out


def _accelerator(root: str) -> Dict[str, Any]:
    a = _resolve(root, "accelerator.get_accelerator")()
    x = torch.ones(2)
    return {"name": a._name, "device_name": a.device_name(), "device_name1": a.device_name(1),
            "current": a.current_device_name(), "backend": a.communication_backend_name(),
            "available": a.is_available(), "bf16": a.is_bf16_supported(), "stream": a.Stream,
            "current_stream": a.current_stream(), "on": a.on_accelerator(x), "pin": a.pin_memory(x) is x,
            "push": a.range_push("x"), "pop": a.range_pop(), "sync": a.synchronize(), "int": a.IntTensor([3]).tolist(),
            "alloc": a.memory_allocated() > 0, "compat": a.create_op_builder("FusedAdamBuilder").is_compatible(),
            "same": a is _resolve(root, "accelerator.get_accelerator")()}


def _oracle_case(base: str) -> Dict[str, Any]:
    """Rank-local comparisons; both packages are imported in this worker (DeepSpeed on its CPU accelerator)."""
    import deepspeed
    import torch.distributed as dist

    if not deepspeed.comm.is_initialized():
        deepspeed.init_distributed(dist_backend="gloo")
    out: Dict[str, Any] = {"rank": dist.get_rank()}
    for root in ("deepspeed", "shardspeed"):
        out[root] = {"log": _logged(root), "configs": _configs(root), "seeded": _seeded(root),
                     "accelerator": _accelerator(root)}
        if dist.get_rank() == 0:
            out[root]["opts"] = [_steps(root, p, kw) for p, kw in OPT_CASES]
            out[root]["scalers"] = _scalers(root)
    return out


@pytest.fixture(scope="module")
def oracle(deepspeed_optimizer_ops, tmp_path_factory):
    return run_distributed(_oracle_case, 2, str(tmp_path_factory.mktemp("names")), timeout=600)


def _close(a, b) -> None:
    torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("case", range(len(OPT_CASES)), ids=[f"{p.split('.')[-1]}{kw}" for p, kw in OPT_CASES])
def test_optimizer_ops_step_as_deepspeeds(oracle, case):
    ds, ours = oracle[0]["deepspeed"]["opts"][case], oracle[0]["shardspeed"]["opts"][case]
    for a, b in zip(ours["params"], ds["params"]):
        _close(a, b)
    lion = "Lion" in OPT_CASES[case][0]
    for a, b in zip(ours["states"], ds["states"]):
        if lion:  # DeepSpeed's CPU Lion also allocates an exp_avg_sq it never uses (zeros) and counts steps
            assert sorted(a) == ["exp_avg"] and not b["exp_avg_sq"].any()
            b = {"exp_avg": b["exp_avg"]}
        assert sorted(a) == sorted(b)
        for k in a:
            _close(a[k], b[k])
    assert lion or ours["steps"] == ds["steps"]
    # DeepSpeed's group keys (ours add adamw_mode; DeepSpeed's FusedAdam also parks an unused "step": 0 there)
    assert set(ds["groups"][0]) - {"step"} <= set(ours["groups"][0])


def test_loss_scalers_follow_deepspeeds_sequence(oracle):
    assert oracle[0]["shardspeed"]["scalers"] == oracle[0]["deepspeed"]["scalers"]


def test_config_attributes_equal(oracle):
    for r in oracle:
        assert r["shardspeed"]["configs"] == r["deepspeed"]["configs"]
    assert oracle[0]["shardspeed"]["configs"][0]["world_size"] == 2  # the process group's size


def test_set_random_seed_streams_equal(oracle):
    for r in oracle:
        assert r["shardspeed"]["seeded"] == r["deepspeed"]["seeded"]


def test_log_dist_logs_on_the_same_ranks(oracle):
    assert oracle[0]["shardspeed"]["log"] == ["[Rank 0] hello [0]", "[Rank 0] hello [-1]"]
    assert oracle[1]["shardspeed"]["log"] == ["[Rank 1] hello [1]", "[Rank 1] hello [-1]"]
    for r in oracle:
        assert r["shardspeed"]["log"] == r["deepspeed"]["log"]


def test_accelerator_answers_as_deepspeeds_cpu_accelerator(oracle):
    for r in oracle:
        assert r["shardspeed"]["accelerator"] == r["deepspeed"]["accelerator"]
