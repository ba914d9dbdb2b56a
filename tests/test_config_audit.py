"""Nothing enabled in a config is silently ignored (issue 15).

Walks `ShardspeedConfig`'s schema:
- every block with an `enabled` key is in `shardspeed.config.IMPLEMENTED_BLOCKS`, and building an engine
  with it enabled reads its `enabled` (checked by recording attribute reads on the block), or enabling
  it is refused at load;
- every key marked `not_implemented` is refused (ConfigError naming the key, "not implemented yet") at any
  value but its default, and loads at its default;
- every key marked `ignored` is one reviewed below as a harmless compatibility no-op;
- the unimplemented feature blocks are refused when enabled and load when `{"enabled": false}`;
- the example configs and DeepSpeed's sample configs still load.
"""
from __future__ import annotations

import json
import pathlib
import typing
from typing import Any, Dict, Iterator, Tuple, Type

import pytest
import torch

from shardspeed.config import IMPLEMENTED_BLOCKS, ShardspeedConfig, load_config
from shardspeed.config.base import ConfigModel, field_marker
from shardspeed.config.docs import _sub_model
from shardspeed.config.models import _UNIMPLEMENTED_BLOCKS
from shardspeed.errors import ConfigError, ShardspeedError

ROOT = pathlib.Path(__file__).resolve().parents[1]
BASE: Dict[str, Any] = {"train_micro_batch_size_per_gpu": 2,
                        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}}

# Implemented on the monitor and flops-profiler branches of issue 15: until they are merged, nothing on
# this branch reads them. The lead empties this set at merge (the xfail is strict: a read makes it fail).
AWAITING_MERGE: set = set()  # blocks whose implementation was on another branch (all merged now)

# Keys accepted and ignored, each reviewed: none changes the results or what a run writes.
HARMLESS_NO_OPS = {
    "seq_parallel_communication_data_type": "sequence parallelism is only size 1 here",
    "disable_allgather": "legacy DeepSpeed flag with no effect there either",
    "sparse_gradients": "dense reduction gives the same gradients",
    "disable_python_gc": "DeepSpeed performance knob",
    "zero_force_ds_cpu_optimizer": "relaxes a DeepSpeed-only check",
    "vocabulary_size": "DeepSpeed only warns on it",
    "log_level": "DeepSpeed's own logger",
    "use_data_before_expert_parallelism": "MoE process-group order; no MoE here",
    "optimizer.legacy_fusion": "legacy fused fp16 optimizer (performance)",
    "checkpoint.checkpoint_serialization": "torch.save format detail",
    "checkpoint.writer": "DeepSpeed's fast checkpoint writer (performance; same files' content)",
    "bf16.immediate_grad_update": "DeepSpeed bf16 optimizer scheduling (performance)",
    "zero_optimization.round_robin_gradients": "copy order (performance)",
    "zero_optimization.use_multi_rank_bucket_allreduce": "collective merging (performance)",
    "zero_optimization.compute_grad_norm": "the norm is always computed (clipping, overflow check)",
    "zero_optimization.elastic_checkpoint": "legacy; checkpoints load at any world size here",
    "zero_optimization.cpu_offload_use_pin_memory": "deprecated; the offload blocks' pin_memory is read",
    "zero_optimization.module_granularity_threshold": "stage-3 fetch granularity (performance)",
    "zero_optimization.use_all_reduce_for_fetch_params": "stage-3 fetch collective (performance)",
    "zero_optimization.allgather_sequential": "stage-3 fetch order (performance)",
    "zero_optimization.legacy_stage1": "legacy implementation switch",
    "zero_optimization.parameter_alignment": "buffer alignment (performance)",
    "zero_optimization.memory_efficient_linear": "stage-3 linear implementation (performance)",
    "zero_optimization.pipeline_loading_checkpoint": "stage-3 checkpoint loading (performance)",
    "zero_optimization.override_module_apply": "stage-3 implementation detail",
    "zero_optimization.log_trace_cache_warnings": "DeepSpeed trace-cache warnings",
    "zero_optimization.enable_sanity_checks": "DeepSpeed internal checks",
    "zero_optimization.save_muon_momentum_buffer_in_memory": "Muon with NVMe (performance)",
    "zero_optimization.leaf_module": "stage-3 fetch granularity (performance)",
    "zero_optimization.offload_optimizer.fast_init": "NVMe initialisation speed",
    "zero_optimization.offload_optimizer.super_offload": "Superchip offload path (performance)",
    "zero_optimization.offload_optimizer.cpuadam_cores_perc": "CPU Adam threads (performance)",
    "autotuning.model_info_path": "DeepSpeed's profile-run output; the metrics file carries num_params",
    "autotuning.model_info": "DeepSpeed's hints for its tuner; the calibration runs measure the model",
    "autotuning.num_tuning_micro_batch_sizes": "every micro-batch in range is predicted (a superset)",
    "aio.use_gds": "GPUDirect Storage (performance)",
    "aio.block_size": "libaio request size (performance; tiles are streamed with preadv/pwritev)",
    "aio.queue_depth": "libaio requests in flight (performance)",
    "aio.intra_op_parallelism": "libaio threads (performance; one reader and one writer thread)",
    "aio.single_submit": "libaio submission mode (performance)",
    "aio.overlap_events": "libaio submission overlap (performance)",
    "pipeline.partition": "performance only; PipelineModule(partition_method=) decides, as in DeepSpeed",
    "pipeline.seed_layers": "PipelineModule(seed_layers=) decides, as in DeepSpeed (whose engine ignores it)",
    "pipeline.activation_checkpoint_interval": "recomputation only; PipelineModule's argument decides",
    "pipeline.pipe_partitioned": "activation transfer volume under tensor parallelism (performance)",
    "pipeline.grad_partitioned": "gradient transfer volume under tensor parallelism (performance)",
    "pipeline.use_reentrant": "which checkpointing implementation recomputes (same results)",
    "tensor_parallel.dtype": "applies to tensor-parallel layers (refused when asked for)",
    "tensor_parallel.tp_overlap_comm": "applies to tensor-parallel layers (refused when asked for)",
    "tensor_parallel.keep_module_on_host": "applies to tensor-parallel layers (refused when asked for)",
    "tensor_parallel.vocab_parallel_ce_backend": "applies to tensor-parallel layers (refused when asked for)",
}


