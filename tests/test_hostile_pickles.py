"""Hostile pickles in checkpoints: nothing in a checkpoint runs on load unless the caller trusts it.

Each file is crafted here. Our own checkpoint (world 1, ZeRO 1) has its ``common.pt`` replaced by a pickle
whose ``__reduce__`` runs ``touch MARKER``, with its CRC-32 and the metadata's SHA-256 recomputed (they
carry no key); a DeepSpeed ZeRO-0 checkpoint (the layout DeepSpeed writes with a torch optimizer, built by
hand so that DeepSpeed is not needed) carries the same payload in its model-states file. Both are refused
by ``load_checkpoint`` and by ``shardspeed convert`` (exit 1, one line, no traceback) with a line naming
the class and the opt-in; no marker appears and the engine's weights are unchanged. Client state of plain
builtins (``set``, ``range``, ``complex``, ``frozenset``; DeepSpeed's files pickle them under Python 2
names) loads without the opt-in; a class of the user's own needs ``trust_pickles=True`` and then loads.
"""
from __future__ import annotations

import json
import os
import shutil
from collections import OrderedDict
from typing import Any, Dict

import pytest
import torch
from distributed import run_distributed
from models import gathered_params, make_batches, make_model, micro_batch

CONFIG = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1,
          "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "torch_adam": True}},
          "zero_optimization": {"stage": 1}}
PLAIN = {"s": {1, 2}, "r": range(3), "c": 1j, "f": frozenset({4}), "sl": slice(1, 5, 2), "b": bytearray(b"x")}


class Payload:
    """Unpickling it runs ``touch path``."""

    def __init__(self, path: str):
        self.path = path

    def __reduce__(self):
        return os.system, (f"touch {self.path}",)


class Custom:
    """A client's own class: harmless, but not a plain type."""

    def __init__(self, value: int):
        self.value = value


def _rewrite_common(ckpt: str, obj: Any) -> None:
    """Replace ``ckpt/common.pt`` by ``obj`` pickled, with the CRC-32 and the metadata's checksum recomputed."""
    from shardspeed.checkpoint.format import crc32
    from shardspeed.checkpoint.metadata import metadata_checksum

    torch.save(obj, os.path.join(ckpt, "common.pt"))
    with open(os.path.join(ckpt, "common.pt"), "rb") as f:
        data = f.read()
    with open(os.path.join(ckpt, "metadata.json")) as f:
        d = json.load(f)
    d["files"]["common.pt"].update(crc32=crc32(data), bytes=len(data))
    d["checksum"] = metadata_checksum(d)
    with open(os.path.join(ckpt, "metadata.json"), "w") as f:
        json.dump(d, f)


def _deepspeed_zero0(path: str, engine, client: Dict[str, Any]) -> None:
    """A DeepSpeed ZeRO-0 fp32 checkpoint (torch optimizer) of ``engine``'s model, with ``client`` keys."""
    model = engine.module
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sum(p.sum() for p in model.parameters()).backward()
    opt.step()
    os.makedirs(f"{path}/global_step1")
    state = {"module": OrderedDict((k, v.clone()) for k, v in model.state_dict().items()), "buffer_names": [],
             "optimizer": opt.state_dict(), "param_shapes": None, "lr_scheduler": None, "global_steps": 1,
             "global_samples": 2, "skipped_steps": 0, "dp_world_size": 1, "mp_world_size": 1,
             "ds_config": CONFIG, "ds_version": "0.19.8", **client}
    torch.save(state, f"{path}/global_step1/mp_rank_00_model_states.pt")
    with open(f"{path}/latest", "w") as f:
        f.write("global_step1")


def _try_load(engine, path: str, **kw) -> Any:
    from shardspeed.errors import CheckpointError

    try:
        return engine.load_checkpoint(path, **kw)[1]
    except CheckpointError as exc:
        return f"error: {exc}"


def _run(base: str) -> Dict[str, Any]:
    import shardspeed

    marker = f"{base}/MARKER"
    engine, *_ = shardspeed.initialize(model=make_model("mlp"), config=CONFIG)
    x, y = micro_batch(make_batches("mlp", 1, 2)[0], 0, 1, 0, 1)
    engine.backward(engine(x, y))
    engine.step()
    engine.save_checkpoint(f"{base}/plain", client_state=dict(PLAIN))
    engine.save_checkpoint(f"{base}/custom", client_state={"obj": Custom(3)})
    shutil.copytree(f"{base}/plain", f"{base}/evil")
    _rewrite_common(f"{base}/evil/global_step1", {"counters": {}, "client_state": {"x": Payload(marker)}})
    _deepspeed_zero0(f"{base}/ds_evil", engine, {"x": Payload(marker)})
    _deepspeed_zero0(f"{base}/ds_plain", engine, dict(PLAIN))
    _deepspeed_zero0(f"{base}/ds_custom", engine, {"obj": Custom(5)})

    fresh, *_ = shardspeed.initialize(model=make_model("mlp", seed=7), config=CONFIG)
    before = gathered_params(fresh)
    out: Dict[str, Any] = {"evil": _try_load(fresh, f"{base}/evil"), "ds_evil": _try_load(fresh, f"{base}/ds_evil"),
                           "custom": _try_load(fresh, f"{base}/custom"),
                           "ds_custom": _try_load(fresh, f"{base}/ds_custom")}
    after = gathered_params(fresh)
    out["untouched"] = all(torch.equal(before[n], after[n]) for n in before)
    out["marker"] = os.path.exists(marker)
    out["plain"] = _try_load(fresh, f"{base}/plain")
    out["ds_plain"] = _try_load(fresh, f"{base}/ds_plain")
    custom = _try_load(fresh, f"{base}/custom", trust_pickles=True)
    ds_custom = _try_load(fresh, f"{base}/ds_custom", trust_pickles=True)
    out["trusted"] = [c if isinstance(c, str) else (type(c["obj"]).__name__, c["obj"].value)
                      for c in (custom, ds_custom)]
    return out


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    base = str(tmp_path_factory.mktemp("hostile"))
    return base, run_distributed(_run, 1, base, timeout=300)[0]


