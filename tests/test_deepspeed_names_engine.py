"""DeepSpeed's names around the engine, against real DeepSpeed in the same world-2 workers: ``DeepSpeedEngine``
and ``DeepSpeedOptimizer`` isinstance checks at every stage, our ``FusedAdam`` / ``DeepSpeedCPUAdam`` passed to
``initialize`` train as DeepSpeed's engine with DeepSpeed's classes (fp32 losses 1e-5), ``zero_to_fp32`` on
DeepSpeed's checkpoints equals DeepSpeed's own converter (and on ours equals the engine's gathered weights),
``clone_tensors_for_torch_save`` as DeepSpeed's, and ZeRO-3 leaf modules become one unit each."""
from __future__ import annotations

import logging
import os
from typing import Any, Dict, List

import pytest
import torch
import torch.nn as nn
from distributed import run_distributed
from models import make_batches, make_model, micro_batch

pytest.importorskip("deepspeed")
os.environ.setdefault("DS_ACCELERATOR", "cpu")

STEPS = 3


def _cfg(stage: int, offload: bool = False, optimizer: bool = False) -> Dict[str, Any]:
    cfg: Dict[str, Any] = {"train_micro_batch_size_per_gpu": 2, "gradient_clipping": 0.0,
                           "zero_optimization": {"stage": stage, "reduce_bucket_size": 300,
                                                 "stage3_param_persistence_threshold": 0}}
    if offload:
        cfg["zero_optimization"]["offload_optimizer"] = {"device": "cpu"}
    if optimizer:
        cfg["optimizer"] = {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.01, "torch_adam": True}}
    return cfg


def _train(engine, kind: str = "mlp") -> List[float]:
    import torch.distributed as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    out = []
    for b in make_batches(kind, STEPS, 4):
        x, y = micro_batch(b, rank, world, 0, 1)
        loss = engine(x, y)
        engine.backward(loss)
        engine.step()
        total = loss.detach().clone()
        dist.all_reduce(total)
        out.append(float(total) / world)
    return out


def _client_optimizer(root, which: str, params):
    import importlib

    ops = importlib.import_module(f"{root}.ops.adam")
    if which == "fused":
        return ops.FusedAdam(params, lr=1e-2, weight_decay=0.01)
    return ops.DeepSpeedCPUAdam(params, lr=1e-2, weight_decay=0.01)


def _safe_get(root: str, init, stage: int) -> Dict[str, Any]:
    """After three steps: every parameter's full fp32 weights and Adam moments through ``<root>.utils``; then a
    set of one weight and one moment, read back (and the weight as the module then computes with it)."""
    import importlib

    u = importlib.import_module(f"{root}.utils")
    import torch.distributed as dist

    engine, opt, _, _ = init(model=make_model("mlp"), config=_cfg(stage, optimizer=True))
    _train(engine)
    x, y = micro_batch(make_batches("mlp", 1, 4, seed=7)[0], dist.get_rank(), dist.get_world_size(), 0, 1)
    engine.backward(engine(x, y))
    grad_of = (lambda p: p.grad) if root == "deepspeed" and stage == 0 else u.safe_get_full_grad
    out: Dict[str, Any] = {"grads": {n: grad_of(p).clone() for n, p in engine.module.named_parameters()}}
    engine.step()
    if root == "shardspeed":
        import shardspeed
        from shardspeed.runtime.base_optimizer import DeepSpeedOptimizer
        from shardspeed.runtime.engine import DeepSpeedEngine

        out["isinstance"] = [isinstance(engine, DeepSpeedEngine), isinstance(engine, shardspeed.DeepSpeedEngine),
                             isinstance(opt, DeepSpeedOptimizer), isinstance(engine.optimizer, DeepSpeedOptimizer),
                             isinstance(torch.optim.SGD(make_model("mlp").parameters(), lr=0.1), DeepSpeedOptimizer)]
    if root == "deepspeed" and stage == 0:  # DeepSpeed's getters answer None without ZeRO: its own tensors
        for name, p in engine.module.named_parameters():
            st = engine.optimizer.state[p]
            out[name] = [p.detach().clone(), st["exp_avg"].clone(), st["exp_avg_sq"].clone()]
        p = next(engine.module.parameters())
        out["set"] = [torch.full_like(p, 0.25), torch.full_like(p, 0.5)]
        return out
    for name, p in engine.module.named_parameters():
        out[name] = [u.safe_get_full_fp32_param(p).clone()] + [
            u.safe_get_full_optimizer_state(p, k).clone() for k in ("exp_avg", "exp_avg_sq")]
    p = next(engine.module.parameters())
    u.safe_set_full_fp32_param(p, torch.full_like(out["layers.0.weight"][0], 0.25))  # (stage 3: p is a shard)
    u.safe_set_full_optimizer_state(p, torch.full_like(out["layers.0.weight"][1], 0.5), "exp_avg")
    out["set"] = [u.safe_get_full_fp32_param(p).clone(), u.safe_get_full_optimizer_state(p, "exp_avg").clone()]
    if stage < 3:
        out["module_weight"] = p.detach().clone()
    return out


