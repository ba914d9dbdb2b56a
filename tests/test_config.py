"""Tests of shardspeed.config: parsing, aliases, "auto", batch arithmetic and one-line errors."""
import copy
import importlib.util
import json
import logging
import os
import pathlib

import pydantic
import pytest
import torch

from shardspeed.config import (
    BF16Config,
    CommsLoggerConfig,
    FP16Config,
    OffloadOptimizerConfig,
    OffloadParamConfig,
    ShardspeedConfig,
    ZeroConfig,
    load_config,
    resolve_batch_sizes,
)
from shardspeed.config.docs import render_markdown
from shardspeed.errors import ConfigError

ROOT = pathlib.Path(__file__).resolve().parents[1]
BASE = {"train_batch_size": 8}


def cfg(**extra):
    return {**BASE, **extra}


def error_of(config, world_size=1):
    with pytest.raises(ConfigError) as info:
        load_config(config, world_size)
    message = str(info.value)
    assert "\n" not in message
    return message


# ---- unknown keys -------------------------------------------------------------------------------

def test_unknown_top_level_key_suggests_closest():
    msg = error_of(cfg(gradient_clippin=1.0))
    assert msg == "unknown key 'gradient_clippin'; did you mean 'gradient_clipping'?"


def test_unknown_nested_key_names_dotted_path_and_suggestion():
    msg = error_of(cfg(zero_optimization={"stage": 3, "stage3_prefetch_bucket_sz": 10}))
    assert msg == ("unknown key 'zero_optimization.stage3_prefetch_bucket_sz'; "
                   "did you mean 'stage3_prefetch_bucket_size'?")


def test_unknown_key_two_levels_deep():
    msg = error_of(cfg(zero_optimization={"stage": 2, "offload_optimizer": {"device": "cpu", "pin_memry": True}}))
    assert "unknown key 'zero_optimization.offload_optimizer.pin_memry'" in msg
    assert "did you mean 'pin_memory'?" in msg


def test_unknown_key_without_close_match_has_no_suggestion():
    assert error_of(cfg(zero_optimization={"xyzzy": 1})) == "unknown key 'zero_optimization.xyzzy'"


def test_top_level_key_deepspeed_never_reads_is_ignored_with_a_warning(caplog):
    """DeepSpeed's top-level parser reads known keys only: a foreign name is dropped (one warning) as there;
    a close misspelling stays the error above."""
    with caplog.at_level("WARNING", logger="shardspeed.config"):
        c = load_config(cfg(xyzzy=1))
    assert c.train_batch_size == 8
    assert [r.getMessage() for r in caplog.records] == [
        "ignoring top-level config keys DeepSpeed does not read either: 'xyzzy' (not a DeepSpeed key)"]


# ---- wrong types and ranges --------------------------------------------------------------------

def test_wrong_type_names_key_value_and_expectation():
    msg = error_of(cfg(zero_optimization={"reduce_bucket_size": "big"}))
    assert msg == 'zero_optimization.reduce_bucket_size = "big" is invalid: it must be an integer'


def test_wrong_bool():
    msg = error_of(cfg(wall_clock_breakdown="sometimes"))
    assert msg == 'wall_clock_breakdown = "sometimes" is invalid: it must be true or false'


def test_block_that_is_not_an_object():
    assert "fp16 = 3 is invalid: it must be an object" in error_of(cfg(fp16=3))


def test_negative_bucket_size():
    msg = error_of(cfg(zero_optimization={"allgather_bucket_size": -5}))
    assert msg == "zero_optimization.allgather_bucket_size = -5 is invalid: it must be > 0"


def test_zero_stage_5():
    msg = error_of(cfg(zero_optimization={"stage": 5}))
    assert msg == "zero_optimization.stage = 5 is invalid: it must be 0, 1, 2 or 3"


@pytest.mark.parametrize("key,value,expect", [
    ("gradient_clipping", -1.0, ">= 0"),
    ("train_micro_batch_size_per_gpu", 0, "> 0"),
])
def test_out_of_range_top_level(key, value, expect):
    assert f"it must be {expect}" in error_of(cfg(**{key: value}))


@pytest.mark.parametrize("key,value,expect", [("loss_scale", -1, ">= 0"), ("hysteresis", 0, ">= 1")])
def test_out_of_range_fp16(key, value, expect):
    msg = error_of(cfg(fp16={"enabled": True, key: value}))
    assert msg.startswith(f"fp16.{key} = {value} is invalid") and expect in msg


