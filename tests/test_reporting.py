"""The engine's reporting parts work from a StepSnapshot alone (no engine, no process group): the
steps_per_print line, the skipped-step line, the timers' reset on other ranks, and the progress bar."""
from __future__ import annotations

import io
import logging

import torch

from shardspeed.comm.collectives import CommsLogger
from shardspeed.monitor.step_snapshot import StepSnapshot
from shardspeed.monitor.timers import Timers
from shardspeed.precision.loss_scaler import DynamicLossScaler, StaticLossScaler
from shardspeed.runtime.progress import ProgressSlot, make_progress
from shardspeed.runtime.reporting import StepLog


def _snap(step: int, samples: int = 0, loss: float = 0.5) -> StepSnapshot:
    return StepSnapshot(step=step, samples=samples, batch=4, loss=torch.tensor(loss), lrs=(1e-3,), loss_scale=1.0,
                        grad_norm=0.25)


def _timers() -> Timers:
    timers = Timers(True, torch.device("cpu"))
    with timers("forward"):
        pass
    return timers


def test_step_log_every_steps_per_print_on_rank0(caplog):
    timers = _timers()
    log = StepLog(2, timers, CommsLogger(), None, rank=0)
    with caplog.at_level(logging.INFO, logger="shardspeed"):
        log.after_step(_snap(1))
        assert caplog.text == ""  # not a multiple of steps_per_print
        log.after_step(_snap(2, loss=0.125))
    assert "step=2 loss=0.1250 lr=['0.001'] loss_scale=1 grad_norm=0.2500 samples/s=" in caplog.text
    assert "time per call: forward:" in caplog.text and not timers.totals  # reported, then reset


def test_step_log_silent_on_other_ranks_but_resets_the_timers(caplog):
    timers = _timers()
    log = StepLog(1, timers, CommsLogger(), None, rank=1)
    with caplog.at_level(logging.INFO, logger="shardspeed"):
        log.after_step(_snap(1))
        log.skipped(1, float("nan"), 1, StaticLossScaler(1.0))
    assert caplog.text == "" and not timers.totals


def test_skipped_step_lines(caplog):
    log = StepLog(None, None, CommsLogger(), None, rank=0)
    with caplog.at_level(logging.INFO, logger="shardspeed"):
        log.skipped(7, None, 1, DynamicLossScaler(init_scale=2.0 ** 8))
        log.skipped(8, float("inf"), 2, StaticLossScaler(1.0))
    levels = [(r.levelno, r.getMessage()) for r in caplog.records]
    assert levels[0] == (logging.INFO, "step 7: gradient overflow, step skipped; loss scale now 256")
    assert levels[1][0] == logging.WARNING
    assert levels[1][1].startswith("step 8: the global gradient norm is inf: step skipped on every rank (2 skipped")


def test_progress_bar_fed_by_its_slot():
    slot, out = ProgressSlot(), io.StringIO()
    bar = make_progress(slot, rank=0, samples0=8, total=2, file=out, disable=False, mininterval=0)
    assert slot.bar is bar
    slot.after_step(_snap(1, samples=12, loss=0.75))
    slot.after_step(_snap(2, samples=16, loss=0.5))
    assert bar.n == 2 and "loss=0.5000" in bar.postfix and "lr=0.001" in bar.postfix
    bar.close()
    assert slot.bar is None and "2/2" in out.getvalue()
    off = make_progress(slot, rank=1, samples0=0, total=1, file=io.StringIO(), disable=False)
    assert off.disable  # other ranks: no bar
    off.close()