def _walk(model: Type[ConfigModel] = ShardspeedConfig, prefix: str = "") -> Iterator[Tuple[str, Type[ConfigModel], str]]:
    """(dotted key, block class, field name) for every key, depth first."""
    for name, info in model.model_fields.items():
        yield prefix + name, model, name
        sub = _sub_model(info.annotation)
        if sub is not None:
            yield from _walk(sub, f"{prefix}{name}.")


def _blocks() -> Dict[str, Type[ConfigModel]]:
    out: Dict[str, Type[ConfigModel]] = {}
    for dotted, model, name in _walk():
        sub = _sub_model(model.model_fields[name].annotation)
        if sub is not None:
            out[dotted] = sub
    return out


ENABLED_BLOCKS = sorted(path for path, block in _blocks().items() if "enabled" in block.model_fields)


def _nested(dotted: str, value: Any) -> Dict[str, Any]:
    out: Dict[str, Any] = {}
    node = out
    parts = dotted.split(".")
    for part in parts[:-1]:
        node[part] = {}
        node = node[part]
    node[parts[-1]] = value
    return out


def _config(dotted: str, value: Any) -> Dict[str, Any]:
    cfg = json.loads(json.dumps(BASE))
    head, *rest = dotted.split(".")
    if rest and isinstance(cfg.get(head), dict):
        cfg[head].update(_nested(".".join(rest), value))
    else:
        cfg.update(_nested(dotted, value))
    if dotted.startswith("zero_optimization.offload_optimizer."):
        cfg["zero_optimization"]["stage"] = 1
    return cfg


def _other_value(model: Type[ConfigModel], name: str) -> Any:
    """A valid value for the key that is not its default."""
    info = model.model_fields[name]
    default = info.get_default(call_default_factory=True)
    candidates = {bool: lambda: not default, int: lambda: (default or 0) + 2, float: lambda: (default or 0) / 2 or 0.5,
                  str: lambda: "x", dict: lambda: {"x": 1}, list: lambda: ["x"]}
    stack = [info.annotation]
    while stack:
        ann = stack.pop(0)
        origin, args = typing.get_origin(ann), typing.get_args(ann)
        if origin is typing.Union:
            stack[:0] = [a for a in args if a is not type(None)]
        elif origin is typing.Literal:
            for a in args:
                if a != default:
                    return a
        elif origin in (list, dict):
            return candidates[origin]()
        elif ann in candidates:
            return candidates[ann]()
    raise AssertionError(f"no non-default value for {model.__name__}.{name}")


