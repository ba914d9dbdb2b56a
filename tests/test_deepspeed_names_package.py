"""Every DeepSpeed name this slice provides imports through the opt-in ``deepspeed`` package (a fresh process,
shardspeed's site folder first on PYTHONPATH), is shardspeed's own object, and importing them all initialises
no CUDA and starts no process group; a name these modules lack fails with the one line."""
import json
import os
import subprocess
import sys

from shardspeed.compat import site_path

NAMES = {
    "deepspeed.accelerator": ["get_accelerator", "DeepSpeedAccelerator", "is_current_accelerator_supported"],
    "deepspeed.accelerator.real_accelerator": ["get_accelerator"],
    "deepspeed.ops.adam": ["FusedAdam", "DeepSpeedCPUAdam"],
    "deepspeed.ops.adam.fused_adam": ["FusedAdam"],
    "deepspeed.ops.adam.cpu_adam": ["DeepSpeedCPUAdam"],
    "deepspeed.ops.adagrad": ["DeepSpeedCPUAdagrad"],
    "deepspeed.ops.lion": ["DeepSpeedCPULion", "FusedLion"],
    "deepspeed.ops.op_builder": ["FusedAdamBuilder", "CPUAdamBuilder", "CPUAdagradBuilder", "CPULionBuilder"],
    "deepspeed": ["DeepSpeedEngine", "add_config_arguments", "initialize"],
    "deepspeed.runtime.engine": ["DeepSpeedEngine"],
    "deepspeed.runtime.base_optimizer": ["DeepSpeedOptimizer"],
    "deepspeed.runtime.utils": ["set_random_seed"],
    "deepspeed.runtime.config": ["DeepSpeedConfig"],
    "deepspeed.runtime.fp16.loss_scaler": ["DynamicLossScaler", "LossScaler"],
    "deepspeed.runtime.activation_checkpointing": ["checkpointing"],
    "deepspeed.runtime.zero.partition_parameters": ["ZeroParamStatus", "Init", "GatheredParameters"],
    "deepspeed.runtime.zero.offload_config": ["OffloadDeviceEnum", "OffloadStateTypeEnum"],
    "deepspeed.runtime.zero.config": ["ZeroStageEnum"],
    "deepspeed.runtime.lr_schedules": ["VALID_LR_SCHEDULES", "WarmupLR", "WarmupDecayLR", "WarmupCosineLR",
                                       "OneCycle", "LRRangeTest"],
    "deepspeed.utils": ["logger", "log_dist", "set_z3_leaf_modules", "get_z3_leaf_modules", "unset_z3_leaf_modules",
                        "RepeatingLoader", "groups", "zero_to_fp32", "safe_get_full_fp32_param", "safe_get_full_grad",
                        "safe_get_full_optimizer_state", "safe_set_full_fp32_param", "safe_set_full_optimizer_state"],
    "deepspeed.utils.tensor_fragment": ["safe_get_full_fp32_param", "safe_get_full_grad"],
    "deepspeed.utils.logging": ["logger", "log_dist"],
    "deepspeed.utils.zero_to_fp32": ["get_fp32_state_dict_from_zero_checkpoint",
                                     "convert_zero_checkpoint_to_fp32_state_dict",
                                     "load_state_dict_from_zero_checkpoint"],
    "deepspeed.checkpoint.utils": ["clone_tensors_for_torch_save"],
    "deepspeed.launcher.runner": ["DEEPSPEED_ENVIRONMENT_NAME"],
}

PROBE = r"""
import importlib, json, sys
names = json.loads(sys.argv[1])
out = {"same": {}, "missing": {}}
for module, attrs in names.items():
    mod = importlib.import_module(module)
    twin = importlib.import_module("shardspeed" + module[len("deepspeed"):])
    for a in attrs:
        exec(f"from {module} import {a} as _x")
        out["same"][f"{module}.{a}"] = _x is getattr(twin, a)
    try:
        getattr(mod, "no_such_name")
    except AttributeError as e:
        out["missing"][module] = str(e)
import deepspeed, shardspeed, torch
from deepspeed.runtime.engine import DeepSpeedEngine
from deepspeed.runtime.activation_checkpointing import checkpointing
out["engine_is_ours"] = DeepSpeedEngine is shardspeed.runtime.engine.Engine and deepspeed.DeepSpeedEngine is DeepSpeedEngine
out["checkpointing"] = checkpointing is shardspeed.checkpointing
out["valid"] = deepspeed.runtime.lr_schedules.VALID_LR_SCHEDULES
out["status"] = [s.name for s in deepspeed.runtime.zero.partition_parameters.ZeroParamStatus]
out["offload"] = deepspeed.runtime.zero.offload_config.OffloadDeviceEnum.cpu == "cpu"
out["env_file"] = deepspeed.launcher.runner.DEEPSPEED_ENVIRONMENT_NAME
import argparse
args = deepspeed.add_config_arguments(argparse.ArgumentParser()).parse_args(["--deepspeed", "--deepspeed_config", "c.json"])
out["args"] = [args.deepspeed, args.deepspeed_config, args.deepscale, args.deepscale_config]
deepspeed.accelerator.get_accelerator().device_name()
out["cuda"] = torch.cuda.is_initialized()
out["pg"] = torch.distributed.is_initialized()
print(json.dumps(out))
"""


def test_every_name_through_the_package():
    env = dict(os.environ, PYTHONPATH=os.pathsep.join((site_path(), os.getcwd())))
    env.pop("DS_ACCELERATOR", None)
    res = subprocess.run([sys.executable, "-c", PROBE, json.dumps(NAMES)], env=env, capture_output=True, text=True,
                         timeout=180)
    assert res.returncode == 0, res.stderr[-3000:]
    got = json.loads(res.stdout.strip().splitlines()[-1])
    assert [k for k, same in got["same"].items() if not same] == []
    assert len(got["same"]) == sum(len(v) for v in NAMES.values())
    for module, message in got["missing"].items():
        assert message == f"shardspeed's deepspeed compatibility does not provide {module}.no_such_name"
    assert sorted(got["missing"]) == sorted(NAMES)
    assert got["engine_is_ours"] and got["checkpointing"]
    assert got["valid"] == ["LRRangeTest", "OneCycle", "WarmupLR", "WarmupDecayLR", "WarmupCosineLR"]
    assert got["status"] == ["AVAILABLE", "NOT_AVAILABLE", "INFLIGHT"]
    assert got["offload"] and got["env_file"] == ".deepspeed_env"
    assert got["args"] == [True, "c.json", False, None]
    assert got["cuda"] is False and got["pg"] is False