def test_bad_literal_lists_choices():
    msg = error_of(cfg(zero_optimization={"stage": 2, "offload_optimizer": {"device": "gpu"}}))
    assert msg == "zero_optimization.offload_optimizer.device = \"gpu\" is invalid: it must be one of " \
                  "'none', 'cpu' or 'nvme'"


def test_bad_communication_data_type():
    msg = error_of(cfg(communication_data_type="int8"))
    assert msg.startswith('communication_data_type = "int8" is invalid') and '"bf16"' in msg


def test_several_problems_reported_as_first_plus_count():
    msg = error_of(cfg(steps_per_print="x", wall_clock_breakdown="maybe"))
    assert msg.endswith("(and 1 more problem)")


# ---- cross-field checks ------------------------------------------------------------------------

def test_fp16_and_bf16_both_enabled():
    msg = error_of(cfg(fp16={"enabled": True}, bf16={"enabled": True}))
    assert "fp16.enabled and bf16.enabled are both true" in msg


def test_max_grad_norm_in_optimizer_params():
    msg = error_of(cfg(optimizer={"type": "AdamW", "params": {"lr": 1e-3, "max_grad_norm": 1.0}}))
    assert "'optimizer.params.max_grad_norm'" in msg and "gradient_clipping" in msg


def test_amp_refused():
    assert "use \"bf16\" or \"fp16\"" in error_of(cfg(amp={"enabled": True}))


def test_elasticity_refused():
    assert error_of(cfg(elasticity={"enabled": True})).startswith("'elasticity': elastic training is not")


def test_offload_param_below_stage_3_is_dropped():  # as DeepSpeed: see tests/test_deepspeed_configs.py
    c = load_config(cfg(zero_optimization={"stage": 2, "offload_param": {"device": "cpu"}}))
    assert c.zero_optimization.offload_param is None and c.zero_optimization.offload_param_device == "none"


def test_nvme_needs_path():
    msg = error_of(cfg(zero_optimization={"stage": 3, "offload_param": {"device": "nvme"}}))
    assert "zero_optimization.offload_param: device \"nvme\" needs nvme_path" in msg


def test_alias_and_canonical_both_given():
    msg = error_of(cfg(zero_optimization={"stage3_max_live_parameters": 1, "max_live_parameters": 2}))
    assert "'zero_optimization.stage3_max_live_parameters' and 'zero_optimization.max_live_parameters'" in msg


def test_unimplemented_block_refused_unless_disabled():
    assert "does not implement" in error_of(cfg(hybrid_engine={"enabled": True}))
    load_config(cfg(hybrid_engine={"enabled": False}))


def test_unsupported_value():
    assert "not supported" in error_of(cfg(gradient_allreduce_op="sum"))


# ---- batch arithmetic --------------------------------------------------------------------------

def test_inconsistent_batch_trio():
    msg = error_of({"train_batch_size": 32, "train_micro_batch_size_per_gpu": 4,
                    "gradient_accumulation_steps": 2}, world_size=2)
    assert msg == ("train_batch_size (32) != train_micro_batch_size_per_gpu (4) × gradient_accumulation_steps "
                   "(2) × data-parallel size (2) = 16")


def test_batch_not_divisible():
    msg = error_of({"train_batch_size": 30, "train_micro_batch_size_per_gpu": 4}, world_size=2)
    assert msg == "train_batch_size 30 is not divisible by train_micro_batch_size_per_gpu 4 × world size 2 = 8"


@pytest.mark.parametrize("given,world,expected", [
    ((32, 4, 2), 4, (32, 4, 2)),        # all three, consistent
    ((32, 4, None), 2, (32, 4, 4)),     # train + micro -> gas
    ((32, None, 2), 4, (32, 4, 2)),     # train + gas -> micro
    ((None, 4, 2), 3, (24, 4, 2)),      # micro + gas -> train
    ((32, None, None), 4, (32, 8, 1)),  # only train
    ((None, 4, None), 3, (12, 4, 1)),   # only micro
])
def test_batch_derivation_rules(given, world, expected):
    assert resolve_batch_sizes(*given, world) == expected


def test_batch_none_given():
    with pytest.raises(ConfigError, match="set train_batch_size or train_micro_batch_size_per_gpu"):
        resolve_batch_sizes(None, None, 4, 1)


