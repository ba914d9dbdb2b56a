"""accelerate with DeepSpeed, unchanged, through shardspeed's ``deepspeed`` package, against the same job on
real DeepSpeed 0.19.8 (issue 37).

Both jobs are started the way users start them: ``accelerate launch --config_file cfg.yaml`` with a DEEPSPEED
section (zero_stage and the other fields, num_processes 2, use_cpu true); for one machine accelerate's
DeepSpeed launcher runs torchrun in-process, and the workers inherit PYTHONPATH, so shardspeed's site folder
put first there reaches them (the job reports which ``deepspeed`` its workers imported). In that process group
tests/accelerate_ds_loop.py runs three custom loops on a tiny Llama (fp32, 8 micro-batches, accumulation 2):
the launcher's plugin (ZeRO 3, model built under ``zero.Init``), then ``Accelerator(deepspeed_plugin=
DeepSpeedPlugin(hf_ds_config=...))`` at ZeRO 2 (torch AdamW + LambdaLR from the script) and ZeRO 3 (optimizer
and WarmupLR from the config, through accelerate's DummyOptim / DummyScheduler; ``save_state`` half-way and
``load_state`` after the end).
"""
from __future__ import annotations

import os
import shutil

import pytest

pytest.importorskip("transformers")
pytest.importorskip("accelerate")
pytest.importorskip("deepspeed")

from package_jobs import ROOT, build_deepspeed_ops, max_diff, run_both  # noqa: E402

from shardspeed.compat import DEEPSPEED_VERSION, site_path  # noqa: E402

TOL = 1e-5
SCRIPT = os.path.join(ROOT, "tests", "accelerate_ds_loop.py")
ACCELERATE_CONFIG = """\
compute_environment: LOCAL_MACHINE
distributed_type: DEEPSPEED
deepspeed_config:
  zero_stage: 3
  gradient_accumulation_steps: 2
  gradient_clipping: 1.0
  offload_optimizer_device: none
  offload_param_device: none
  zero3_init_flag: true
  zero3_save_16bit_model: true
num_processes: 2
num_machines: 1
machine_rank: 0
main_process_port: 0
use_cpu: true
"""


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    build_deepspeed_ops()
    root = str(tmp_path_factory.mktemp("accelerate_ds"))
    cfg = os.path.join(root, "cfg.yaml")
    with open(cfg, "w") as f:
        f.write(ACCELERATE_CONFIG)
    accelerate = shutil.which("accelerate")
    assert accelerate is not None
    return run_both(lambda out: [accelerate, "launch", "--config_file", cfg, SCRIPT, out], root, timeout=420)


def test_launched_workers_import_the_intended_deepspeed(runs):
    ours, theirs = runs["shardspeed"], runs["deepspeed"]
    assert ours["deepspeed"] == DEEPSPEED_VERSION and ours["origin"].startswith(site_path() + os.sep)
    assert theirs["deepspeed"] == "0.19.8" and not theirs["origin"].startswith(site_path())
    for r in (ours, theirs):
        assert r["world"] == 2 and r["launched_stage"] == 3


@pytest.mark.parametrize("loop", ["launched", "z2", "z3"])
def test_losses_equal_deepspeed(runs, loop):
    """Each micro-batch's loss (the mean over the 2 ranks) equals DeepSpeed's to 1e-5."""
    ours, theirs = runs["shardspeed"][loop], runs["deepspeed"][loop]
    assert len(ours) == 8
    assert max_diff(ours, theirs) <= TOL, (ours, theirs)


def test_zero3_builds_sharded_and_save_state_load_state_repeat_exactly(runs):
    """The model built after the Accelerator is sharded as it is built (zero3_init_flag); accelerator.save_state
    half-way, then load_state after the end: the second half runs again with exactly the same losses."""
    ours = runs["shardspeed"]
    assert ours["z3_built_numel"] == runs["deepspeed"]["z3_built_numel"] == 0
    assert ours["z3_reloaded"] == ours["z3"][4:]
    assert max_diff(ours["z3_reloaded"], runs["deepspeed"]["z3_reloaded"]) <= TOL
