"""Monitors (issue 15): DeepSpeed's CSV/TensorBoard files and events from rank 0, W&B/Comet, our additions.

The DeepSpeed side runs DeepSpeed 0.19.8's own engine (``DS_ACCELERATOR=cpu``, gloo) on the same model,
config and data, in its own 2-rank group; the comparisons skip when deepspeed is not installed.
"""
from __future__ import annotations

import csv
import os
import sys
import types
from pathlib import Path
from typing import Dict, List

import pytest
import torch
from distributed import run_distributed
from models import make_model

STEPS, GAS, MICRO = 4, 2, 2
TOKENS_PER_SAMPLE = 16  # the MLP's input width, standing in for a sequence length

# what shardspeed writes beyond DeepSpeed's engine on the CPU (docs/monitoring.md); memory_device_bytes
# needs an accelerator, tokens_per_sec needs set_tokens_per_sample, tflops/mfu need a flop count and a peak
OUR_ADDITIONS = {"train_loss", "samples_per_sec", "tokens_per_sec", "grad_norm", "memory_host_rss_bytes",
                 "comm_bytes_per_step"}


def _config(out: str, fp16: bool = True) -> dict:
    return {
        "train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": GAS,
        "optimizer": {"type": "Adam", "params": {"lr": 1e-2, "torch_adam": True}},
        "scheduler": {"type": "WarmupLR",
                      "params": {"warmup_min_lr": 0, "warmup_max_lr": 1e-2, "warmup_num_steps": 4}},
        "fp16": {"enabled": fp16, "initial_scale_power": 8},
        "zero_optimization": {"stage": 2},
        "wall_clock_breakdown": True,
        "csv_monitor": {"enabled": True, "output_path": out, "job_name": "job"},
        "tensorboard": {"enabled": True, "output_path": out, "job_name": "job_tb"},
    }


def _batches(rank: int, dtype: torch.dtype):
    g = torch.Generator().manual_seed(100 + rank)
    for _ in range(STEPS * GAS):
        yield torch.randn(MICRO, 16, generator=g).to(dtype), torch.randn(MICRO, 8, generator=g).to(dtype)


def _train_shardspeed(root: str, fp16: bool) -> dict:
    import shardspeed

    rank = torch.distributed.get_rank()
    model = make_model("mlp")
    # each rank its own output_path: whatever rank 1 wrote would be under rank1/
    engine, *_ = shardspeed.initialize(model=model, config=_config(os.path.join(root, f"rank{rank}"), fp16))
    engine.set_tokens_per_sample(TOKENS_PER_SAMPLE)
    for x, y in _batches(rank, torch.float16 if fp16 else torch.float32):
        engine.backward(engine(x, y))
        engine.step()
    sinks = len(engine.monitor.sinks)
    engine.monitor.close()
    return {"sinks": sinks, "comms": engine.comms_summary(), "fp16": fp16}


def _train_deepspeed(root: str, fp16: bool) -> int:
    os.environ["DS_ACCELERATOR"] = "cpu"
    import deepspeed

    rank = torch.distributed.get_rank()
    model = make_model("mlp")
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=_config(root, fp16))
    for x, y in _batches(rank, torch.float16 if fp16 else torch.float32):
        engine.backward(engine(x, y))
        engine.step()
    return rank


def _read_csv(path: Path) -> List[List[str]]:
    with open(path, newline="") as f:
        return list(csv.reader(f))


def _csv_series(directory: Path) -> Dict[str, List[List[str]]]:
    return {p.name: _read_csv(p) for p in sorted(directory.glob("*.csv"))}


def _tb_series(directory: Path) -> Dict[str, List[tuple]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(directory))
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    pytest.importorskip("tensorboard")
    root = tmp_path_factory.mktemp("monitor")
    ds_fp16 = _deepspeed_has_fp16()
    fp16 = True if ds_fp16 is None else ds_fp16  # without DeepSpeed, ours alone trains in fp16 (a loss scale)
    ours = run_distributed(_train_shardspeed, 2, str(root / "ours"), fp16)
    ds_root = None
    if ds_fp16 is not None:
        ds_root = root / "deepspeed"
        run_distributed(_train_deepspeed, 2, str(ds_root), fp16, timeout=300)
    return root / "ours", ds_root, ours


def _deepspeed_has_fp16():
    """None without DeepSpeed; else whether its CPU accelerator trains fp16 on this processor (it needs
    oneDNN's fp16 support: AVX512-FP16 or AMX). Without it both sides run in fp32, where DeepSpeed and we
    write no loss scale."""
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    try:
        from deepspeed.accelerator import get_accelerator
    except ImportError:
        return None
    return bool(get_accelerator().is_fp16_supported())


def _scale_names(results) -> set:
    return {"loss_scale"} if results[0]["fp16"] else set()


def _need_deepspeed(ds_root):
    if ds_root is None:
        pytest.skip("deepspeed is not installed (pip install deepspeed; DS_ACCELERATOR=cpu runs it on CPU)")