@pytest.mark.parametrize("given,msg", [
    ((32, None, 3), "train_batch_size 32 is not divisible by gradient_accumulation_steps 3 × world size 2 = 6"),
    ((30, None, None), "train_batch_size 30 is not divisible by world size 4"),
])
def test_batch_divisibility_of_other_pairs(given, msg):
    with pytest.raises(ConfigError) as info:
        resolve_batch_sizes(*given, 2 if given[2] else 4)
    assert str(info.value) == msg


def test_loaded_config_can_be_reresolved_for_another_world_size():
    one = load_config({"train_batch_size": 32})
    assert (one.train_micro_batch_size_per_gpu, one.gradient_accumulation_steps) == (32, 1)
    four = load_config(one, world_size=4)
    assert (four.train_batch_size, four.train_micro_batch_size_per_gpu) == (32, 8)


# ---- auto ---------------------------------------------------------------------------------------

def test_auto_resolved_where_derivable():
    c = load_config({"train_batch_size": "auto", "train_micro_batch_size_per_gpu": 4,
                     "gradient_accumulation_steps": "auto", "gradient_clipping": "auto",
                     "fp16": {"enabled": "auto"}, "bf16": {"enabled": "auto"},
                     "zero_optimization": {"stage": 3, "reduce_bucket_size": "auto",
                                           "stage3_prefetch_bucket_size": "auto",
                                           "stage3_param_persistence_threshold": "auto"}}, world_size=2)
    assert (c.train_batch_size, c.train_micro_batch_size_per_gpu, c.gradient_accumulation_steps) == (8, 4, 1)
    assert c.gradient_clipping == 1.0 and not c.fp16.enabled and not c.bf16.enabled
    z = c.zero_optimization
    assert (z.reduce_bucket_size, z.prefetch_bucket_size, z.param_persistence_threshold) == (
        500_000_000, 50_000_000, 100_000)


def test_auto_unresolvable_names_key():
    msg = error_of(cfg(optimizer={"type": "AdamW", "params": {"lr": "auto"}}))
    assert msg.startswith("'optimizer.params.lr' is \"auto\"") and "must fill in" in msg
    msg = error_of(cfg(fp16={"enabled": True, "loss_scale_window": "auto"}))
    assert msg.startswith("'fp16.loss_scale_window' is \"auto\"")


def test_auto_batch_sizes_unresolvable():
    msg = error_of({"train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto"})
    assert "'train_batch_size' and 'train_micro_batch_size_per_gpu' are \"auto\"" in msg


# ---- aliases ------------------------------------------------------------------------------------

def test_bfloat16_alias():
    c = load_config(cfg(bfloat16={"enabled": True}))
    assert c.bf16.enabled and c.train_dtype == torch.bfloat16 and c.comm_dtype == torch.bfloat16


def test_stage3_prefix_alias():
    z = load_config(cfg(zero_optimization={"stage": 3, "stage3_max_live_parameters": 123,
                                           "stage3_gather_16bit_weights_on_model_save": True})).zero_optimization
    assert z.max_live_parameters == 123 and z.gather_16bit_weights_on_model_save


def test_stage3_gather_fp16_alias():
    z = load_config(cfg(zero_optimization={"stage3_gather_fp16_weights_on_model_save": True})).zero_optimization
    assert z.gather_16bit_weights_on_model_save


def test_cpu_offload_aliases():
    z = load_config(cfg(zero_optimization={"stage": 3, "cpu_offload": True,
                                           "cpu_offload_param": True})).zero_optimization
    assert z.offload_optimizer.device == "cpu" and z.offload_param.device == "cpu"
    assert z.offload_optimizer_device == "cpu" and z.offload_param_device == "cpu"


@pytest.mark.parametrize("value,stage", [(True, 1), (False, 0)])
def test_zero_optimization_bool(value, stage):
    assert load_config(cfg(zero_optimization=value)).zero_optimization.stage == stage


def test_aio_thread_count_alias():
    assert load_config(cfg(aio={"thread_count": 4})).aio.intra_op_parallelism == 4


@pytest.mark.parametrize("spelling,dtype", [("fp16", torch.float16), ("FP16", torch.float16),
                                            ("bfloat16", torch.bfloat16), ("float32", torch.float32)])
