"""Configs and ``initialize`` calls DeepSpeed accepts (issue 37): hjson files, top-level keys DeepSpeed's
parser never reads (TRL's dotted keys), ``offload_param`` below stage 3, accelerate's infinite
``steps_per_print``, no optimizer (a forward-only engine, also of a frozen model), and DeepSpeed's
``init_distributed`` signature. The numbers against real DeepSpeed: tests/test_deepspeed_configs_multirank.py."""
from __future__ import annotations

import base64
import inspect
import json
import math
import sys

import hjson
import pytest
import torch

import shardspeed
from shardspeed.config import load_config
from shardspeed.config.loader import read_json
from shardspeed.errors import ConfigError, ShardspeedError
from tests.distributed import run_distributed

HJSON = """{
  # comments, unquoted keys and strings, optional and trailing commas: DeepSpeed reads its file with hjson
  train_micro_batch_size_per_gpu: 2
  gradient_accumulation_steps: 3,
  zero_optimization: {
    stage: 3
    offload_param: {"device": "cpu"}
    stage3_prefetch_bucket_size: 1000,
  },
  bf16: {
    enabled: true
  }
}
"""
AS_DICT = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 3,
           "zero_optimization": {"stage": 3, "offload_param": {"device": "cpu"}, "stage3_prefetch_bucket_size": 1000},
           "bf16": {"enabled": True}}


def _error(config) -> str:
    with pytest.raises(ConfigError) as info:
        load_config(config)
    assert "\n" not in str(info.value)
    return str(info.value)


# ---- hjson ----------------------------------------------------------------------------------------------

def test_hjson_file_reads_as_deepspeed_reads_it(tmp_path):
    path = tmp_path / "ds_config.hjson"
    path.write_text(HJSON)
    with open(path) as f:  # DeepSpeedConfig's own reading of a path
        assert read_json(path) == hjson.load(f) == AS_DICT
    assert load_config(path, world_size=2) == load_config(AS_DICT, world_size=2)


def test_json_needs_no_hjson_and_hjson_without_it_says_what_to_install(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "hjson", None)  # `import hjson` raises ImportError
    plain = tmp_path / "ds_config.json"
    plain.write_text(json.dumps(AS_DICT))
    assert load_config(plain).zero_optimization.stage == 3
    path = tmp_path / "ds_config.hjson"
    path.write_text(HJSON)
    assert _error(path) == (f"config file '{path}' is not valid JSON: Expecting property name enclosed in double "
                            "quotes at line 2, column 3 (DeepSpeed also reads hjson files: `pip install hjson` to "
                            "load one)")


@pytest.mark.parametrize("text, expected", [
    ("{a: " + "[" * 100_000 + "]" * 100_000 + "}", "nested too deeply"),
    ("{\n train_batch_size: 2\n zero_optimization: {reduce_bucket_size: 1e999}\n}", "(nor hjson: a number is out of "
                                                                                     "range)"),
    ("{\n train_batch_size: 2\n train_batch_size: 4\n}", "has the key 'train_batch_size' twice"),
    ("{\n train_batch_size: 2\n wandb: {project: caf\xe9}\n}", "not UTF-8 text: byte 0xe9"),
])
def test_hostile_hjson_gets_one_line(tmp_path, text, expected):
    path = tmp_path / "bad.hjson"
    path.write_bytes(text.encode("latin-1"))
    message = _error(path)
    assert str(path) in message and expected in message


def test_huge_integer_in_hjson_is_refused_by_range(tmp_path):
    path = tmp_path / "long.hjson"
    path.write_text("{\"train_batch_size\": 2, zero_optimization: {\"reduce_bucket_size\": " + "7" * 5000 + "}}")
    assert _error(path).startswith("zero_optimization.reduce_bucket_size = 777777777777... (5000 digits) is out")


