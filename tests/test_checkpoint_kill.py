"""A saving process group SIGKILLed at any point leaves the previous checkpoint loadable and ``latest``
pointing at it (or at the new one, once fully committed).

Each crash point is one world-2 group that loads the good checkpoint, trains a step and dies while saving
(``crash_hook.install``: a rank kills itself after N bytes of its file, or at a named point of the
commit); one last group loads ``latest`` from every crashed directory and checks the weights.
"""
from __future__ import annotations

import os
import shutil

import crash_hook
import pytest
import torch
from distributed import run_distributed
from models import make_batches, make_model, micro_batch

# (crash spec, tag of the interrupted save: a new one, or the committed one again, i.e. an overwrite)
POINTS = [
    ("bytes=2000@0", "new"),  # rank 0 in the middle of its tensors
    ("after_metadata@0", "new"),  # complete temporary directory, not renamed
    ("after_rename", "new"),  # renamed, `latest` not yet updated
    ("after_move_old", "same"),  # overwriting the tag: old one moved aside, new one not yet in place
    ("after_rename", "same"),
]


def _engine():
    import torch.distributed as dist

    import shardspeed

    cfg = {"train_batch_size": 4, "train_micro_batch_size_per_gpu": 2,
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
           "zero_optimization": {"stage": 1, "reduce_bucket_size": 300}}
    return shardspeed.initialize(model=make_model("mlp", seed=dist.get_rank() + 5), config=cfg)[0]


def _train(e, steps):
    import torch.distributed as dist

    for b in make_batches("mlp", steps, 4, seed=e.global_steps + 11):
        x, y = micro_batch(b, dist.get_rank(), dist.get_world_size(), 0, 1)
        e.backward(e(x, y))
        e.step()


def _params(e):
    return {n: p.detach().clone() for n, p in e.module.named_parameters()}


def _good(d):
    e = _engine()
    _train(e, 2)
    e.save_checkpoint(d, tag="good")
    return _params(e)


def _crash(d, spec, tag):
    e = _engine()
    e.load_checkpoint(d)
    _train(e, 1)
    crash_hook.install(spec)
    e.save_checkpoint(d, tag="good" if tag == "same" else None)
    return "survived"


def _load_all(dirs):
    out = []
    for d in dirs:
        e = _engine()
        path, _ = e.load_checkpoint(d)
        out.append((path, e.global_steps, _params(e)))
    return out


def test_sigkill_during_save_leaves_latest_loadable(tmp_path):
    base = str(tmp_path / "base")
    want = run_distributed(_good, 2, base)[0]
    dirs = []
    for i, (spec, tag) in enumerate(POINTS):
        d = str(tmp_path / f"run{i}")
        shutil.copytree(base, d)
        with pytest.raises((RuntimeError, AssertionError)):  # a rank died: the group fails
            run_distributed(_crash, 2, d, spec, tag, timeout=60)
        dirs.append(d)
    got = run_distributed(_load_all, 2, dirs)[0]
    for (spec, tag), _d, (path, steps, params) in zip(POINTS, dirs, got):
        if spec == "after_rename" and tag == "same":
            # the new checkpoint was committed under the same tag (`latest` already named it)
            assert steps == 3, (spec, tag)
            continue
        assert steps == 2, (spec, tag, path)
        assert os.path.basename(path).startswith("good"), (spec, tag, path)
        for n, p in want.items():
            assert torch.equal(params[n], p), (spec, tag, n)