def test_communication_data_type_spellings(spelling, dtype):
    c = load_config(cfg(communication_data_type=spelling))
    assert c.comm_dtype == dtype and c.communication_data_type in ("fp16", "bf16", "fp32")


def test_tag_validation_case_insensitive():
    assert load_config(cfg(checkpoint={"tag_validation": "Fail"})).checkpoint.tag_validation == "FAIL"


# ---- defaults and resolved values ---------------------------------------------------------------

def test_defaults():
    c = load_config(cfg())
    assert c.gradient_clipping == 1.0 and c.steps_per_print is None and not c.wall_clock_breakdown
    assert c.gradient_predivide_factor == 1.0 and c.communication_data_type is None
    assert c.train_dtype == torch.float32 and c.comm_dtype == torch.float32
    assert c.optimizer is None and c.scheduler is None
    assert c.comms_logger.prof_all and c.comms_logger.prof_ops == []
    assert c.data_types.grad_accum_dtype is None


@pytest.mark.parametrize("stage,overlap", [(0, False), (1, False), (2, False), (3, True)])
def test_overlap_comm_resolved(stage, overlap):
    assert load_config(cfg(zero_optimization={"stage": stage})).zero_optimization.overlap_comm is overlap


def test_overlap_comm_explicit():
    assert load_config(cfg(zero_optimization={"stage": 3, "overlap_comm": False})).zero_optimization.overlap_comm \
        is False


def test_config_is_frozen():
    c = load_config(cfg())
    with pytest.raises(pydantic.ValidationError):
        c.gradient_clipping = 2.0


def test_ignored_key_warns(caplog):
    with caplog.at_level(logging.WARNING, logger="shardspeed.config"):
        load_config(cfg(disable_allgather=True, zero_optimization={"round_robin_gradients": True}))
    text = caplog.text
    assert "'disable_allgather' = true" in text and "'zero_optimization.round_robin_gradients'" in text


def test_input_dict_not_mutated():
    raw = {"train_batch_size": "auto", "train_micro_batch_size_per_gpu": 2, "bfloat16": {"enabled": True},
           "zero_optimization": {"stage": 3, "cpu_offload": True, "stage3_prefetch_bucket_size": "auto"}}
    before = copy.deepcopy(raw)
    load_config(raw, world_size=2)
    assert raw == before


# ---- load_config inputs -------------------------------------------------------------------------

def test_none_config():
    assert "a config is required" in error_of(None)


def test_missing_file(tmp_path):
    path = tmp_path / "x.json"
    assert error_of(str(path)) == f"config file '{path}' does not exist"


def test_malformed_json(tmp_path):
    path = tmp_path / "bad.json"
    path.write_text('{\n  "train_batch_size": 8,\n  "fp16": {"enabled": true]\n}\n')  # neither JSON nor hjson
    msg = error_of(path)
    assert msg.startswith(f"config file '{path}' is not valid JSON") and "line 3, column" in msg


def test_duplicate_key_in_file(tmp_path):
    path = tmp_path / "dup.json"
    path.write_text('{"train_batch_size": 8, "train_batch_size": 16}')
    assert "has the key 'train_batch_size' twice" in error_of(path)


