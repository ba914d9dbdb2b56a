"""Secrets in a config (issue 35) are masked wherever the config is shown: ``dump_state``'s log line, the
experiment descriptions of the autotuner, the ds_config a DeepSpeed-layout export writes into its checkpoint."""
from __future__ import annotations

import json
import logging

from distributed import run_distributed
from models import make_model

from shardspeed.config.secrets import is_secret_key, mask_secrets

SECRET = "s3cr3t-comet-key-0123456789"


def test_mask_secrets_masks_every_secret_key_and_leaves_the_input_alone():
    config = {"comet": {"api_key": SECRET, "project": "p", "experiment_key": "abc"},
              "hub": [{"Token": SECRET}, {"password": None}], "wandb": {"team": "t", "secret": ""},
              "zero_optimization": {"stage": 2}, "my_access_token": SECRET}
    before = json.dumps(config)
    masked = mask_secrets(config)
    assert json.dumps(config) == before
    assert masked == {"comet": {"api_key": "***", "project": "p", "experiment_key": "***"},
                      "hub": [{"Token": "***"}, {"password": None}], "wandb": {"team": "t", "secret": ""},
                      "zero_optimization": {"stage": 2}, "my_access_token": "***"}
    assert not any(is_secret_key(k) for k in ("stage", "keys", "monkey", "tokens_per_sample", "key"))


def _dump_state_log() -> str:
    import shardspeed

    lines = []

    class Keep(logging.Handler):
        def emit(self, record):
            lines.append(record.getMessage())

    log = logging.getLogger("shardspeed")
    log.addHandler(Keep(logging.INFO))
    log.setLevel(logging.INFO)
    shardspeed.initialize(model=make_model("mlp"), config={
        "train_batch_size": 2, "dump_state": True, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
        "comet": {"enabled": False, "api_key": SECRET, "project": "demo"}})
    return "\n".join(lines)


def test_dump_state_does_not_log_the_comet_api_key():
    log = run_distributed(_dump_state_log, 1)[0]
    assert "shardspeed config:" in log and '"project": "demo"' in log
    assert '"api_key": "***"' in log
    assert SECRET not in log


def test_autotune_experiment_description_masks_the_key(tmp_path):
    from shardspeed.autotune.report import write_experiment

    config = {"train_batch_size": 2, "comet": {"api_key": SECRET}}
    exp_dir = write_experiment(str(tmp_path / "results"), str(tmp_path / "exps"), "z1", config, ["python", "t.py"])
    assert SECRET not in (tmp_path / "exps" / "z1.json").read_text()
    # the trial's own config keeps it: the trial needs the key
    assert json.loads((tmp_path / "results" / "z1" / "ds_config.json").read_text()) == config
    assert exp_dir == str(tmp_path / "results" / "z1")
