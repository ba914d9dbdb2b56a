"""Hostile configs (issue 35): each malformed file or value gets one ConfigError line naming the file or the
key, never a RecursionError, ValueError, UnicodeDecodeError or OverflowError from deep inside."""
from __future__ import annotations

import json

import pytest

from shardspeed.config import load_config
from shardspeed.errors import ConfigError

BASE = {"train_batch_size": 2}


def _error(config) -> str:
    with pytest.raises(ConfigError) as info:
        load_config(config)
    message = str(info.value)
    assert "\n" not in message
    return message


def test_json_nested_100000_deep(tmp_path):
    path = tmp_path / "deep.json"
    path.write_text('{"train_batch_size": 2, "wandb": ' + "[" * 100_000 + "]" * 100_000 + "}")
    message = _error(path)
    assert str(path) in message and "nested too deeply" in message


def test_dict_nested_100000_deep():
    value: object = 1
    for _ in range(100_000):
        value = [value]
    message = _error({**BASE, "zero_optimization": {"leaf_module": {"classes": value}}})
    assert message.startswith("'zero_optimization.leaf_module.classes[0][0]")
    assert "nested more than 64 levels deep" in message


def test_5000_digit_number(tmp_path):
    path = tmp_path / "long.json"
    path.write_text('{"train_batch_size": 2, "zero_optimization": {"reduce_bucket_size": ' + "7" * 5000 + "}}")
    message = _error(path)
    assert message.startswith("zero_optimization.reduce_bucket_size = 777777777777... (5000 digits) is out of range")


def test_latin1_bytes(tmp_path):
    path = tmp_path / "latin1.json"
    path.write_bytes('{"train_batch_size": 2, "wandb": {"enabled": false, "project": "caf\xe9"}}'.encode("latin-1"))
    message = _error(path)
    assert str(path) in message and "not UTF-8 text: byte 0xe9" in message


def test_config_path_is_a_directory(tmp_path):
    message = _error(tmp_path)
    assert message == f"config file '{tmp_path}' is a directory: give the path of a JSON file"


def test_stage_as_a_string_is_refused(tmp_path):
    path = tmp_path / "stage.json"
    path.write_text(json.dumps({**BASE, "zero_optimization": {"stage": "2"}}))
    assert _error(path) == ('zero_optimization.stage = "2" is invalid: it must be 0, 1, 2 or 3 '
                            "(a JSON number, not a string)")
    assert "zero_optimization.stage = 2.0 is invalid" in _error({**BASE, "zero_optimization": {"stage": 2.0}})
    # as in DeepSpeed, "auto" means the default
    assert load_config({**BASE, "zero_optimization": {"stage": "auto"}}).zero_optimization.stage == 0


@pytest.mark.parametrize("key", ["reduce_bucket_size", "allgather_bucket_size", "stage3_prefetch_bucket_size",
                                 "sub_group_size", "stage3_max_live_parameters"])
def test_sizes_of_10_to_the_30(key):
    message = _error({**BASE, "zero_optimization": {"stage": 3, key: 10 ** 30}})
    assert message == (f"zero_optimization.{key} = {10 ** 30} is out of range: it must be between -2**63 and "
                       "2**63 - 1")


def test_initial_scale_power_of_a_million():
    message = _error({**BASE, "fp16": {"enabled": True, "initial_scale_power": 10 ** 6}})
    assert message == "fp16.initial_scale_power = 1000000 is invalid: it must be <= 1023"
    assert load_config({**BASE, "fp16": {"enabled": True, "initial_scale_power": 1023}}).fp16.initial_scale_power \
        == 1023