def test_path_and_pathlike(tmp_path):
    path = tmp_path / "ok.json"
    path.write_text(json.dumps({"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 3}))
    for arg in (path, str(path)):
        c = load_config(arg, world_size=2)
        assert (c.train_batch_size, c.train_micro_batch_size_per_gpu, c.gradient_accumulation_steps) == (12, 2, 3)


# ---- configs from DeepSpeed's docs load unchanged -----------------------------------------------

ZERO3_OFFLOAD = {
    "train_batch_size": 64, "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 8,
    "steps_per_print": 2000, "wall_clock_breakdown": False,
    "optimizer": {"type": "Adam", "params": {"lr": 0.001, "betas": [0.8, 0.999], "eps": 1e-8,
                                             "weight_decay": 3e-7}},
    "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0, "warmup_max_lr": 0.001,
                                                 "warmup_num_steps": 1000}},
    "fp16": {"enabled": True, "loss_scale": 0, "loss_scale_window": 1000, "initial_scale_power": 16,
             "hysteresis": 2, "min_loss_scale": 1},
    "zero_optimization": {
        "stage": 3, "contiguous_gradients": True, "stage3_max_live_parameters": 1e9,
        "stage3_max_reuse_distance": 1e9, "stage3_prefetch_bucket_size": 1e7,
        "stage3_param_persistence_threshold": 1e5, "reduce_bucket_size": 1e7,
        "sub_group_size": 1e9,
        "offload_optimizer": {"device": "cpu", "pin_memory": True},
        "offload_param": {"device": "nvme", "nvme_path": "/local_nvme", "pin_memory": True,
                          "buffer_count": 5, "buffer_size": 1e8, "max_in_cpu": 1e9},
    },
    "aio": {"block_size": 1048576, "queue_depth": 8, "thread_count": 1, "single_submit": False,
            "overlap_events": True},
}

FP16_STATIC = {
    "train_batch_size": 8, "gradient_accumulation_steps": 1,
    "optimizer": {"type": "Adam", "params": {"lr": 0.00015}},
    "fp16": {"enabled": True, "auto_cast": False, "loss_scale": 128, "initial_scale_power": 16,
             "loss_scale_window": 1000, "hysteresis": 2, "consecutive_hysteresis": False, "min_loss_scale": 1},
    "zero_optimization": {"stage": 2, "allgather_partitions": True, "allgather_bucket_size": 5e8,
                          "overlap_comm": True, "reduce_scatter": True, "reduce_bucket_size": 5e8,
                          "contiguous_gradients": True, "cpu_offload": True},
    "gradient_clipping": 1.0, "prescale_gradients": False,
    "tensorboard": {"enabled": True, "output_path": "output/ds_logs/", "job_name": "train_bert"},
    "csv_monitor": {"enabled": True, "output_path": "output/ds_logs/", "job_name": "train_bert"},
    "wandb": {"enabled": True, "group": "my_group", "team": "my_team", "project": "my_project"},
    "flops_profiler": {"enabled": True, "profile_step": 1, "module_depth": -1, "top_modules": 1,
                       "detailed": True, "output_file": None},
    "comms_logger": {"enabled": True, "verbose": False, "prof_all": True, "debug": False},
    "activation_checkpointing": {"partition_activations": False, "cpu_checkpointing": False,
                                 "contiguous_memory_optimization": False, "number_checkpoints": None,
                                 "synchronize_checkpoint_boundary": False, "profile": False},
    "checkpoint": {"tag_validation": "Warn", "load_universal": False, "use_node_local_storage": False,
                   "parallel_write": {"pipeline_stage": False}},
    "data_types": {"grad_accum_dtype": "fp32"},
}

HF_AUTO_ZERO3 = {
    "fp16": {"enabled": "auto", "loss_scale": 0, "loss_scale_window": 1000, "initial_scale_power": 16,
             "hysteresis": 2, "min_loss_scale": 1},
    "bf16": {"enabled": "auto"},
    "zero_optimization": {
        "stage": 3, "offload_optimizer": {"device": "cpu", "pin_memory": True},
        "offload_param": {"device": "cpu", "pin_memory": True}, "overlap_comm": True,
        "contiguous_gradients": True, "sub_group_size": 1e9, "reduce_bucket_size": "auto",
        "stage3_prefetch_bucket_size": "auto", "stage3_param_persistence_threshold": "auto",
        "stage3_max_live_parameters": 1e9, "stage3_max_reuse_distance": 1e9,
        "stage3_gather_16bit_weights_on_model_save": True},
    "gradient_accumulation_steps": "auto", "gradient_clipping": "auto", "steps_per_print": 2000,
    "train_batch_size": "auto", "train_micro_batch_size_per_gpu": 16, "wall_clock_breakdown": False,
}


@pytest.mark.parametrize("raw", [ZERO3_OFFLOAD, FP16_STATIC, HF_AUTO_ZERO3], ids=["zero3", "fp16", "hf"])
def test_deepspeed_doc_configs_load(raw):
    c = load_config(raw, world_size=2)
    assert c.train_batch_size == c.train_micro_batch_size_per_gpu * c.gradient_accumulation_steps * 2


def test_zero3_offload_values():
    c = load_config(ZERO3_OFFLOAD, world_size=2)
    z = c.zero_optimization
    assert z.stage == 3 and z.overlap_comm and z.prefetch_bucket_size == 10_000_000
    assert z.offload_param.device == "nvme" and z.offload_param.buffer_size == 100_000_000
    assert c.fp16.enabled and c.train_dtype == torch.float16 and c.optimizer.type == "Adam"
    assert c.scheduler.params["warmup_num_steps"] == 1000


def test_fp16_static_values():
    c = load_config(FP16_STATIC)
    assert c.fp16.loss_scale == 128.0 and c.zero_optimization.offload_optimizer.device == "cpu"
    assert c.checkpoint.tag_validation == "WARN" and c.data_types.grad_accum_dtype == "fp32"


# ---- docs ---------------------------------------------------------------------------------------

def test_docs_up_to_date():
    committed = (ROOT / "docs" / "config.md").read_text(encoding="utf-8")
    assert committed == render_markdown(), "run: python -m shardspeed.config.docs > docs/config.md"


def test_every_field_documented():
    def walk(model):
        for name, info in model.model_fields.items():
            assert info.description, f"{model.__name__}.{name} has no description"
    for model in (ShardspeedConfig, ZeroConfig, FP16Config, BF16Config, OffloadOptimizerConfig,
                  OffloadParamConfig, CommsLoggerConfig):
        walk(model)


# ---- DeepSpeed's own defaults (skipped when deepspeed is not installed) ---------------------------

@pytest.fixture(scope="module")
def ds():
    if importlib.util.find_spec("deepspeed") is None:
        pytest.skip("deepspeed is not installed")
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    try:
        from deepspeed.comm.config import CommsLoggerConfig as DSComms
        from deepspeed.runtime import constants as C
        from deepspeed.runtime.precision_config import DeepSpeedBF16Config, DeepSpeedFP16Config
        from deepspeed.runtime.zero.config import DeepSpeedZeroConfig
        from deepspeed.runtime.zero.offload_config import (
            DeepSpeedZeroOffloadOptimizerConfig,
            DeepSpeedZeroOffloadParamConfig,
        )
    except Exception as e:  # a broken install is not our bug
        pytest.skip(f"deepspeed cannot be imported: {e}")
    return {"zero": (DeepSpeedZeroConfig(), ZeroConfig()), "fp16": (DeepSpeedFP16Config(), FP16Config()),
            "bf16": (DeepSpeedBF16Config(), BF16Config()),
            "offload_optimizer": (DeepSpeedZeroOffloadOptimizerConfig(), OffloadOptimizerConfig()),
            "offload_param": (DeepSpeedZeroOffloadParamConfig(), OffloadParamConfig()),
            "comms": (DSComms(), CommsLoggerConfig()), "constants": C}


@pytest.mark.parametrize("block", ["zero", "fp16", "bf16", "offload_optimizer", "offload_param", "comms"])
def test_block_defaults_match_deepspeed(ds, block):
    theirs, ours = ds[block]
    common = set(type(theirs).model_fields) & set(type(ours).model_fields)
    skip = {"overlap_comm", "leaf_module", "nvme_path", "device"}  # resolved / typed differently
    assert len(common) >= 5
    for name in sorted(common - skip):
        mine, other = getattr(ours, name), getattr(theirs, name)
        assert mine == other, f"{block}.{name}: ours {mine!r}, DeepSpeed {other!r}"
    if "device" in common:
        assert str(getattr(theirs.device, "value", theirs.device)) == ours.device


def test_overlap_comm_matches_deepspeed(ds):
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig
    for stage in range(4):
        assert DeepSpeedZeroConfig(stage=stage).overlap_comm == ZeroConfig(stage=stage).overlap_comm


def test_top_level_defaults_match_deepspeed(ds):
    C = ds["constants"]
    ours = load_config(cfg())
    assert ours.gradient_clipping == C.GRADIENT_CLIPPING_DEFAULT
    assert ours.steps_per_print == C.STEPS_PER_PRINT_DEFAULT
    assert ours.wall_clock_breakdown == C.WALL_CLOCK_BREAKDOWN_DEFAULT
    assert ours.prescale_gradients == C.PRESCALE_GRADIENTS_DEFAULT
    assert ours.gradient_predivide_factor == C.GRADIENT_PREDIVIDE_FACTOR_DEFAULT
    assert ours.communication_data_type == C.COMMUNICATION_DATA_TYPE_DEFAULT
    assert ours.zero_allow_untested_optimizer == C.ZERO_ALLOW_UNTESTED_OPTIMIZER_DEFAULT
    assert ours.dataloader_drop_last == C.DATALOADER_DROP_LAST_DEFAULT
    assert ours.checkpoint.tag_validation == C.CHECKPOINT_TAG_VALIDATION_DEFAULT