def test_rank0_writes_rank1_nothing(runs):
    ours_root, _, results = runs
    assert results[0]["sinks"] == 2 and results[1]["sinks"] == 0
    assert not (ours_root / "rank1").exists()
    assert len(list((ours_root / "rank0" / "job_tb").glob("events.out.tfevents.*"))) == 1


def test_csv_files_headers_steps_match_deepspeed(runs):
    ours_root, ds_root, results = runs
    _need_deepspeed(ds_root)
    ours, theirs = _csv_series(ours_root / "rank0" / "job"), _csv_series(ds_root / "job")
    assert set(theirs) == {f"Train_Samples_{n}.csv" for n in {
        "lr", "elapsed_time_ms_forward", "elapsed_time_ms_backward", "elapsed_time_ms_backward_inner",
        "elapsed_time_ms_backward_allreduce", "elapsed_time_ms_step"} | _scale_names(results)}
    assert set(ours) - set(theirs) == {f"Train_Samples_{n}.csv" for n in OUR_ADDITIONS}
    assert set(theirs) <= set(ours)
    samples = [str(MICRO * GAS * 2 * (i + 1)) for i in range(STEPS)]  # global samples after each step
    for name, rows in theirs.items():
        assert ours[name][0] == rows[0], name  # the header: step,<last part of the event name>
        assert [r[0] for r in ours[name][1:]] == [r[0] for r in rows[1:]] == samples, name
    for name in OUR_ADDITIONS:
        rows = ours[f"Train_Samples_{name}.csv"]
        assert rows[0] == ["step", name]
        steps = [r[0] for r in rows[1:]]
        assert steps == (samples[1:] if name.endswith("_per_sec") else samples), name  # rates: from step 2
    # the same bytes in the header line, \r\n included (the csv module's default, as DeepSpeed's files)
    assert (ours_root / "rank0" / "job" / "Train_Samples_lr.csv").read_bytes().startswith(b"step,lr\r\n")
    assert (ds_root / "job" / "Train_Samples_lr.csv").read_bytes().startswith(b"step,lr\r\n")


def test_values_equal_where_both_compute_them(runs):
    ours_root, ds_root, results = runs
    _need_deepspeed(ds_root)
    ours, theirs = _csv_series(ours_root / "rank0" / "job"), _csv_series(ds_root / "job")
    for name in ["Train_Samples_lr.csv"] + [f"Train_Samples_{n}.csv" for n in _scale_names(results)]:
        assert [float(r[1]) for r in ours[name][1:]] == pytest.approx([float(r[1]) for r in theirs[name][1:]],
                                                                      rel=1e-12, abs=0), name
    for name, rows in ours.items():
        if "elapsed_time_ms" in name:
            assert all(float(r[1]) >= 0 for r in rows[1:]), name
    inner = [float(r[1]) for r in ours["Train_Samples_elapsed_time_ms_backward_inner.csv"][1:]]
    reduce = [float(r[1]) for r in ours["Train_Samples_elapsed_time_ms_backward_allreduce.csv"][1:]]
    total = [float(r[1]) for r in ours["Train_Samples_elapsed_time_ms_backward.csv"][1:]]
    assert [a + b for a, b in zip(inner, reduce)] == pytest.approx(total, rel=1e-6)
    sps = [float(r[1]) for r in ours["Train_Samples_samples_per_sec.csv"][1:]]
    tps = [float(r[1]) for r in ours["Train_Samples_tokens_per_sec.csv"][1:]]
    assert tps == pytest.approx([s * TOKENS_PER_SAMPLE for s in sps])
    assert all(float(r[1]) > 0 for r in ours["Train_Samples_comm_bytes_per_step.csv"][1:])
    assert all(float(r[1]) > 2**20 for r in ours["Train_Samples_memory_host_rss_bytes.csv"][1:])


def test_comm_bytes_per_step_is_the_comms_log_delta(runs):
    _, _, results = runs
    ours_root = runs[0]
    per_step = [int(r[1]) for r in _read_csv(ours_root / "rank0" / "job" / "Train_Samples_comm_bytes_per_step.csv")[1:]]
    total = sum(s["msg_bytes"] for s in results[0]["comms"].values())
    loss_reduce = STEPS * 2 * 4  # the monitor's own [loss, has_loss] float32 all_reduce, not counted in a step
    assert len(set(per_step[1:])) == 1  # the same collectives every step at stage 2 (the first step also
    assert per_step[0] >= per_step[1]  # has one-time ones, e.g. agreeing on the reduction order)
    assert sum(per_step) + loss_reduce == total  # the comms log starts counting after the initial broadcast


def test_tensorboard_events_equal_the_csv(runs):
    ours_root, ds_root, _ = runs
    dirs = [(ours_root / "rank0" / "job", ours_root / "rank0" / "job_tb")]
    if ds_root is not None:  # DeepSpeed's own pair reads back the same way
        dirs.append((ds_root / "job", ds_root / "job_tb"))
    for csv_dir, tb_dir in dirs:
        series = _tb_series(tb_dir)
        files = _csv_series(csv_dir)
        assert {t.replace("/", "_") + ".csv" for t in series} == set(files)
        for tag, points in series.items():
            rows = files[tag.replace("/", "_") + ".csv"][1:]
            assert [p[0] for p in points] == [int(r[0]) for r in rows], tag
            # TensorBoard keeps float32
            assert [p[1] for p in points] == pytest.approx([float(r[1]) for r in rows], rel=1e-6), tag