def _keys_marked(marker: str):
    return [(dotted, model, name) for dotted, model, name in _walk() if field_marker(model, name, marker)]


# ---- blocks with an `enabled` key ---------------------------------------------------------------

def test_enabled_blocks_found():
    assert {"fp16", "bf16", "comms_logger", "tensorboard", "csv_monitor", "wandb", "comet",
            "flops_profiler", "activation_checkpointing"} <= set(ENABLED_BLOCKS)


@pytest.mark.parametrize("block", ENABLED_BLOCKS)
def test_enabled_block_is_implemented_or_refused(block):
    if block in IMPLEMENTED_BLOCKS:
        return  # proven read by test_implemented_block_is_read
    with pytest.raises(ConfigError, match=rf"'{block}.*not implemented yet"):
        load_config(_config(f"{block}.enabled", True))


def test_registry_names_real_blocks():
    assert set(IMPLEMENTED_BLOCKS) <= set(ENABLED_BLOCKS)


@pytest.fixture(scope="module")
def process_group():
    import torch.distributed as dist

    created = not dist.is_initialized()
    yield
    if created and dist.is_initialized():
        dist.destroy_process_group()


def _enabled_reads(block: str, monkeypatch, tmp_path) -> bool:
    """Build an engine (world 1) with `block` enabled; was the block's `enabled` read after loading?"""
    import shardspeed

    cfg = _config(f"{block}.enabled", True)
    for key in ("output_path",):
        if key in _blocks()[block].model_fields:
            cfg[block][key] = str(tmp_path)
    loaded = load_config(cfg)  # loading itself reads nothing that counts
    cls = _blocks()[block]
    reads = []

    def recording(self, name, _orig=cls.__getattribute__):
        if name == "enabled":
            reads.append(name)
        return _orig(self, name)

    monkeypatch.setattr(cls, "__getattribute__", recording)
    monkeypatch.chdir(tmp_path)
    try:
        shardspeed.initialize(model=torch.nn.Linear(4, 4), config=loaded)
    except (ShardspeedError, ImportError):
        pass  # e.g. a monitor whose package is missing: it was still read
    return bool(reads)


@pytest.mark.parametrize("block", [
    pytest.param(b, marks=pytest.mark.xfail(strict=True, reason="implemented on another issue-15 branch"))
    if b in AWAITING_MERGE else b for b in sorted(IMPLEMENTED_BLOCKS)])
def test_implemented_block_is_read(block, monkeypatch, tmp_path, process_group):
    assert _enabled_reads(block, monkeypatch, tmp_path), f"nothing reads {block}.enabled when an engine is built"


@pytest.mark.parametrize("block", _UNIMPLEMENTED_BLOCKS)
def test_unimplemented_feature_block_refused_when_enabled(block):
    with pytest.raises(ConfigError, match=rf"'{block}'"):
        load_config(dict(BASE, **{block: {"enabled": True}}))
    load_config(dict(BASE, **{block: {"enabled": False}}))


@pytest.mark.parametrize("block", ["compression_training", "curriculum_learning", "progressive_layer_drop",
                                   "sparse_attention", "eigenvalue", "quantize_training"])
def test_removed_feature_blocks_refused(block):
    with pytest.raises(ConfigError, match=rf"'{block}'"):
        load_config(dict(BASE, **{block: {"enabled": True}}))


# ---- keys ---------------------------------------------------------------------------------------

NOT_IMPLEMENTED = _keys_marked("not_implemented")


def test_not_implemented_keys_found():
    keys = {dotted for dotted, _, _ in NOT_IMPLEMENTED}
    assert {"expert_parallel.route_scale"} <= keys
    # issue 40 implemented these (or refuses them by name where DeepSpeed does): no longer not_implemented
    assert not keys & {"fp16.fp16_master_weights_and_grads", "bf16.bf16_master_weights_and_grads",
                       "bf16.bf16_optimizer_states", "data_types.param_dtype", "data_types.buffer_dtype"}


