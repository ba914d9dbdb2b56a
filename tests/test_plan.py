"""``shardspeed.plan.decide`` alone: configs × world sizes → plans, and one ConfigError per contradiction.

No process group, no tensor, no model: the plan is pure."""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from shardspeed.errors import ConfigError
from shardspeed.plan import MESH_DIMS, MeshPlan, ModelFacts, decide, zero_variant

BASE = {"train_batch_size": 16}


def _cfg(**kw) -> dict:
    return {**BASE, **kw}


# (config, world, facts, expected attributes: dotted path -> value)
TABLE = [
    (_cfg(), 1, None, {"mesh.data": 1, "sharding.stage": 0, "sharding.reduce_op": "all_reduce",
                       "sharding.unit_world": 1, "batch.micro_batch": 16, "batch.accumulation_steps": 1,
                       "precision.compute": torch.float32, "placement.optimizer": "device"}),
    (_cfg(zero_optimization={"stage": 1}), 4, None,
     {"mesh.data": 4, "sharding.partition_optimizer": True, "sharding.partition_gradients": False,
      "sharding.reduce_op": "reduce_scatter", "sharding.gather_after_step": True,
      "sharding.reduce_every_micro_step": False, "sharding.unit_world": 4, "batch.micro_batch": 4}),
    (_cfg(zero_optimization={"stage": 1, "reduce_scatter": False}), 2, None, {"sharding.reduce_op": "all_reduce"}),
    (_cfg(zero_optimization={"stage": 2}), 2, None,
     {"sharding.partition_gradients": True, "sharding.reduce_every_micro_step": True,
      "sharding.buckets_alive": 3, "sharding.reduce_bucket": 500_000_000}),
    (_cfg(zero_optimization={"stage": 2}), 2, ModelFacts(pipeline_stages=1),
     {"sharding.reduce_every_micro_step": False}),  # a pipeline reduces once at the boundary
    (_cfg(zero_optimization={"stage": 3, "reduce_scatter": False}), 2, None,
     {"sharding.partition_parameters": True, "sharding.reduce_op": "reduce_scatter",
      "sharding.gather_after_step": False, "sharding.buckets_alive": None,
      "sharding.prefetch_bucket": 50_000_000, "sharding.persistence_threshold": 100_000}),
    (_cfg(zero_optimization={"stage": 3, "offload_param": {"device": "cpu"}, "offload_optimizer": {"device": "cpu"}}),
     2, None, {"placement.params": "host", "placement.optimizer": "host"}),
    (_cfg(zero_optimization={"stage": 3, "offload_param": {"device": "nvme", "nvme_path": "/x"},
                             "offload_optimizer": {"device": "nvme", "nvme_path": "/y"}, "sub_group_size": 1000}),
     2, None, {"placement.params": "file", "placement.params_path": "/x", "placement.optimizer": "file",
               "placement.optimizer_path": "/y", "placement.tile_elems": 1000}),
    (_cfg(bf16={"enabled": True}), 2, None,
     {"precision.compute": torch.bfloat16, "precision.master": torch.float32, "precision.reduce": torch.bfloat16,
      "precision.accumulate": torch.bfloat16, "precision.loss_scale.enabled": False, "precision.check_overflow": True}),
    (_cfg(bf16={"enabled": True, "check_grad_overflow": False}, data_types={"grad_accum_dtype": "fp32"},
          communication_data_type="fp32"), 2, None,
     {"precision.accumulate": torch.float32, "precision.reduce": torch.float32, "precision.check_overflow": False}),
    (_cfg(fp16={"enabled": True, "loss_scale": 0, "initial_scale_power": 8}), 2, None,
     {"precision.compute": torch.float16, "precision.loss_scale.dynamic": True,
      "precision.loss_scale.initial_scale_power": 8, "precision.check_overflow": True}),
    (_cfg(fp16={"enabled": True, "loss_scale": 128}), 2, None, {"precision.loss_scale.dynamic": False}),
    (_cfg(prescale_gradients=True, gradient_predivide_factor=2.0), 2, None, {"precision.predivide_factor": 2.0}),
    (_cfg(tensor_parallel={"autotp_size": 2}), 4, None, {"mesh.model": 2, "mesh.data": 2, "batch.micro_batch": 8,
                                                         "tensor_parallel.size": 2}),
    (_cfg(), 4, ModelFacts(tp_size=2), {"mesh.model": 2, "mesh.data": 2}),
    (_cfg(), 8, ModelFacts(pipeline_stages=2), {"mesh.pipe": 2, "mesh.data": 4, "pipeline.stages": 2}),
    (_cfg(tensor_parallel={"autotp_size": 2}), 8, ModelFacts(pipeline_stages=2),
     {"mesh.pipe": 2, "mesh.data": 2, "mesh.model": 2, "batch.micro_batch": 8}),
    (_cfg(train_micro_batch_size_per_gpu=2), 4, None, {"batch.accumulation_steps": 2}),
    (_cfg(activation_checkpointing={"enabled": True, "policy": "selective"}), 1, None,
     {"checkpointing.blocks": True, "checkpointing.policy": "selective", "checkpointing.configure": True}),
    (_cfg(), 1, None, {"checkpointing.configure": False}),
    (_cfg(activation_checkpointing={"partition_activations": True, "cpu_checkpointing": True, "profile": True,
                                    "contiguous_memory_optimization": True, "number_checkpoints": 4,
                                    "synchronize_checkpoint_boundary": True}), 2, None,
     {"checkpointing.blocks": False, "checkpointing.configure": True, "checkpointing.partitioned": True,
      "checkpointing.on_host": True, "checkpointing.contiguous": True, "checkpointing.checkpoints_per_forward": 4,
      "checkpointing.synchronize": True, "checkpointing.profile": True}),
    (_cfg(zero_optimization={"stage": 3}), 2, ModelFacts(built_sharded=True), {"sharding.stage": 3}),
    (_cfg(), 2, None, {"mesh.dims": ("pipe", "data", "model"), "mesh.sequence": 1}),
    (_cfg(sequence_parallel_size=1), 2, None, {"mesh.dims": ("pipe", "data", "sequence", "model"),
                                               "mesh.shard_size": 2}),
]


