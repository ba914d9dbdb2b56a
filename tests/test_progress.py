"""engine.progress(): a tqdm bar on rank 0 showing loss, LR and samples/s; off on other ranks and off a TTY."""
from __future__ import annotations

import io

import pytest
import torch

import shardspeed
from shardspeed.runtime.engine import Engine

CFG = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2,
       "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}}


@pytest.fixture(scope="module")
def engine():
    import torch.distributed as dist

    created = not dist.is_initialized()
    torch.manual_seed(0)
    eng, *_ = shardspeed.initialize(model=torch.nn.Linear(4, 1), config=CFG)
    yield eng
    if created and dist.is_initialized():
        dist.destroy_process_group()


def _train(engine, micro_steps):
    for _ in range(micro_steps):
        loss = engine(torch.randn(2, 4)).pow(2).mean()
        engine.backward(loss)
        engine.step()


def test_rank0_bar_counts_steps_and_shows_loss_lr_rate(engine):
    out = io.StringIO()
    bar = engine.progress(total=3, file=out, disable=False, mininterval=0)  # a forced "TTY"
    assert not bar.disable
    _train(engine, 6)  # 3 optimizer steps (2 micro-steps each)
    assert bar.n == 3
    postfix = bar.postfix
    assert "loss=" in postfix and "lr=0.001" in postfix and "samples/s=" in postfix
    assert f"{float(engine._last_loss):.4f}" in postfix
    bar.close()
    assert "loss=" in out.getvalue() and "3/3" in out.getvalue()
    assert engine._progress.bar is None  # closed bars are dropped


def test_wrapping_an_iterable(engine):
    out = io.StringIO()
    for _ in engine.progress(range(4), file=out, disable=False, mininterval=0):
        _train(engine, 1)
    assert "4/4" in out.getvalue() and "lr=" in out.getvalue()


def test_off_when_not_a_tty(engine):
    bar = engine.progress(total=2, file=io.StringIO())  # disable=None: a StringIO is not a TTY
    assert bar.disable
    _train(engine, 2)
    bar.close()


def test_off_on_other_ranks(engine, monkeypatch):
    monkeypatch.setattr(Engine, "global_rank", property(lambda self: 1))
    out = io.StringIO()
    bar = engine.progress(total=2, file=out, disable=False)
    assert bar.disable
    _train(engine, 2)
    bar.close()
    assert out.getvalue() == ""
