"""ShardspeedStrategy under lightning.Trainer (issue 15): 2 CPU ranks give DDP's losses at stages 2 and 3 and
resume exactly from the engine's checkpoint; conflicting Trainer settings are refused.

Lightning's launcher re-runs the calling script once per rank, so the fits run in tests/lightning_fit.py, a
script started in a subprocess with a timeout (see that file for the model, data and runs).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("lightning", reason="lightning is not installed (pip install -e '.[lightning]')")

HERE = os.path.dirname(os.path.abspath(__file__))
SCRIPT = os.path.join(HERE, "lightning_fit.py")


def _run(mode: str, out_dir: str, timeout: float) -> None:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.path.dirname(HERE), os.environ.get("PYTHONPATH", "")]),
               OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    for key in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "NODE_RANK"):
        env.pop(key, None)  # Lightning's launcher decides these
    proc = subprocess.run([sys.executable, SCRIPT, mode, out_dir], env=env, capture_output=True, text=True,
                          timeout=timeout)
    assert proc.returncode == 0, f"{mode} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"


def _load(out_dir: str, run: str, rank: int) -> dict:
    with open(os.path.join(out_dir, f"{run}.rank{rank}.json")) as f:
        return json.load(f)


@pytest.fixture(scope="module")
def parity_runs(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("lightning_parity"))
    _run("parity", out, timeout=240)
    return out


@pytest.mark.parametrize("stage,ref", [(2, "ddp_gas1"), (3, "ddp_gas2")])
def test_losses_match_ddp(parity_runs, stage, ref):
    """Stage 2 (no accumulation) and stage 3 (gradient_accumulation_steps 2 in the config; DDP with
    accumulate_grad_batches=2), both with dropout, AdamW + a per-step LambdaLR from configure_optimizers and
    norm clipping 0.5: every rank's per-batch loss equals DDP's to 1e-5, at the same global steps and LRs."""
    for rank in (0, 1):
        want, got = _load(parity_runs, ref, rank), _load(parity_runs, f"ss{stage}", rank)
        assert got["strategy"] == "ShardspeedStrategy" and want["strategy"] == "DDPStrategy"
        assert len(got["rows"]) == len(want["rows"]) == 16  # 2 epochs of 8 batches per rank
        for (ws, wb, wl, wlr), (gs, gb, gl, glr) in zip(want["rows"], got["rows"]):
            assert (gs, gb) == (ws, wb)
            assert abs(gl - wl) <= 1e-5, (rank, gs, gb, gl, wl)
            assert glr == pytest.approx(wlr, rel=1e-12)
        # configure_model ran under shardspeed.zero.Init at stage 3 only
        assert got["built_sharded"] is (stage == 3)


@pytest.mark.parametrize("stage", [2, 3])
def test_resume_from_checkpoint_is_exact(parity_runs, stage):
    """fit(ckpt_path=<the epoch-0 checkpoint>) continues with exactly the uninterrupted run's losses, LRs
    and global steps (weights, optimizer state, Lightning's loops and LR scheduler, and the RNG for dropout)."""
    ckpt = os.path.join(parity_runs, f"ss{stage}_ckpt", "epoch=0.ckpt")
    assert os.path.isfile(os.path.join(ckpt, "checkpoint", "metadata.json"))  # the engine's sharded checkpoint
    assert os.path.isfile(os.path.join(ckpt, "checkpoint", "rank00001.safetensors"))
    for rank in (0, 1):
        full = _load(parity_runs, f"ss{stage}", rank)["rows"]
        resumed = _load(parity_runs, f"ss{stage}_resume", rank)["rows"]
        assert resumed == full[8:]


def test_conflicting_trainer_settings_are_refused(tmp_path):
    """Accumulation and clipping come from the config: a Trainer value that disagrees is a clear error; with an
    empty config the Trainer's values fill it in (strategy="shardspeed_stage_2" from Lightning's registry)."""
    _run("errors", str(tmp_path), timeout=120)
    with open(tmp_path / "errors.json") as f:
        msgs = json.load(f)
    assert "accumulate_grad_batches=3" in msgs["accumulate"] and "(2 steps)" in msgs["accumulate"]
    assert "gradient_clip_val=0.5" in msgs["clip"] and "gradient_clipping 1.0" in msgs["clip"]
    assert "global norm only" in msgs["clip_value"]
    # 1 rank, 16 batches per epoch, 2 epochs, accumulation 2: 16 optimizer steps on both sides
    assert msgs["ok"] == {"gas": 2, "clip": 0.5, "global_step": 16, "engine_steps": 16}
