"""The plan decides every part the builder assembles (issue 38): the optimizer step, AutoEP, the pipeline
schedule (checked once, in decide), what the engine reports, the config as given; and no module the builder
assembles imports ``shardspeed.config`` (tools/house_counts.py's count)."""
from __future__ import annotations

import importlib.util
import json
import os

import pytest

from shardspeed.errors import ConfigError
from shardspeed.plan import ModelFacts, TypedBlock, checkpointing_of, decide, optimizer_of, tile_elems_of

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BASE = {"train_batch_size": 8}


def test_decide_gives_each_part_its_decision():
    cfg = {**BASE, "gradient_clipping": 0.5, "dataloader_drop_last": True, "steps_per_print": 7,
           "optimizer": {"type": "AdamW", "params": {"lr": 0.1}}, "scheduler": {"type": "WarmupLR"},
           "checkpoint": {"tag_validation": "fail"}, "comms_logger": {"enabled": True, "prof_all": False,
                                                                      "prof_ops": ["all_reduce"]},
           "csv_monitor": {"enabled": True, "output_path": "/tmp/x"}, "wandb": {"enabled": False},
           "flops_profiler": {"enabled": True, "profile_step": 3},
           "autotuning": {"enabled": True, "start_profile_step": 2, "end_profile_step": 4},
           "expert_parallel": {"enabled": True, "preset_model": "mixtral"}}
    plan = decide(cfg, 2)
    assert plan.optimizer.optimizer == TypedBlock("AdamW", {"lr": 0.1})
    assert plan.optimizer.scheduler == TypedBlock("WarmupLR", {}) and plan.optimizer.gradient_clipping == 0.5
    assert plan.batch.drop_last and plan.batch.micro_batch == 4 and plan.save.tag_validation == "FAIL"
    rep = plan.report
    assert rep.steps_per_print == 7 and rep.config_dump is None
    assert (rep.comms_logger.enabled, rep.comms_logger.prof_all, rep.comms_logger.prof_ops) == (True, False,
                                                                                              ("all_reduce",))
    mon = rep.monitors
    assert mon.enabled and mon.csv is not None and mon.csv.output_path == "/tmp/x"
    assert mon.tensorboard is None and mon.wandb is None and mon.comet is None
    assert rep.flops_profiler.enabled and rep.flops_profiler.profile_step == 3
    assert rep.trial is not None and (rep.trial.start_step, rep.trial.end_step) == (2, 4)
    assert plan.experts.convert and plan.experts.preset_model == "mixtral"
    assert plan.source is not None and plan.source.given is cfg  # engine.config: the dict given, the same object
    quiet = decide(BASE, 1)
    assert not quiet.report.monitors.enabled and quiet.report.trial is None and quiet.optimizer.optimizer is None


def test_dump_state_is_decided_with_secrets_masked():
    plan = decide({**BASE, "dump_state": True, "comet": {"enabled": True, "api_key": "s3cr3t"}}, 1)
    dump = plan.report.config_dump
    assert dump is not None and "s3cr3t" not in dump and json.loads(dump)["comet"]["api_key"] == "***"
    assert "s3cr3t" not in repr(plan)  # the comet plan keeps the key out of its repr


def test_pipeline_schedule_is_resolved_and_checked_in_decide():
    pipe = ModelFacts(pipeline_stages=2)
    plan = decide({**BASE, "pipeline": {"schedule": "interleaved_1f1b"}}, 2, pipe)
    assert (plan.pipeline.stages, plan.pipeline.virtual_stages) == (2, 2)  # "auto" resolved for the schedule
    assert decide({**BASE, "pipeline": {"schedule": "zbv"}}, 2, pipe).pipeline.virtual_stages == 2
    with pytest.raises(ConfigError, match="runs one stage per rank"):
        decide({**BASE, "pipeline": {"schedule": "1f1b", "virtual_stages": 2}}, 2, pipe)
    with pytest.raises(ConfigError, match="exactly 2 stages per rank"):
        decide({**BASE, "pipeline": {"schedule": "dualpipev", "virtual_stages": 3}}, 2, pipe)
    # a model that is not a pipeline: the block is not read, as before
    assert decide({**BASE, "pipeline": {"schedule": "1f1b", "virtual_stages": 2}}, 2).pipeline.virtual_stages == 2


def test_a_config_file_is_read_once_and_kept_as_given(tmp_path):
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({**BASE, "zero_optimization": {"stage": 1}}))
    plan = decide(str(path), 2)
    assert plan.source is not None and plan.source.given == {**BASE, "zero_optimization": {"stage": 1}}
    assert plan.source.loaded.zero_optimization.stage == 1 and plan.sharding.stage == 1


def test_single_decisions_of_a_config():
    assert tile_elems_of(None) == 1_000_000_000 and tile_elems_of({"zero_optimization": {"sub_group_size": 64}}) == 64
    assert checkpointing_of({"activation_checkpointing": {"partition_activations": True}}).partitioned
    assert optimizer_of(None).optimizer is None
    assert optimizer_of({"optimizer": {"type": "Lion"}}).optimizer == TypedBlock("Lion", {})


def test_no_module_the_builder_assembles_imports_the_config():
    spec = importlib.util.spec_from_file_location("house_counts", os.path.join(ROOT, "tools", "house_counts.py"))
    assert spec is not None and spec.loader is not None
    counts = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(counts)
    assert counts.config_importers(counts.import_graph(typing_too=True)) == []
    # the count sees an import: a module of the runtime importing the config would be listed
    fake = {"shardspeed.runtime.builder": {"shardspeed.config"}, "shardspeed.cli.main": {"shardspeed.config"}}
    assert counts.config_importers(fake) == ["shardspeed.runtime.builder -> shardspeed.config"]