@pytest.mark.parametrize("dotted,model,name", NOT_IMPLEMENTED, ids=[d for d, _, _ in NOT_IMPLEMENTED])
def test_not_implemented_key_refused_unless_default(dotted, model, name):
    with pytest.raises(ConfigError) as info:
        load_config(_config(dotted, _other_value(model, name)))
    message = str(info.value)
    assert f"'{dotted}'" in message and "is not implemented yet" in message and "\n" not in message
    default = model.model_fields[name].get_default(call_default_factory=True)
    load_config(_config(dotted, default))


IGNORED = [(d, m, n) for d, m, n in _keys_marked("ignored") if d.split(".")[0] not in AWAITING_MERGE]


def test_ignored_keys_are_reviewed_no_ops():
    keys = {dotted for dotted, _, _ in IGNORED}
    assert keys - set(HARMLESS_NO_OPS) == set(), "ignored keys not reviewed: implement, refuse, or justify"
    assert set(HARMLESS_NO_OPS) - keys == set(), "reviewed keys no longer ignored: drop them from the list"


@pytest.mark.parametrize("dotted,model,name", IGNORED, ids=[d for d, _, _ in IGNORED])
def test_ignored_key_loads_when_set(dotted, model, name):
    load_config(_config(dotted, _other_value(model, name)))


def test_no_key_both_ignored_and_refused():
    for dotted, model, name in _walk():
        assert not (field_marker(model, name, "ignored") and field_marker(model, name, "not_implemented")), dotted


# ---- configs that merely carry blocks at their defaults still load --------------------------------

@pytest.mark.parametrize("path", sorted((ROOT / "examples" / "configs").glob("*.json")), ids=lambda p: p.name)
def test_example_configs_load(path, tmp_path):
    raw = json.loads(path.read_text())
    if '"auto"' in path.read_text() and "optimizer" in raw and raw["optimizer"]["params"].get("lr") == "auto":
        # a config for ShardspeedTrainer: transformers fills its "auto" values first (as it does for DeepSpeed)
        pytest.importorskip("transformers")
        from transformers import TrainingArguments

        from shardspeed.integrations.transformers import fill_auto

        args = TrainingArguments(output_dir=str(tmp_path), per_device_train_batch_size=2, report_to=[])
        load_config(fill_auto(raw, args, num_training_steps=10), world_size=args.world_size)
        return
    load_config(raw, world_size=2)


def test_deepspeed_sample_configs_load():
    from test_config import FP16_STATIC, HF_AUTO_ZERO3, ZERO3_OFFLOAD

    for raw in (ZERO3_OFFLOAD, FP16_STATIC, HF_AUTO_ZERO3):
        load_config(raw, world_size=2)


def test_disabled_blocks_at_defaults_load():
    load_config(dict(BASE, activation_checkpointing={"partition_activations": False, "cpu_checkpointing": False,
                                                      "contiguous_memory_optimization": False,
                                                      "number_checkpoints": 4,
                                                      "synchronize_checkpoint_boundary": False, "profile": False,
                                                      "enabled": False},
                     zero_optimization={"stage": 2, "zero_hpz_partition_size": 1, "zero_quantized_weights": False,
                                        "zero_quantized_gradients": False},
                     bf16={"enabled": True, "bf16_master_weights_and_grads": False, "bf16_optimizer_states": False},
                     **{b: {"enabled": False} for b in ENABLED_BLOCKS
                        if b not in ("fp16", "bf16", "activation_checkpointing")}))


def test_dump_state_and_memory_breakdown_log(caplog, process_group):
    """Formerly accepted and ignored; now they log what DeepSpeed's do."""
    import logging

    import shardspeed

    cfg = dict(BASE, dump_state=True, memory_breakdown=True, steps_per_print=1)
    with caplog.at_level(logging.INFO, logger="shardspeed"):
        engine, *_ = shardspeed.initialize(model=torch.nn.Linear(4, 4), config=cfg)
        loss = engine(torch.randn(2, 4)).pow(2).mean()
        engine.backward(loss)
        engine.step()
    assert "shardspeed config" in caplog.text and '"dump_state": true' in caplog.text
    assert "memory (bytes)" in caplog.text and "master_weights" in caplog.text
