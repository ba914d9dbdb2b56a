"""Two engines in one process (issue 38): nothing is process-wide but which engine is current.

As TRL runs a policy and its reference model: a training engine (ZeRO 2, data 4) and an inference-only
ZeRO-3 engine (``initialize`` with no optimizer) used alternately; and two training engines with different
meshes, data 4 (ZeRO 2) and data 2 × model 2 (``tensor_parallel.autotp_size`` 2, ZeRO 3), stepped
alternately. Each equals, exactly (fp32), its own run as the only engine of the same process group.
DeepSpeed's module-level functions (``shardspeed.utils.groups``) answer for the current engine: the last
built, another inside ``using(engine)``, the one built before it again after its ``destroy()``; once every
engine is destroyed they fail with one line. The meshes' groups are built once: shared by the engines alive,
kept for the next engine after the last is destroyed. ``shardspeed.checkpointing.configure`` called before any
engine (Megatron-style) is taken over by the first. One world-4 process group checks every case.
"""
from __future__ import annotations

import torch
from distributed import run_distributed
from tp_models import GLOBAL_BATCH, lm_loss, local_params, make_tp_model, tp_batches, tp_config

STEPS = 2
#: name: (model seed, config); "ref" has no optimizer (a forward-only engine, as TRL's reference model)
ENGINES = {
    "dp": (0, tp_config(1, 2)),
    "tp": (0, tp_config(2, 3)),
    "policy": (0, tp_config(1, 2)),  # the same engine as "dp": its run alone is dp's
    "ref": (1, {"train_batch_size": GLOBAL_BATCH,
                "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}}),
}


def _build(name: str):
    import shardspeed

    seed, config = ENGINES[name]
    engine, optimizer, *_ = shardspeed.initialize(model=make_tp_model("gpt", seed=seed, n_layer=1), config=config)
    assert (optimizer is None) == (name == "ref")
    return engine


def _use(engine, name: str, x, y) -> float:
    """One training step (one forward without gradients for "ref") on this data rank's part of the batch;
    this rank's loss."""
    dp, r = engine.dp_world_size, engine.mpu.get_data_parallel_rank()
    n = x.shape[0] // dp
    x, y = x[r * n:(r + 1) * n], y[r * n:(r + 1) * n]
    if name == "ref":
        with torch.no_grad():
            return float(lm_loss("gpt", engine, x, y))
    loss = lm_loss("gpt", engine, x, y)
    engine.backward(loss)
    engine.step()
    return float(loss.detach())


def _params(engine) -> dict:
    return {n: value for n, (value, _slice) in local_params(engine).items()}


def _together(names, out: dict) -> dict:
    """Build the engines ``names`` (both before either runs), use them alternately; their losses, parameters."""
    engines = {name: _build(name) for name in names}
    for x, y in tp_batches(STEPS):
        for name, engine in engines.items():
            out.setdefault(name, []).append(_use(engine, name, x, y))
    return engines


def _groups() -> tuple:
    import shardspeed.utils.groups as groups

    return groups.get_data_parallel_world_size(), groups.get_tensor_model_parallel_world_size()


def _cases() -> dict:
    import shardspeed.checkpointing as ck
    import shardspeed.utils.groups as groups
    from shardspeed.errors import ShardspeedError
    from shardspeed.mesh.topology import Topology
    from shardspeed.zero.live_roots import unit_of

    ck.configure(None, num_checkpoints=3)  # Megatron-style, before any engine: the first engine takes it over
    tracker = ck.get_cuda_rng_tracker()
    alone: dict = {}
    topologies = {}
    for name in ("dp", "tp", "ref"):  # each the only engine of the process group, destroyed after
        engine = _build(name)
        if name == "dp":  # its config has no activation_checkpointing block: the configure() before survives
            taken_over = ck.settings().number_checkpoints == 3 and ck.get_cuda_rng_tracker() is tracker
        alone[name] = {"losses": [_use(engine, name, x, y) for x, y in tp_batches(STEPS)], "params": _params(engine)}
        topologies[name] = engine.topology
        engine.destroy()
    # the meshes' groups outlive the engines: ref's data-4 mesh is the one dp built, kept after its destroy()
    mesh_kept = topologies["ref"] is topologies["dp"] and topologies["tp"] is not topologies["dp"]
    alone["policy"] = alone["dp"]
    together: dict = {}
    # (a) TRL: a policy trained and a reference model asked, by turns
    trl = _together(("policy", "ref"), together)
    params = {name: _params(e) for name, e in trl.items()}
    for engine in trl.values():
        engine.destroy()
    # (b) two meshes: data 4, and data 2 × model 2
    pair = _together(("dp", "tp"), together)
    params.update({name: _params(e) for name, e in pair.items()})
    dp, tp = pair["dp"], pair["tp"]
    seen = {"latest": _groups(), "mesh_kept": mesh_kept}
    with groups.using(dp):
        seen["using_dp"] = _groups()
    seen["after_using"] = _groups()
    seen["mesh_shared"] = Topology.from_mesh(pipe=1, model=2) is tp.topology  # the engines alive share groups
    # a stage-3 parameter's unit is found by its own engine's root (nothing on the tensor points at it)
    seen["own_root"] = all(unit_of(p) is not None and unit_of(p)[1] is tp.param_manager and p.ds_numel > 0
                           and p.ds_id == id(p) for p in tp.module.parameters())  # and DeepSpeed's attributes
    seen["stage2_not_stage3"] = dp.param_manager is None and all(unit_of(p) is None for p in dp.module.parameters())
    tp.destroy()
    seen["root_gone"] = all(unit_of(p) is None for p in tp.module.parameters())  # destroy() closed the root
    seen["after_tp_destroyed"] = _groups()
    dp.destroy()
    seen["checkpointing"] = taken_over, ck.is_configured()  # after the last destroy(): as before any engine
    try:
        groups.get_data_parallel_rank()
        seen["after_all_destroyed"] = None
    except ShardspeedError as e:
        seen["after_all_destroyed"] = str(e)
    return {"alone": alone, "together": together, "params": params, "groups": seen}


def test_two_engines_in_one_process_each_as_alone():
    results = run_distributed(_cases, 4, timeout=300)
    for r, res in enumerate(results):
        alone = res["alone"]
        for name in ENGINES:
            # exactly the engine's own run as the only engine of the process group
            assert res["together"][name] == alone[name]["losses"], (r, name, res["together"][name], alone[name])
            assert res["params"][name].keys() == alone[name]["params"].keys()
            for pname, value in res["params"][name].items():
                assert torch.equal(value, alone[name]["params"][pname]), (r, name, pname)
        fresh = dict(make_tp_model("gpt", seed=1, n_layer=1).named_parameters())
        assert all(torch.equal(v, fresh[n].detach()) for n, v in alone["ref"]["params"].items())  # forward only
        seen = res["groups"]
        assert seen["latest"] == (2, 2) and seen["using_dp"] == (4, 1) and seen["after_using"] == (2, 2), seen
        assert seen["mesh_shared"] and seen["mesh_kept"] and seen["after_tp_destroyed"] == (4, 1), seen
        assert "no engine yet, or every engine was destroyed" in seen["after_all_destroyed"], seen
        assert "\n" not in seen["after_all_destroyed"]
        assert seen["checkpointing"] == (True, False), seen
        assert seen["own_root"] and seen["stage2_not_stage3"] and seen["root_gone"], seen
    # the engines differ: the reference model is not the policy, the two meshes' engines are not one
    assert results[0]["together"]["ref"] != results[0]["together"]["policy"]
