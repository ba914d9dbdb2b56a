"""ZeRO-Offload / ZeRO-Infinity: an offloaded run trains exactly as the same run without offload.

Every case runs twice in the same 2-rank process group, without offload and with it, and compares losses
and final parameters (fp32: 1e-6 relative; the host step uses the same fused kernel, so in practice
they agree bit for bit). Tiles are made small (``sub_group_size``) so a unit spans several tiles and the
NVMe pool (``buffer_count``) is smaller than the state, which is what exercises the streaming.
"""
from __future__ import annotations

import itertools
import os

import pytest
import torch
from distributed import run_distributed
from models import gathered_params, make_model, train_global_losses

STEPS = 4
LR = 1e-2
CLIP = 0.5


def _config(stage: int, gas: int, dtype: str, offload: str, nvme_path: str, *, optimizer: str = "AdamW",
            sub_group: int = 200, buffer_count: int = 2, clip: float = CLIP) -> dict:
    cfg = {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": gas,
        "gradient_clipping": clip,
        "optimizer": {"type": optimizer, "params": {"lr": LR, "weight_decay": 0.01}},
        "zero_optimization": {"stage": stage, "reduce_bucket_size": 700, "overlap_comm": True,
                              "sub_group_size": sub_group},
    }
    if optimizer == "SGD":
        cfg["optimizer"]["params"]["momentum"] = 0.9
    offload, _, param = offload.partition("+")  # "cpu+param": offload_param cpu as well (stage 3)
    if param:  # "+pnvme": offload_param nvme (shards in a file under nvme_path)
        cfg["zero_optimization"]["offload_param"] = ({"device": "nvme", "nvme_path": nvme_path} if param == "pnvme"
                                                     else {"device": "cpu", "pin_memory": True})
        cfg["zero_optimization"]["stage3_param_persistence_threshold"] = 0
    if offload != "none":
        offload, _, ratio = offload.partition("@")  # "cpu@0.5": ratio 0.5 (stage 3)
        block = {"device": offload, "buffer_count": buffer_count, "pin_memory": True, "ratio": float(ratio or 1)}
        if offload == "nvme":
            block["nvme_path"] = nvme_path
        cfg["zero_optimization"]["offload_optimizer"] = block
    if dtype == "bf16":
        cfg["bf16"] = {"enabled": True}
    if dtype == "fp16":  # 2**17 overflows at first: the first steps are skipped, then scaling settles
        cfg["fp16"] = {"enabled": True, "initial_scale_power": 17, "loss_scale_window": 2, "hysteresis": 1}
    return cfg