def _zero_to_fp32(base: str) -> Dict[str, Any]:
    """DeepSpeed's checkpoints (stages 2, 3; a tied model at 3) and ours (stage 3) through both converters."""
    import deepspeed
    import deepspeed.utils.zero_to_fp32 as theirs
    import torch.distributed as dist

    import shardspeed
    import shardspeed.utils.zero_to_fp32 as ours

    out: Dict[str, Any] = {}
    for kind, stage in (("mlp", 2), ("tied", 3), ("mlp_frozen", 3)):
        engine, *_ = deepspeed.initialize(model=make_model(kind), config=_cfg(stage, optimizer=True))
        _train(engine, kind)
        d = f"{base}/ds_{kind}{stage}"
        engine.save_checkpoint(d)
        dist.barrier()
        if dist.get_rank() == 0:
            for frozen in (False, True):
                want = theirs.get_fp32_state_dict_from_zero_checkpoint(d, exclude_frozen_parameters=frozen)
                got = ours.get_fp32_state_dict_from_zero_checkpoint(d, exclude_frozen_parameters=frozen)
                out[(kind, stage, frozen)] = (dict(got), dict(want))
            theirs.convert_zero_checkpoint_to_fp32_state_dict(d, f"{d}_theirs")
            ours.convert_zero_checkpoint_to_fp32_state_dict(d, f"{d}_ours")
            out[(kind, stage, "files")] = (sorted(os.listdir(f"{d}_ours")), sorted(os.listdir(f"{d}_theirs")))
            out[(kind, stage, "bin")] = (torch.load(f"{d}_ours/pytorch_model.bin"),
                                         torch.load(f"{d}_theirs/pytorch_model.bin"))
            model = ours.load_state_dict_from_zero_checkpoint(make_model(kind, seed=9), d)
            out[(kind, stage, "loaded")] = {k: v.clone() for k, v in model.state_dict().items()}
    engine, *_ = shardspeed.initialize(model=make_model("tied"), config=_cfg(3, optimizer=True))
    _train(engine, "tied")
    engine.save_checkpoint(f"{base}/ours3")
    with shardspeed.zero.GatheredParameters(list(engine.module.parameters())):
        gathered = {k: v.detach().clone() for k, v in engine.module.state_dict().items()}
    if dist.get_rank() == 0:
        out["ours"] = (ours.get_fp32_state_dict_from_zero_checkpoint(f"{base}/ours3"), gathered)
    return out


def _case(base: str) -> Dict[str, Any]:
    import deepspeed
    from deepspeed.checkpoint.utils import clone_tensors_for_torch_save as ds_clone

    import shardspeed
    from shardspeed.checkpoint.utils import clone_tensors_for_torch_save

    if not deepspeed.comm.is_initialized():
        deepspeed.init_distributed(dist_backend="gloo")
    deepspeed.utils.logger.setLevel(logging.WARNING)
    out: Dict[str, Any] = {"losses": {}}
    for which, stage, offload in (("fused", 0, False), ("fused", 2, False), ("fused", 3, False), ("cpu", 2, True)):
        for root, init in (("deepspeed", deepspeed.initialize), ("shardspeed", shardspeed.initialize)):
            model = make_model("mlp")
            engine, *_ = init(model=model, optimizer=_client_optimizer(root, which, model.parameters()),
                              config=_cfg(stage, offload))
            out["losses"][(which, stage, root)] = _train(engine)
    out["safe"] = {(root, stage): _safe_get(root, init, stage) for stage in range(4)
                   for root, init in (("deepspeed", deepspeed.initialize), ("shardspeed", shardspeed.initialize))}
    flat = torch.arange(10.0)
    item = {"a": [flat[2:4], (flat[:3], 7)], "b": {"c": flat.view(2, 5)}}
    mine, theirs = clone_tensors_for_torch_save(item), ds_clone(item)
    out["clone"] = (mine, theirs, mine["a"][0].untyped_storage().nbytes(), mine["a"][0].data_ptr() != flat[2:4].data_ptr())
    out.update(_zero_to_fp32(base))
    return out


@pytest.fixture(scope="module")
def results(deepspeed_optimizer_ops, tmp_path_factory):
    return run_distributed(_case, 2, str(tmp_path_factory.mktemp("dsnames")), timeout=900)


def test_engine_and_optimizer_isinstance(results):
    for r in results:
        for stage in range(4):  # the last: an optimizer no engine steps is not DeepSpeed's
            assert r["safe"][("shardspeed", stage)]["isinstance"] == [True, True, True, True, False], stage


@pytest.mark.parametrize("which,stage", [("fused", 0), ("fused", 2), ("fused", 3), ("cpu", 2)])
def test_client_optimizers_train_as_deepspeeds(results, which, stage):
    for r in results:
        ours, theirs = r["losses"][(which, stage, "shardspeed")], r["losses"][(which, stage, "deepspeed")]
        assert len(ours) == STEPS
        assert ours == pytest.approx(theirs, rel=1e-5, abs=1e-6)