def test_base64_config_string_as_deepspeed_accepts_it(tmp_path):
    """DeepSpeedConfig's third form: a URL-safe base64 string of the config text (JSON or hjson)."""
    for text in (json.dumps(AS_DICT), HJSON):
        encoded = base64.urlsafe_b64encode(text.encode()).decode()
        assert load_config(encoded, world_size=2) == load_config(AS_DICT, world_size=2)
    deep = base64.urlsafe_b64encode(('{"a": ' + "[" * 100_000 + "]" * 100_000 + "}").encode()).decode()
    assert _error(deep) == "the base64 config string is nested too deeply for a config (at most 64 levels)"
    assert _error("ds_config.json") == "config file 'ds_config.json' does not exist"  # not base64: a missing path
    assert _error(base64.urlsafe_b64encode(b"[1]").decode()) == "config file 'WzFd' does not exist"


# ---- keys DeepSpeed never reads ---------------------------------------------------------------------------

def test_dotted_top_level_keys_are_ignored_with_one_warning(caplog):
    """TRL's prepare_deepspeed writes these at the top level; DeepSpeed's parser reads none of them, so the
    nested value (here the default) is what both use."""
    trl = {"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 3},
           "zero_optimization.reduce_bucket_size": 1024, "zero_optimization.stage3_param_persistence_threshold": 320,
           "zero_optimization.stage3_prefetch_bucket_size": 0.9 * 1024}
    with caplog.at_level("WARNING", logger="shardspeed.config"):
        c = load_config(trl)
    z = c.zero_optimization
    assert (z.reduce_bucket_size, z.param_persistence_threshold, z.prefetch_bucket_size) == (500_000_000, 100_000,
                                                                                             50_000_000)
    assert [r.getMessage() for r in caplog.records] == [
        "ignoring top-level config keys DeepSpeed does not read either: 'zero_optimization.reduce_bucket_size', "
        "'zero_optimization.stage3_param_persistence_threshold', 'zero_optimization.stage3_prefetch_bucket_size' "
        "(a dotted key sets nothing; nest it to set it, e.g. {\"zero_optimization\": {\"reduce_bucket_size\": ...}})"]
    assert "zero_optimization.reduce_bucket_size" in trl  # the caller's dict is not modified


def test_unknown_keys_inside_blocks_stay_errors():  # DeepSpeed's zero_optimization refuses them too
    assert _error({"train_batch_size": 2, "zero_optimization": {"stage": 3, "reduce_bucket_sise": 10}}) == (
        "unknown key 'zero_optimization.reduce_bucket_sise'; did you mean 'reduce_bucket_size'?")


@pytest.mark.parametrize("stage", [0, 1, 2])
def test_offload_param_below_stage_3_is_ignored_with_a_warning(caplog, stage):
    with caplog.at_level("WARNING", logger="shardspeed.config"):
        c = load_config({"train_batch_size": 2, "zero_optimization": {"stage": stage, "offload_param": {"device": "cpu"}}})
    assert c.zero_optimization.offload_param is None and c.zero_optimization.offload_param_device == "none"
    assert [r.getMessage() for r in caplog.records] == [
        f"zero_optimization: 'offload_param' (device \"cpu\") is ignored at stage {stage}, as DeepSpeed ignores it: "
        "parameters are offloaded only at stage 3 (use offload_optimizer at stages 1-2)"]
    assert load_config({"train_batch_size": 2, "zero_optimization": {
        "stage": 3, "offload_param": {"device": "cpu"}}}).zero_optimization.offload_param_device == "cpu"


def test_infinite_steps_per_print_means_never():  # accelerate's DeepSpeedPlugin writes float("inf")
    assert load_config({"train_batch_size": 2, "steps_per_print": math.inf}).steps_per_print is None
    assert "steps_per_print" in _error({"train_batch_size": 2, "steps_per_print": -math.inf})


# ---- init_distributed -------------------------------------------------------------------------------------

def test_init_distributed_has_deepspeeds_signature():
    names = list(inspect.signature(shardspeed.init_distributed).parameters)
    assert names[:6] == ["dist_backend", "auto_mpi_discovery", "distributed_port", "verbose", "timeout", "init_method"]
    assert "backend" in names  # shardspeed's older keyword, kept
    with pytest.raises(ConfigError, match="the same setting twice"):
        shardspeed.init_distributed(dist_backend="gloo", backend="nccl")


