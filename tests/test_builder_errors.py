"""Mistakes in initialize() arguments fail at once with one clear line, before anything is changed."""
import pytest
import torch
from models import make_model

import shardspeed
from shardspeed.errors import ConfigError

BASE = {"train_micro_batch_size_per_gpu": 2}


def _init(**kw):
    return shardspeed.initialize(model=make_model("mlp"), **kw)


def test_no_optimizer_anywhere_builds_a_forward_only_engine():  # as DeepSpeed (tests/test_deepspeed_configs.py)
    engine, optimizer, _, _ = _init(config=BASE)
    assert optimizer is None and type(engine).__name__ == "ForwardEngine"
    with pytest.raises(shardspeed.ShardspeedError, match="engine built without an optimizer"):
        engine.step()


def test_two_optimizers():
    model = make_model("mlp")
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    cfg = dict(BASE, optimizer={"type": "AdamW", "params": {"lr": 1e-3}})
    with pytest.raises(ConfigError, match="two optimizers"):
        shardspeed.initialize(model=model, optimizer=opt, config=cfg)


def test_model_must_be_a_module():
    with pytest.raises(ConfigError, match="torch.nn.Module"):
        shardspeed.initialize(model=lambda x: x, config=dict(BASE, optimizer={"type": "SGD", "params": {"lr": 0.1}}))


def test_mpu_without_groups_is_refused_clearly():
    with pytest.raises(ConfigError, match="mpu= must have get_data_parallel_group"):
        shardspeed.initialize(model=make_model("mlp"), mpu=object(), config=BASE)