def _refused(msg: Any, name: str) -> None:
    assert isinstance(msg, str) and msg.startswith("error: "), msg
    assert "\n" not in msg and name in msg and "trust_pickles=True" in msg and "refused" in msg, msg


def test_hostile_pickles_are_refused_and_nothing_runs(results):
    _, r = results
    _refused(r["evil"], "posix.system")
    assert "common.pt" in r["evil"]
    _refused(r["ds_evil"], "posix.system")
    assert "mp_rank_00_model_states.pt" in r["ds_evil"]
    assert not r["marker"], "a checkpoint's pickle ran code"
    assert r["untouched"], "a refused load changed the engine's weights"


def test_a_clients_own_class_needs_the_opt_in(results):
    _, r = results
    _refused(r["custom"], "test_hostile_pickles.Custom")
    _refused(r["ds_custom"], "test_hostile_pickles.Custom")
    assert r["trusted"] == [("Custom", 3), ("Custom", 5)]


def test_plain_builtins_load_without_the_opt_in(results):
    """Ours (torch's protocol 2) and DeepSpeed's (Python 2 names: ``__builtin__.set``, ``xrange``)."""
    _, r = results
    assert r["plain"] == PLAIN
    assert {k: r["ds_plain"][k] for k in PLAIN} == PLAIN


@pytest.mark.parametrize("src,extra", [("evil", ["--world", "1", "--stage", "1"]), ("ds_evil", [])])
def test_convert_refuses_hostile_pickles(results, src, extra, capsys):
    """``shardspeed convert`` both ways: exit code 1 and one line on stderr (an uncaught error would raise here)."""
    from shardspeed.cli import main

    base, _ = results
    dst = f"{base}/out_{src}"
    capsys.readouterr()
    assert main(["convert", f"{base}/{src}", dst, *extra]) == 1
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err, err
    assert "posix.system" in lines[0] and "--trust-pickles" in lines[0], lines[0]
    assert not os.path.exists(f"{base}/MARKER")
    assert not os.path.exists(dst) or not os.listdir(dst)


def test_allowlist_maps_python2_builtins_and_refuses_the_rest():
    from shardspeed.checkpoint.deepspeed_layout.pickles import find_global
    from shardspeed.checkpoint.unpickle import PickleRefused

    assert find_global("__builtin__", "set") is set and find_global("__builtin__", "xrange") is range
    assert find_global("torch", "float32") is torch.float32
    assert find_global("deepspeed.runtime.zero.config", "ZeroStageEnum").ds_class.endswith("ZeroStageEnum")
    for module, name in (("posix", "system"), ("builtins", "eval"), ("__builtin__", "getattr"), ("torch", "load")):
        with pytest.raises(PickleRefused, match=f"{module.replace('__builtin__', 'builtins')}.{name}"):
            find_global(module, name)
    assert find_global("builtins", "eval", trust_pickles=True) is eval


def test_torch_load_fallback_goes_through_the_allowlist(tmp_path):
    """Files the lazy reader leaves to ``torch.load`` (torch's legacy non-zip format) are checked alike."""
    from shardspeed.checkpoint.deepspeed_layout.pickles import load_pt
    from shardspeed.checkpoint.unpickle import PickleRefused

    marker = tmp_path / "MARKER"
    torch.save({"x": Payload(str(marker)), "t": torch.ones(2)}, tmp_path / "evil.pt",
               _use_new_zipfile_serialization=False)
    torch.save({**PLAIN, "t": torch.ones(2)}, tmp_path / "plain.pt", _use_new_zipfile_serialization=False)
    with pytest.raises(PickleRefused, match="evil.pt names posix.system"):
        load_pt(str(tmp_path / "evil.pt"))
    assert not marker.exists()
    got = load_pt(str(tmp_path / "plain.pt"))
    assert {k: got[k] for k in PLAIN} == PLAIN and torch.equal(got["t"], torch.ones(2))