# ---- initialize without an optimizer ------------------------------------------------------------------------

_FORWARD_ONLY = ("{} on an engine built without an optimizer (no 'optimizer' block in the config and no "
                 "optimizer= to initialize): it runs forward only; add an optimizer to train")


def _forward_only_cases():
    rank = torch.distributed.get_rank()
    out = {}
    for stage in (0, 2, 3):
        for frozen in (True, False):
            torch.manual_seed(0)
            model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.GELU(), torch.nn.Linear(32, 8),
                                        torch.nn.GELU(), torch.nn.Linear(8, 4)).requires_grad_(not frozen)
            x = torch.randn(3, 8) + rank
            with torch.no_grad():
                expected = model(x)
            config = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {
                "stage": stage, "stage3_param_persistence_threshold": 0}}
            engine, optimizer, _, scheduler = shardspeed.initialize(model=model, config=config)
            engine.eval()
            with torch.no_grad():
                got = engine(x)
            errors = []
            for call, arg in ((engine.backward, got.sum()), (engine.step, None)):
                try:
                    call() if arg is None else call(arg)
                except ShardspeedError as e:
                    errors.append(str(e))
            out[(stage, frozen)] = dict(
                equal=torch.equal(got, expected), optimizer=optimizer, scheduler=scheduler, errors=errors,
                training=engine.training, held=sum(p.numel() for p in model.parameters()))
    out["ds_attributes"] = _ds_attributes()
    try:
        shardspeed.initialize(model=torch.nn.Linear(2, 2), config={
            "train_batch_size": 2, "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 1}}})
    except ConfigError as e:
        out["scheduler_error"] = str(e)
    return out


def _ds_attributes():
    """DeepSpeed's attributes on parameters built by shardspeed's zero.Init and then held by a stage-3 engine:
    full sizes, and ds_status following the gathers."""
    from shardspeed.runtime.zero.partition_parameters import ZeroParamStatus

    with shardspeed.zero.Init():
        model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Linear(32, 4))
    params = list(model.parameters())
    seen = {"built": [(tuple(p.ds_shape), p.ds_numel, p.ds_status) for p in params]}
    with shardspeed.zero.GatheredParameters(params):
        seen["gathered_loose"] = {p.ds_status for p in params}
    engine, *_ = shardspeed.initialize(model=model, config={"train_micro_batch_size_per_gpu": 1, "zero_optimization": {
        "stage": 3, "stage3_param_persistence_threshold": 0}})
    seen["engine"] = {p.ds_status for p in params}
    with shardspeed.zero.GatheredParameters(params[:2]):
        seen["gathered_unit"] = [p.ds_status for p in params]
    seen["after"] = {p.ds_status for p in params}
    seen["ids"] = len({p.ds_id for p in params})
    seen["expected"] = ZeroParamStatus
    return seen


def test_initialize_without_optimizer_builds_a_forward_only_engine():
    for result in run_distributed(_forward_only_cases, 2):
        ds = result.pop("ds_attributes")
        status = ds["expected"]
        assert ds["built"] == [((32, 8), 256, status.NOT_AVAILABLE), ((32,), 32, status.NOT_AVAILABLE),
                               ((4, 32), 128, status.NOT_AVAILABLE), ((4,), 4, status.NOT_AVAILABLE)]
        assert ds["gathered_loose"] == {status.AVAILABLE} and ds["engine"] == ds["after"] == {status.NOT_AVAILABLE}
        assert ds["gathered_unit"][:2] == [status.AVAILABLE] * 2 and ds["ids"] == 4
        assert result.pop("scheduler_error").startswith("an LR schedule without an optimizer: add an 'optimizer'")
        for (stage, frozen), r in result.items():
            assert r["equal"] and r["optimizer"] is None and r["scheduler"] is None and not r["training"], (stage, r)
            assert r["errors"] == [_FORWARD_ONLY.format("backward()"), _FORWARD_ONLY.format("step()")]
            # stage 3 keeps shards: outside forward the module holds placeholders (gathered per unit in forward)
            assert (r["held"] == 0) == (stage == 3), (stage, frozen, r["held"])
