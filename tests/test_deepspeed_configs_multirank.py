"""Configs DeepSpeed accepts, at world 2 against the real DeepSpeed (tests/ds_config_worker.py under torchrun,
once with DeepSpeed and once with shardspeed's ``deepspeed`` package, run side by side): TRL's
``prepare_deepspeed`` reference model (dotted keys, no optimizer, frozen or not, stage 3 or forced 0), an hjson
file with ``offload_param`` below stage 3: logits exactly equal (fp32). Also: a model partitioned by DeepSpeed's
own zero.Init is refused by shardspeed with one line; transformers' from_pretrained under HfDeepSpeedConfig
loads the checkpoint's weights through shardspeed's zero.Init."""
from __future__ import annotations

import json
import os

import pytest
import torch

from tests.distributed import run_pair_workers

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "ds_config_worker.py")




@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    pytest.importorskip("deepspeed")
    pytest.importorskip("trl")
    out = run_pair_workers(WORKER, tmp_path_factory)
    loaded = {}
    for name, folder in out.items():
        with open(os.path.join(folder, "checks.json")) as f:
            loaded[name] = (torch.load(os.path.join(folder, "logits.pt")), json.load(f))
    return loaded


def test_trl_reference_model_and_hjson_config_give_deepspeeds_logits(runs):
    real, ours = runs["real"][0], runs["ours"][0]
    assert sorted(real) == sorted(ours) and len(real) == 2 * 9
    for key in real:
        assert torch.equal(ours[key], real[key]), (key, (ours[key] - real[key]).abs().max())
    assert [int(ours[f"trl_ref_z{s}_frozen_stage_rank0"]) for s in (3, 2)] == [3, 0]
    assert runs["real"][1]["optimizer"] == runs["ours"][1]["optimizer"] == "None"


def test_parameters_partitioned_by_deepspeeds_zero_init_are_refused_at_initialize(runs):
    kind, message = runs["real"][1]["refused"]
    assert kind == "ShardspeedError"
    assert message.startswith("parameter '0.weight' was partitioned by DeepSpeed's own zero.Init")
    assert "build the model under shardspeed.zero.Init" in message and "shardspeed deepspeed-path" in message


def test_from_pretrained_under_hf_deepspeed_config_loads_the_checkpoint(runs):
    checks = runs["ours"][1]
    assert checks["from_pretrained"] == ["loaded", [], 28] and checks["ds_sizes"]
