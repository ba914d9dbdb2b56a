"""The engine is an nn.Module, as DeepSpeedEngine is: ``engine.module`` registered, ``state_dict`` /
``load_state_dict`` through it (DeepSpeedEngine's ``module.<name>`` keys; the module's own keys accepted
too), ``engine(x)`` runs the engine's forward, ``train``/``eval`` return the engine, attributes pass through
to the module, and moving or casting the engine raises instead of breaking the sharded state."""
from __future__ import annotations

import pytest
import torch
from distributed import run_distributed
from models import make_batches, make_model, micro_batch


def _cfg(stage):
    return {"train_micro_batch_size_per_gpu": 2, "gradient_clipping": 0.0,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
            "zero_optimization": {"stage": stage, "reduce_bucket_size": 300,
                                  "stage3_param_persistence_threshold": 0}}


def _raises(fn) -> str:
    from shardspeed.errors import ShardspeedError

    try:
        fn()
    except ShardspeedError as exc:
        return str(exc)
    return "no error"


def _case(stage):
    import torch.distributed as dist
    import torch.nn as nn

    import shardspeed
    from shardspeed.checkpoint.engine_view import EngineView

    rank, world = dist.get_rank(), dist.get_world_size()
    model = make_model("mlp")
    engine, *_ = shardspeed.initialize(model=model, config=_cfg(stage))
    out = {"is_module": isinstance(engine, nn.Module), "module_is_model": engine.module is model,
           "children": [n for n, _ in engine.named_children()],
           "param_ids": [id(p) for p in engine.parameters()] == [id(p) for p in model.parameters()],
           "names": [n for n, _ in engine.named_parameters()],
           "model_names": [n for n, _ in model.named_parameters()],
           "passthrough": engine.layers is model.layers}
    out["train_returns_engine"] = engine.train() is engine and engine.training and model.training
    out["eval_returns_engine"] = engine.eval() is engine and not engine.training and not model.training
    engine.train()

    # engine(x) is the engine's forward (inputs moved, stage 3 gathers): train two steps through it
    for b in make_batches("mlp", 2, 4 * world):
        x, y = micro_batch(b, rank, world, 0, 1)
        engine.backward(engine(x.double(), y))  # double input: moved to the training dtype by forward
        engine.step()

    out["to_same"] = engine.to("cpu") is engine and engine.to(torch.float32) is engine and engine.cpu() is engine
    out["to_other"] = _raises(lambda: engine.to(torch.float64))
    out["half"] = _raises(lambda: engine.half())

    if stage == 3:
        out["state_dict"] = _raises(lambda: engine.state_dict())
        out["load_state_dict"] = _raises(lambda: engine.load_state_dict(make_model("mlp", seed=5).state_dict()))
        with shardspeed.zero.GatheredParameters(list(engine.parameters())):
            out["gathered_keys"] = sorted(engine.state_dict())
        return out

    sd = engine.state_dict()
    out["keys"] = sorted(sd)
    out["module_keys"] = sorted(engine.module_state_dict())
    out["model_keys"] = sorted(model.state_dict())
    out["reload_prefixed"] = str(engine.load_state_dict(sd))

    # load another model's weights (the module's own keys): parameters and fp32 masters follow
    other = make_model("mlp", seed=5)
    engine.load_state_dict(other.state_dict())
    want = dict(other.named_parameters())
    out["params_loaded"] = all(torch.equal(p, want[n]) for n, p in model.named_parameters())
    v = EngineView(engine)
    out["masters_loaded"] = all(
        torch.equal(pc.master, want[pc.name].detach().reshape(-1)[pc.start : pc.end])
        for pieces in v.pieces() for pc in pieces)
    return out


@pytest.fixture(scope="module")
def results():
    return {stage: run_distributed(_case, 2, stage)[0] for stage in (0, 2, 3)}


@pytest.mark.parametrize("stage", [0, 2, 3])
def test_engine_is_a_module(results, stage):
    r = results[stage]
    assert r["is_module"] and r["module_is_model"] and r["children"] == ["module"]
    assert r["param_ids"]
    assert r["names"] == ["module." + n for n in r["model_names"]]  # as DeepSpeedEngine (nn.Module's prefix)
    assert r["passthrough"]
    assert r["train_returns_engine"] and r["eval_returns_engine"]
    assert r["to_same"]
    assert "flat ZeRO buffers" in r["to_other"] and "flat ZeRO buffers" in r["half"]


@pytest.mark.parametrize("stage", [0, 2])
def test_state_dict_passes_through(results, stage):
    r = results[stage]
    assert r["keys"] == sorted("module." + k for k in r["model_keys"])
    assert r["module_keys"] == r["model_keys"]
    assert r["reload_prefixed"] == "<All keys matched successfully>"
    assert r["params_loaded"] and r["masters_loaded"]


def test_stage3_state_dict_needs_gathered_parameters(results):
    r = results[3]
    assert "GatheredParameters" in r["state_dict"] and "GatheredParameters" in r["load_state_dict"]
    assert r["gathered_keys"] == sorted("module." + k for k in results[0]["model_keys"])
