"""Lightning's own ``Trainer(strategy="deepspeed_stage_2")`` and ``"deepspeed_stage_3"``, unchanged, with ``import
deepspeed`` resolving to shardspeed's package: 2 CPU ranks give real DeepSpeed's per-batch losses (fp32, 1e-5) and
the same fp32 weights read back by ``deepspeed.utils.zero_to_fp32.get_fp32_state_dict_from_zero_checkpoint``
from the checkpoint Lightning's ``ModelCheckpoint`` saved (``engine.save_checkpoint(path, tag="checkpoint")``),
and ``fit(ckpt_path=<the epoch-0 checkpoint>)`` repeats the second epoch exactly.

Lightning refuses a CPU accelerator for its DeepSpeed strategy; tests/lightning_ds_fit.py ``--patch-cpu-check``
removes that CUDA-only check and nothing else (its docstring says exactly what), for both runs alike. The
unpatched run on GPUs is ``benchmarks/device_lightning.py``."""
from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("lightning", reason="lightning is not installed")
if importlib.util.find_spec("deepspeed") is None:
    pytest.skip("the real DeepSpeed (the oracle) is not installed", allow_module_level=True)

from shardspeed.compat import site_path  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "tests", "lightning_ds_fit.py")


def _env(pythonpath: str) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR",
                                                          "MASTER_PORT", "NODE_RANK", "PYTHONPATH")}
    env.update(OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore", DS_ACCELERATOR="cpu")
    if pythonpath:
        env["PYTHONPATH"] = pythonpath
    return env


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("lightning_ds")
    procs = {name: subprocess.Popen([sys.executable, SCRIPT, str(out / name), "--patch-cpu-check"], cwd=str(out),
                                    env=_env(path), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for name, path in (("ours", os.pathsep.join([site_path(), ROOT])), ("real", ""))}
    for name, proc in procs.items():
        _, err = proc.communicate(timeout=900)
        assert proc.returncode == 0, f"{name} failed:\n{err[-6000:]}"
    return out


def _load(out, name, stage, rank):
    with open(out / name / f"s{stage}.rank{rank}.json") as f:
        return json.load(f)


@pytest.mark.parametrize("stage", [2, 3])
def test_losses_and_weights_equal_deepspeed(runs, stage):
    for rank in (0, 1):
        ours, real = _load(runs, "ours", stage, rank), _load(runs, "real", stage, rank)
        assert ours["deepspeed"].endswith("+shardspeed.0.1.0") and "shardspeed" not in real["deepspeed"]
        assert ours["engine"] == "shardspeed.runtime.engine.Engine" and ours["is_engine"]  # isinstance DeepSpeedEngine
        assert real["engine"] == "deepspeed.runtime.engine.DeepSpeedEngine"
        assert len(ours["rows"]) == len(real["rows"]) == 16  # 2 epochs of 8 batches per rank
        for (gs, gb, gl), (ws, wb, wl) in zip(ours["rows"], real["rows"]):
            assert (gs, gb) == (ws, wb)
            assert abs(gl - wl) <= 1e-5, (stage, rank, gs, gl, wl)
        losses = [r[2] for r in ours["rows"]]
        assert sum(losses[8:]) < 0.5 * sum(losses[:8])  # it trained
        # fit(ckpt_path=<epoch-0 checkpoint>) runs the second epoch again, exactly
        assert ours["resumed_rows"] == ours["rows"][8:]
        assert len(real["resumed_rows"]) == 8
        for (gs, gb, gl), (ws, wb, wl) in zip(ours["resumed_rows"], real["resumed_rows"]):
            assert (gs, gb) == (ws, wb) and abs(gl - wl) <= 1e-5
    ours, real = _load(runs, "ours", stage, 0)["fp32"], _load(runs, "real", stage, 0)["fp32"]
    assert sorted(ours) == sorted(real) == ["net.0.bias", "net.0.weight", "net.2.bias", "net.2.weight",
                                            "net.4.bias", "net.4.weight"]
    for name in ours:
        assert max(abs(a - b) for a, b in zip(ours[name], real[name])) <= 1e-5, name
    # Lightning's checkpoint is the engine's save folder, tag "checkpoint" (its `latest` names it)
    saved = runs / "ours" / f"s{stage}_ckpt" / "epoch=1.ckpt"
    assert (saved / "latest").read_text().strip() == "checkpoint" and (saved / "checkpoint").is_dir()