# ---- W&B, Comet and missing packages (one rank) -------------------------------------------------------------
def _missing_package(block: str, module: str, out: str) -> str:
    import shardspeed
    from shardspeed.errors import ConfigError

    sys.modules[module] = None  # type: ignore[assignment]  # import fails, installed or not
    cfg = {"train_batch_size": 2, "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
           block: {"enabled": True, **({"output_path": out} if block == "tensorboard" else {})}}
    try:
        shardspeed.initialize(model=make_model("mlp"), config=cfg)
    except ConfigError as exc:
        return str(exc)
    return "no error"


@pytest.mark.parametrize("block,module,pip", [("wandb", "wandb", "pip install wandb"),
                                              ("comet", "comet_ml", 'pip install "comet_ml>=3.41.0"'),
                                              ("tensorboard", "tensorboard", "pip install tensorboard")])
def test_missing_package_is_a_one_line_error_at_initialize(tmp_path, block, module, pip):
    msg = run_distributed(_missing_package, 1, block, module, str(tmp_path))[0]
    assert "\n" not in msg and module in msg and pip in msg and f"{block}.enabled" in msg, msg
    assert not list(tmp_path.iterdir())  # nothing was created


def _fake_sinks(out: str) -> dict:
    import shardspeed

    calls: dict = {"wandb_init": [], "wandb_log": [], "comet_start": [], "comet_log": [], "comet_name": []}
    wandb = types.ModuleType("wandb")
    wandb.init = lambda **kw: calls["wandb_init"].append(kw)  # type: ignore[attr-defined]
    wandb.log = lambda data, step=None: calls["wandb_log"].append((data, step))  # type: ignore[attr-defined]
    wandb.finish = lambda: None  # type: ignore[attr-defined]

    class Experiment:
        def set_name(self, name):
            calls["comet_name"].append(name)

        def log_metric(self, name, value, step=None):
            calls["comet_log"].append((name, value, step))

        def end(self):
            pass

    comet = types.ModuleType("comet_ml")
    comet.__version__ = "3.45.0"  # type: ignore[attr-defined]
    comet.start = lambda **kw: calls["comet_start"].append(kw) or Experiment()  # type: ignore[attr-defined]
    sys.modules["wandb"], sys.modules["comet_ml"] = wandb, comet
    cfg = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1,
           "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
           "wandb": {"enabled": True, "project": "p", "group": "g", "team": "t"},
           "comet": {"enabled": True, "project": "cp", "workspace": "ws", "experiment_name": "exp",
                     "samples_log_interval": 4}}
    engine, *_ = shardspeed.initialize(model=make_model("mlp"), config=cfg)
    engine.set_flops_per_sample(1e9)
    engine.set_peak_flops(1e12)
    g = torch.Generator().manual_seed(0)
    for _ in range(5):
        engine.backward(engine(torch.randn(2, 16, generator=g), torch.randn(2, 8, generator=g)))
        engine.step()
    return calls


def test_wandb_and_comet_get_the_events(tmp_path):
    calls = run_distributed(_fake_sinks, 1, str(tmp_path))[0]
    assert calls["wandb_init"] == [{"project": "p", "group": "g", "entity": "t"}]
    logged = {}
    for data, step in calls["wandb_log"]:
        (name, value), = data.items()
        logged.setdefault(name, []).append((step, value))
    assert [s for s, _ in logged["Train/Samples/lr"]] == [2, 4, 6, 8, 10]
    assert "Train/Samples/loss_scale" not in logged  # fp32: as DeepSpeed, no loss scale
    assert "Train/Samples/elapsed_time_ms_forward" not in logged  # wall_clock_breakdown off
    # additions that need a flop count and a peak: per device, from the second step
    sps = dict(logged["Train/Samples/samples_per_sec"])
    tflops = dict(logged["Train/Samples/tflops"])
    mfu = dict(logged["Train/Samples/mfu"])
    assert set(sps) == set(tflops) == set(mfu) == {4, 6, 8, 10}
    for s in sps:
        assert tflops[s] == pytest.approx(1e9 * sps[s] / 1e12)
        assert mfu[s] == pytest.approx(tflops[s] * 1e12 / 1e12)
    assert calls["comet_start"] == [{"api_key": None, "project": "cp", "workspace": "ws", "experiment_key": None,
                                     "mode": None, "online": None}]
    assert calls["comet_name"] == ["exp"]
    comet_lr = [step for name, _, step in calls["comet_log"] if name == "Train/Samples/lr"]
    assert comet_lr == [2, 6, 10]  # at most once per samples_log_interval (4) samples, the first always


def test_no_flop_count_no_tflops(runs):
    ours_root = runs[0]
    names = {p.name for p in (ours_root / "rank0" / "job").glob("*.csv")}
    assert not {"Train_Samples_tflops.csv", "Train_Samples_mfu.csv", "Train_Samples_memory_device_bytes.csv"} & names