def _get(obj, dotted: str):
    for part in dotted.split("."):
        obj = getattr(obj, part)
    return obj


@pytest.mark.parametrize("config,world,facts,expected", TABLE, ids=[str(i) for i in range(len(TABLE))])
def test_decide_table(config, world, facts, expected):
    plan = decide(config, world, facts)
    got = {k: _get(plan, k) for k in expected}
    assert got == expected
    assert plan.mesh.world == world
    assert plan.batch.global_batch == plan.batch.micro_batch * plan.batch.accumulation_steps * plan.mesh.shard_size


CONTRADICTIONS = [
    (_cfg(tensor_parallel={"autotp_size": 3}), 4, None, "not divisible by pipeline.stages 1 × tensor_parallel.autotp_size 3"),
    (_cfg(pipeline={"stages": 2}), 4, None, "pipeline.stages 2 needs a shardspeed.pipe.PipelineModule"),
    (_cfg(pipeline={"stages": 4}), 8, ModelFacts(pipeline_stages=2), "pipeline.stages 4 disagrees with the PipelineModule"),
    (_cfg(tensor_parallel={"autotp_size": 4}), 8, ModelFacts(tp_size=2), "autotp_size 4 disagrees with tp_model_init"),
    (_cfg(zero_optimization={"stage": 2}), 2, ModelFacts(built_sharded=True), "needs zero_optimization.stage 3"),
    (_cfg(tensor_parallel={"autotp_size": 2, "sequence_parallel": True}), 4, ModelFacts(pipeline_stages=1),
     "tensor_parallel.sequence_parallel with a PipelineModule"),
    (_cfg(train_batch_size=10, train_micro_batch_size_per_gpu=4), 2, None, "train_batch_size"),
    (_cfg(zero_optimization={"stage": 7}), 2, None, "zero_optimization.stage"),
]


@pytest.mark.parametrize("config,world,facts,message", CONTRADICTIONS,
                         ids=[str(i) for i in range(len(CONTRADICTIONS))])
def test_each_contradiction_is_one_config_error(config, world, facts, message):
    with pytest.raises(ConfigError) as info:
        decide(config, world, facts)
    assert message in str(info.value)
    assert "\n" not in str(info.value).strip()


def test_a_given_mesh_is_checked_against_the_config():
    mesh = MeshPlan(pipe=1, data=2, model=2)
    assert decide(_cfg(), 4, mesh=mesh).mesh == mesh
    with pytest.raises(ConfigError, match="disagrees with mpu="):
        decide(_cfg(tensor_parallel={"autotp_size": 4}), 4, mesh=mesh)


def test_mesh_dimensions_in_order_and_zero_shards_over_data_and_sequence():
    assert MESH_DIMS == ("pipe", "data", "expert", "sequence", "model")
    mesh = MeshPlan(pipe=2, data=3, expert=1, sequence=2, model=2)
    assert list(mesh.sizes) == list(MESH_DIMS)
    assert mesh.world == 24 and mesh.shard_size == 6


def test_decide_is_pure(monkeypatch):
    def refuse(*_, **__):
        raise AssertionError("decide touched torch.distributed")

    for name in ("init_process_group", "new_group", "get_world_size", "get_rank", "is_initialized"):
        monkeypatch.setattr(dist, name, refuse)
    a = decide(_cfg(zero_optimization={"stage": 3}), 4)
    b = decide(_cfg(zero_optimization={"stage": 3}), 4)
    assert a == b and hash(a.mesh) == hash(b.mesh)


def test_a_zero_variant_is_planned_at_its_stage_and_offload():
    """zero_variant rewrites only the stage and the offload devices (the estimate table's rows); decide says
    which combinations are valid."""
    base = _cfg(bf16={"enabled": True}, zero_optimization={"stage": 1, "reduce_bucket_size": 1000,
                                                           "offload_optimizer": {"device": "cpu", "pin_memory": False}})
    v = zero_variant(base, 3, "nvme", "cpu")
    assert base["zero_optimization"]["stage"] == 1 and v["bf16"] == base["bf16"]  # a copy, the rest kept
    assert v["zero_optimization"] == {"stage": 3, "reduce_bucket_size": 1000, "offload_param": {"device": "cpu"},
                                      "offload_optimizer": {"device": "nvme", "pin_memory": False,
                                                            "nvme_path": "/local_nvme"}}
    plan = decide(v, 2)
    assert (plan.sharding.stage, plan.placement.optimizer, plan.placement.params, plan.sharding.reduce_bucket) == (
        3, "file", "host", 1000)
    assert plan.placement.optimizer_path == "/local_nvme" and not plan.placement.pin_memory
    plain = decide(zero_variant(base, 2), 2)
    assert (plain.sharding.stage, plain.placement.optimizer, plain.placement.params) == (2, "device", "device")
    # offload_param below stage 3 is ignored, as DeepSpeed does (the parameters stay on the device)
    ignored = decide(zero_variant(base, 2, "none", "cpu"), 2)
    assert (ignored.sharding.stage, ignored.placement.params) == (2, "device")