def _train(kind: str, cfg: dict, gas: int) -> dict:
    import shardspeed

    model = make_model(kind)
    groups = None
    if kind == "mlp":  # two param groups: weight decay on matrices only
        decay = [p for n, p in model.named_parameters() if n.endswith("weight")]
        rest = [p for n, p in model.named_parameters() if not n.endswith("weight")]
        groups = [{"params": decay}, {"params": rest, "weight_decay": 0.0}]
    engine, *_ = shardspeed.initialize(model=model, model_parameters=groups, config=cfg)
    losses = train_global_losses(engine, kind, STEPS, gas)
    params = gathered_params(engine)
    assert all(p.numel() for p in params.values())
    out = {"losses": losses, "params": params, "skipped": engine.skipped_steps, "mem": engine.memory_breakdown(),
           "scale": engine.cur_scale}
    master = engine.master_weights
    out["shard_bytes"] = sum(u.shard.numel() * u.shard.element_size() for u in master.units)
    placements = [u.placement for u in master.units]
    pf = placements[0].file if placements and placements[0].in_file else None
    if pf is not None:  # offload_param nvme: the file holds every shard, none is kept in memory
        out["pfile_dir"], out["pfile_list"] = pf.dir, sorted(os.listdir(pf.dir))
        pf.flush()  # the writes queued behind the training thread are in the file
        with open(pf.path, "rb") as f:
            raw = f.read()
        out["pfile_size"] = len(raw)
        out["pfile_holds_shards"] = all(
            u.placement.where == "file" and u.placement.resident() is None and u.placement.bytes_held() == 0
            and u.placement.file is pf and torch.equal(
                torch.frombuffer(bytearray(raw[u.placement.offset: u.placement.offset + u.shard.numel()
                                               * u.shard.element_size()]), dtype=u.dtype), u.shard)
            for u in master.units)
    out["shards_on_host"] = [not u.placement.on_device and u.shard.device.type == "cpu" for u in master.units]
    if hasattr(master, "host_store") and master.host_store is not None and hasattr(master.host_store, "dir"):
        out["nvme_dir"] = master.host_store.dir
        out["nvme_files"] = sorted(os.listdir(master.host_store.dir))
        t = master.host_tiles[-1]  # the files hold the state: the master tile, cast, is the trained shard
        st = master.tile_state(t)
        out["file_master_matches"] = bool(torch.equal(st.master.to(master.units[t.unit].dtype), master.units[t.unit].shard[t.lo:t.hi]))
        out["file_moments_nonzero"] = bool(st.exp_avg_sq.abs().sum() > 0)
        out["pool_bytes"] = master.host_store.buffer_bytes
        out["pool_bound"] = cfg["zero_optimization"]["offload_optimizer"]["buffer_count"] * 3 * 4 * \
            -(-cfg["zero_optimization"]["sub_group_size"] // 1024) * 1024  # rows of whole 4 KiB blocks (O_DIRECT)
    master.close()
    return out


def _cases():
    fp32 = [("mlp", s, g, "fp32", dev) for s, g, dev in itertools.product([1, 2, 3], [1, 2], ["cpu", "nvme"])]
    return fp32 + [
        ("mlp", 3, 2, "fp32", "cpu@0.5"),
        ("mlp", 3, 1, "fp32", "nvme@0.5"),
        ("tied", 3, 2, "fp32", "nvme"),
        ("mlp", 3, 2, "bf16", "nvme"),
        ("tied", 2, 2, "fp32", "nvme"),
        ("tied", 1, 1, "fp32", "cpu"),
        ("mlp", 2, 2, "bf16", "cpu"),
        ("mlp", 1, 2, "bf16", "nvme"),
        ("mlp", 2, 1, "fp16", "cpu"),
        ("mlp", 1, 2, "fp16", "nvme"),
        # offload_param cpu: parameter shards in host memory, alone and with optimizer offload
        ("mlp", 3, 2, "fp32", "none+param"),
        ("mlp", 3, 1, "fp32", "cpu+param"),
        ("tied", 3, 2, "fp32", "nvme+param"),
        ("mlp", 3, 2, "bf16", "cpu+param"),
        # offload_param nvme: parameter shards in a file, alone and with optimizer offload
        ("mlp", 3, 2, "fp32", "none+pnvme"),
        ("mlp", 3, 1, "fp32", "nvme+pnvme"),
        ("tied", 3, 2, "fp32", "cpu+pnvme"),
        ("mlp", 3, 2, "bf16", "nvme+pnvme"),
    ]


def dist_rank() -> int:
    import torch.distributed as dist

    return dist.get_rank()


def _run_all(nvme_path: str) -> list:
    out = []
    for kind, stage, gas, dtype, dev in _cases():
        ref = _train(kind, _config(stage, gas, dtype, "none", nvme_path), gas)
        got = _train(kind, _config(stage, gas, dtype, dev, nvme_path), gas)
        out.append(((kind, stage, gas, dtype, dev), ref, got))
    # a non-Adam optimizer takes the generic host path (cpu only); nvme refuses it clearly
    ref = _train("mlp", _config(2, 2, "fp32", "none", nvme_path, optimizer="SGD"), 2)
    got = _train("mlp", _config(2, 2, "fp32", "cpu", nvme_path, optimizer="SGD"), 2)
    out.append((("mlp", 2, 2, "fp32", "cpu-sgd"), ref, got))
    from shardspeed.errors import ConfigError
    with pytest.raises(ConfigError, match="supports Adam, AdamW"):
        _train("mlp", _config(2, 1, "fp32", "nvme", nvme_path, optimizer="SGD"), 1)
    not_a_dir = os.path.join(nvme_path, f"a-file-{dist_rank()}")
    open(not_a_dir, "w").close()
    cfg = _config(3, 1, "fp32", "none", nvme_path)
    cfg["zero_optimization"]["offload_param"] = {"device": "nvme", "nvme_path": not_a_dir}
    with pytest.raises(ConfigError, match="nvme_path .* (cannot be created|is not a directory)"):
        _train("mlp", cfg, 1)
    # one pool buffer (no read-ahead) and no clipping still match
    ref = _train("mlp", _config(1, 1, "fp32", "none", nvme_path, clip=0.0), 1)
    got = _train("mlp", _config(1, 1, "fp32", "nvme", nvme_path, buffer_count=1, clip=0.0), 1)
    out.append((("mlp", 1, 1, "fp32", "nvme-1buf"), ref, got))
    return out


def test_offload_matches_no_offload(tmp_path):
    results = run_distributed(_run_all, 2, str(tmp_path), timeout=600)
    for r in range(2):
        for case, ref, got in results[r]:
            dtype = case[3]
            tol = 1e-6 if dtype == "fp32" else 1e-6  # same kernel, same inputs: low precision matches too
            torch.testing.assert_close(torch.tensor(got["losses"]), torch.tensor(ref["losses"]), rtol=tol, atol=0,
                                       msg=lambda m, r=r, case=case: f"rank {r} {case} losses: {m}")
            for name, p in ref["params"].items():
                torch.testing.assert_close(got["params"][name], p, rtol=tol, atol=1e-7,
                                           msg=lambda m, r=r, case=case, name=name: f"rank {r} {case} param {name}: {m}")
            assert got["skipped"] == ref["skipped"], case
            if dtype == "fp16":
                assert 1 <= ref["skipped"] < STEPS, f"{case}: skipped {ref['skipped']} of {STEPS} steps"
                assert got["scale"] == ref["scale"]
            if case[4].endswith("+pnvme"):  # parameter shards in the file only: none in memory, none counted
                assert got["pfile_list"] == ["owner.lock", "params.bin"] and got["pfile_holds_shards"], case
                assert got["pfile_size"] >= got["shard_bytes"] > 0, case
                assert not os.path.exists(got["pfile_dir"]), "close() removes the parameter file"
                assert got["mem"]["parameters"] == 0 and got["mem"]["offloaded_parameters"] == 0, (case, got["mem"])
                if case[4].startswith("none"):
                    continue
            if case[4].endswith("+param"):  # parameter shards counted on the host, none left on the device
                assert all(got["shards_on_host"]) and not any(ref["shards_on_host"]), case
                assert got["mem"]["offloaded_parameters"] == got["shard_bytes"] > 0, (case, got["mem"])
                assert got["mem"]["parameters"] == 0 and ref["mem"]["parameters"] > 0, (case, got["mem"], ref["mem"])
                assert ref["mem"]["offloaded_parameters"] == 0
                if case[4].startswith("none"):  # optimizer on the device: the fp32 master is a copy now
                    assert got["mem"]["optimizer_states"] == ref["mem"]["optimizer_states"] > 0, case
                    continue
            if "@" not in case[4]:  # fully offloaded: no master/optimizer state on the device
                assert got["mem"]["master_weights"] == 0 and got["mem"]["optimizer_states"] == 0, (case, got["mem"])
            else:  # ratio 0.5 keeps part of it there
                assert got["mem"]["optimizer_states"] > 0, (case, got["mem"])
            if case[4].startswith("nvme") and "nvme_files" in got:
                assert got["nvme_files"] == ["exp_avg.f32", "exp_avg_sq.f32", "master.f32", "owner.lock"]
                assert got["file_master_matches"] and got["file_moments_nonzero"], case
                assert got["pool_bytes"] <= got["pool_bound"], case
                assert not os.path.exists(got["nvme_dir"]), "close() removes the state files"
