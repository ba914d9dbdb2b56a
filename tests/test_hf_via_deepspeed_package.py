"""transformers' Trainer with ``TrainingArguments(deepspeed=config)``, unchanged, through shardspeed's
``deepspeed`` package, against the same run on real DeepSpeed 0.19.8 (issue 37).

tests/hf_ds_trainer.py runs, in one 2-rank gloo process group per system (both at once): a tiny Llama (2
layers, fp32) built after ``TrainingArguments`` (so at ZeRO 3 transformers builds it under
``deepspeed.zero.Init``), configs with "auto" values as users write them, 4 optimizer steps of 2 accumulated
micro-batches: ZeRO 2 (config from a file), ZeRO 3 with ``offload_optimizer`` on cpu, and ZeRO 3 saving a
checkpoint at step 2, then ``save_model``, then a fresh Trainer resuming from the checkpoint.
"""
from __future__ import annotations

import os
import sys

import pytest

pytest.importorskip("transformers")
pytest.importorskip("accelerate")
pytest.importorskip("deepspeed")

import torch  # noqa: E402
from package_jobs import ROOT, build_deepspeed_ops, max_diff, run_both  # noqa: E402

from shardspeed.compat import DEEPSPEED_VERSION  # noqa: E402

TOL = 1e-5
SCRIPT = os.path.join(ROOT, "tests", "hf_ds_trainer.py")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    build_deepspeed_ops()
    root = str(tmp_path_factory.mktemp("hf_ds"))
    results = run_both(lambda out: [sys.executable, "-m", "torch.distributed.run", "--standalone",
                                    "--nproc-per-node", "2", SCRIPT, out], root, timeout=420)
    return root, results


def test_each_run_used_the_intended_deepspeed(runs):
    _, r = runs
    assert r["shardspeed"]["deepspeed"] == DEEPSPEED_VERSION
    assert r["deepspeed"]["deepspeed"] == "0.19.8"


@pytest.mark.parametrize("run", ["z2", "z3off", "z3"])
def test_losses_equal_deepspeed(runs, run):
    """Every micro-batch's loss (2 ranks' batches, 8 micro-batches) equals DeepSpeed's to 1e-5."""
    _, r = runs
    ours, theirs = r["shardspeed"][run], r["deepspeed"][run]
    assert len(ours) == 8
    assert max_diff(ours, theirs) <= TOL, (ours, theirs)


def test_zero3_builds_sharded_and_trains(runs):
    _, r = runs
    for system in ("shardspeed", "deepspeed"):
        assert r[system]["built_numel"] == 0  # deepspeed.zero.Init: no rank holds a whole parameter
        assert r[system]["moved"] > 1e-3  # the weights did change: the loss comparison is not of a frozen model


def test_resume_from_checkpoint_continues_exactly(runs):
    """A fresh Trainer resuming from checkpoint-2 gives the uninterrupted run's losses of steps 3-4, exactly."""
    _, r = runs
    ours = r["shardspeed"]
    assert ours["z3_resumed"] == ours["z3"][4:]
    assert max_diff(ours["z3_resumed"], r["deepspeed"]["z3_resumed"]) <= TOL
    files = set(ours["ckpt_files"])
    assert {"global_step2", "latest", "trainer_state.json", "model.safetensors"} <= files


def test_save_model_at_zero3_loads_with_from_pretrained(runs):
    """save_model (stage3_gather_16bit_weights_on_model_save) writes what from_pretrained loads: the trained
    weights exactly, and DeepSpeed's saved weights to 1e-5."""
    from transformers import AutoModelForCausalLM

    root, _ = runs
    trained = torch.load(os.path.join(root, "shardspeed", "z3_trained.pt"))
    loaded = {s: AutoModelForCausalLM.from_pretrained(os.path.join(root, s, "z3_final"), dtype=torch.float32)
              .state_dict() for s in ("shardspeed", "deepspeed")}
    assert set(loaded["shardspeed"]) == set(trained)
    for name, weight in trained.items():
        assert torch.equal(loaded["shardspeed"][name], weight), name
        assert (loaded["deepspeed"][name] - weight).abs().max() <= TOL, name


def test_checkpoint_at_zero2_saves_the_model_as_deepspeed(runs):
    """Below ZeRO 3 the Trainer's checkpoint saves the weights through accelerate's get_state_dict
    (deepspeed.checkpoint.utils.clone_tensors_for_torch_save): the same tensors as DeepSpeed's, to 1e-5."""
    from safetensors.torch import load_file

    root, _ = runs
    ours, theirs = (load_file(os.path.join(root, s, "z2", "checkpoint-4", "model.safetensors"))
                    for s in ("shardspeed", "deepspeed"))
    assert set(ours) == set(theirs)
    for name, weight in ours.items():
        assert weight.dtype == torch.float32 and (weight - theirs[name]).abs().max() <= TOL, name
    assert "global_step4" in os.listdir(os.path.join(root, "shardspeed", "z2", "checkpoint-4"))