@pytest.mark.parametrize("stage", range(4))
def test_safe_get_and_set_full_as_deepspeed(results, stage):
    """(At ZeRO 0 DeepSpeed's getters return None; ours answer, compared with DeepSpeed's own tensors.)"""
    for r in results:
        ours, theirs = r["safe"][("shardspeed", stage)], r["safe"][("deepspeed", stage)]
        assert sorted(set(ours) - {"module_weight", "isinstance"}) == sorted(set(theirs) - {"module_weight"})
        for name in theirs:
            if name in ("set", "module_weight", "isinstance"):
                continue
            if name == "grads":  # safe_get_full_grad between backward and step
                torch.testing.assert_close(ours[name], theirs[name], rtol=1e-5, atol=1e-7)
                continue
            for a, b in zip(ours[name], theirs[name]):
                torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
        weight, moment = ours["set"]
        assert torch.equal(weight, torch.full_like(weight, 0.25)) and torch.equal(moment, torch.full_like(moment, 0.5))
        torch.testing.assert_close(ours["set"], theirs["set"], rtol=0, atol=0)
        if stage < 3:
            assert torch.equal(ours["module_weight"], weight)


def test_clone_tensors_for_torch_save(results):
    mine, theirs, nbytes, copied = results[0]["clone"]
    torch.testing.assert_close(mine, theirs, rtol=0, atol=0)
    assert nbytes == 2 * 4 and copied  # the slice's own storage, not the flat buffer's


@pytest.mark.parametrize("kind,stage", [("mlp", 2), ("tied", 3), ("mlp_frozen", 3)])
def test_zero_to_fp32_reads_deepspeeds_checkpoints_as_deepspeed(results, kind, stage):
    r = results[0]
    for frozen in (False, True):
        got, want = r[(kind, stage, frozen)]
        assert sorted(got) == sorted(want), frozen
        for k in want:
            assert got[k].dtype == want[k].dtype
            torch.testing.assert_close(got[k], want[k], rtol=0, atol=0)
    files_ours, files_theirs = r[(kind, stage, "files")]
    assert files_ours == files_theirs == ["pytorch_model.bin"]
    bin_ours, bin_theirs = r[(kind, stage, "bin")]
    torch.testing.assert_close(bin_ours, bin_theirs, rtol=0, atol=0)
    loaded = r[(kind, stage, "loaded")]
    for k, v in loaded.items():
        torch.testing.assert_close(v, r[(kind, stage, False)][1][k], rtol=0, atol=0)


def test_zero_to_fp32_reads_ours(results):
    got, gathered = results[0]["ours"]
    assert sorted(got) == sorted(gathered)
    for k, v in gathered.items():
        torch.testing.assert_close(got[k], v.float(), rtol=0, atol=0)


class _Experts(nn.Module):
    def __init__(self):
        super().__init__()
        self.experts = nn.ModuleList(nn.Linear(16, 16) for _ in range(4))


class _MoE(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(4, 16)
        self.moe = _Experts()
        self.out = nn.Linear(16, 2)


def test_z3_leaf_modules_are_one_unit_each():
    from shardspeed.utils import get_z3_leaf_modules, set_z3_leaf_modules, unset_z3_leaf_modules
    from shardspeed.zero.stage3_units import select_units

    model = _MoE()
    before = [owner for owner, _ in select_units(model, max_numel=400)]
    assert model.moe not in before and all(e in before for e in model.moe.experts)  # split when too large
    assert set_z3_leaf_modules(model, ["_Experts"]) == [model.moe]
    assert get_z3_leaf_modules(model) == [model.moe]
    units = dict((id(o), ps) for o, ps in select_units(model, max_numel=400))
    assert len(units[id(model.moe)]) == 8 and not any(id(e) in units for e in model.moe.experts)
    assert unset_z3_leaf_modules(model, [_Experts]) == [model.moe] and get_z3_leaf_modules(model) == []
    with pytest.raises(ValueError, match="No modules of type"):
        set_z3_leaf_modules(model, [nn.Conv2d])
    assert set_z3_leaf_modules(model, [nn.Conv2d], raise_if_not_found=False) == []
    from shardspeed.utils import set_z3_leaf_modules_by_name, set_z3_leaf_modules_by_suffix

    assert set_z3_leaf_modules_by_name(model, ["moe", "nope"], raise_if_not_found=False) == ([model.moe], ["nope"])
    assert set_z3_leaf_modules_by_suffix(model, ["experts.1", "experts.2"]) == ([model.moe.experts[1],
                                                                                model.moe.experts[2]], [])
    assert get_z3_leaf_modules(model) == [model.moe, model.moe.experts[1], model.moe.experts[2]]
    with pytest.raises(ValueError, match="No modules named"):
        set_z3_leaf_modules_by_name(model, ["nope"])
