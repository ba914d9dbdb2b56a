"""Checkpoints of offloaded optimizer state (offload_optimizer cpu / nvme; also with offload_param cpu / nvme).

Three process groups: world 2 trains and saves (offload cpu and nvme at stages 1-3, plus the reference
straight runs); world 1 loads an offloaded checkpoint without offload (2→1) and saves one without offload;
a *new* world-2 group resumes every offloaded checkpoint (bit-identical to the straight run, NVMe files
restored) and loads the world-1 checkpoint with offload (1→2, within 1e-5: the reduction order changes).
"""
from __future__ import annotations

import os

import torch
from distributed import run_distributed
from models import make_batches, make_model
from test_checkpoint import GLOBAL_BATCH, K, _seed_all, _steps

# +param: offload_param cpu; +pnvme: offload_param nvme (parameter shards in a file)
RESUME = [(s, d) for s in (1, 2, 3) for d in ("cpu", "nvme")] + [(3, "nvme+param"), (3, "nvme+pnvme")]
FROM_PLAIN = ((2, "nvme"), (3, "cpu"), (3, "cpu+pnvme"))


def _config(stage: int, world: int, offload: str, nvme: str) -> dict:
    cfg = {
        "train_batch_size": GLOBAL_BATCH,
        "train_micro_batch_size_per_gpu": GLOBAL_BATCH // world,
        "gradient_clipping": 0.5,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.01}},
        "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 10, "warmup_max_lr": 1e-2}},
        "zero_optimization": {"stage": stage, "reduce_bucket_size": 300, "sub_group_size": 200,
                              "stage3_param_persistence_threshold": 100},
    }
    offload, _, param = offload.partition("+")
    if param:
        cfg["zero_optimization"]["offload_param"] = {"device": "nvme", "nvme_path": nvme} if param == "pnvme" \
            else {"device": "cpu"}
    if offload != "none":
        block = {"device": offload, "buffer_count": 2}
        if offload == "nvme":
            block["nvme_path"] = nvme
        cfg["zero_optimization"]["offload_optimizer"] = block
    return cfg


def _engine(stage: int, offload: str, nvme: str, seed: int = 0):
    import torch.distributed as dist

    import shardspeed

    engine, *_ = shardspeed.initialize(model=make_model("mlp", seed),
                                       config=_config(stage, dist.get_world_size(), offload, nvme))
    return engine


def _params(engine) -> dict:
    """Full fp32 parameters from every rank's shards (fp32 training: the shard is the master)."""
    import torch.distributed as dist

    full, shapes = {}, {}
    for u in engine.master_weights.units:
        for prm, shape in zip(u.params, u.shapes):
            name = next(n for n, p in engine.module.named_parameters() if p is prm)
            shapes[name] = shape
            full.setdefault(name, torch.zeros(shape.numel()))
        if u.layout.world > 1 or dist.get_rank() == 0:
            for pc in u.pieces:
                name = next(n for n, p in engine.module.named_parameters() if p is u.params[pc.param_index])
                full[name][pc.param_start : pc.param_end] = u.shard[pc.chunk_start : pc.chunk_start + pc.numel].float()
    for t in full.values():
        dist.all_reduce(t)
    return {n: t.view(shapes[n]) for n, t in full.items()}


def _file_state(engine) -> list:
    """Every host tile's (master, exp_avg, exp_avg_sq) as the store holds it (NVMe: read from the files)."""
    m = engine.master_weights
    return [tuple(x.clone() for x in m.tile_state(t)) for t in m.host_tiles]


def _close(engine) -> None:
    engine.master_weights.close()


def _save_group(root: str) -> dict:
    out = {}
    batches = make_batches("mlp", 2 * K, GLOBAL_BATCH)
    for stage, dev in RESUME:
        nvme = os.path.join(root, "nvme")
        e = _engine(stage, dev, nvme)
        _seed_all(100)
        straight = _steps(e, "mlp", batches, noise=True)
        ref = _params(e)
        _close(e)
        e = _engine(stage, dev, nvme)
        _seed_all(100)
        first = _steps(e, "mlp", batches[:K], noise=True)
        e.save_checkpoint(os.path.join(root, f"s{stage}-{dev}"))
        out[(stage, dev)] = {"straight": straight, "first": first, "params": ref, "files": _file_state(e)}
        _close(e)
    # the source of the offload → no-offload reshard (no input noise: RNG streams differ between worlds)
    e = _engine(3, "nvme", nvme)
    out["reshard"] = {"straight": _steps(e, "mlp", batches, noise=False), "params": _params(e)}
    _close(e)
    e = _engine(3, "nvme", nvme)
    _steps(e, "mlp", batches[:K], noise=False)
    e.save_checkpoint(os.path.join(root, "reshard-s3-nvme"))
    _close(e)
    return out


def _continue(d: str, stage: int, dev: str, nvme: str, noise: bool) -> dict:
    e = _engine(stage, dev, nvme, seed=7)  # other weights and RNG: they must come from the checkpoint
    _seed_all(999)
    e.load_checkpoint(d, load_rng_state=noise)
    files = _file_state(e) if dev != "none" else None
    steps = e.global_steps
    losses = _steps(e, "mlp", make_batches("mlp", 2 * K, GLOBAL_BATCH)[K:], noise=noise)
    out = {"losses": losses, "params": _params(e), "files": files, "steps": steps}
    if dev != "none":
        _close(e)
    return out


def _world1_group(root: str) -> dict:
    batches = make_batches("mlp", 2 * K, GLOBAL_BATCH)
    out = {"from_nvme_s3": _continue(os.path.join(root, "reshard-s3-nvme"), 1, "none", "", noise=False)}
    # saved without offload at world 1 (the no-noise run: RNG streams differ between world sizes)
    e = _engine(3, "none", "")
    out["straight"] = _steps(e, "mlp", batches, noise=False)
    out["params"] = _params(e)
    e = _engine(3, "none", "")
    _steps(e, "mlp", batches[:K], noise=False)
    e.save_checkpoint(os.path.join(root, "plain-w1"))
    return out


def _resume_group(root: str) -> dict:
    nvme = os.path.join(root, "nvme")
    out = {}
    for stage, dev in RESUME:
        out[(stage, dev)] = _continue(os.path.join(root, f"s{stage}-{dev}"), stage, dev, nvme, noise=True)
    for stage, dev in FROM_PLAIN:
        out[("from_plain", stage, dev)] = _continue(os.path.join(root, "plain-w1"), stage, dev, nvme, noise=False)
    return out


def test_offloaded_checkpoints(tmp_path):
    root = str(tmp_path)
    saved = run_distributed(_save_group, 2, root, timeout=600)[0]
    w1 = run_distributed(_world1_group, 1, root, timeout=600)[0]
    resumed = run_distributed(_resume_group, 2, root, timeout=600)

    for stage, dev in RESUME:  # exact resume: bit-identical losses, parameters and store contents
        s = saved[(stage, dev)]
        assert s["first"] == s["straight"][:K]
        for r in range(2):
            got = resumed[r][(stage, dev)]
            assert got["steps"] == K
            assert got["losses"] == s["straight"][K:], (stage, dev)
            for n, p in s["params"].items():
                assert torch.equal(got["params"][n], p), (stage, dev, n)
        got_files = resumed[0][(stage, dev)]["files"]
        assert len(got_files) == len(s["files"]) > 1
        for a, b in zip(got_files, s["files"]):
            assert all(torch.equal(x, y) for x, y in zip(a, b)), (stage, dev, "store contents after load")

    # streamed tile by tile: no saved range of an offloaded state is larger than a tile (sub_group_size)
    from shardspeed.checkpoint.commit import read_latest
    from shardspeed.checkpoint.metadata import CheckpointMetadata
    d = os.path.join(root, "s2-nvme")
    meta = CheckpointMetadata.read(os.path.join(d, read_latest(d)))
    states = {e.state for e in meta.entries if meta.tensors[e.tensor].kind == "param"}
    assert states == {"", "exp_avg", "exp_avg_sq", "step"}
    assert max(e.end - e.start for e in meta.entries if meta.tensors[e.tensor].kind == "param") <= 200

    def close(got, ref_losses, ref_params, what):
        torch.testing.assert_close(torch.tensor(got["losses"]), torch.tensor(ref_losses), rtol=1e-5, atol=1e-6,
                                   msg=lambda m: f"{what}: {m}")
        for n, p in ref_params.items():
            torch.testing.assert_close(got["params"][n], p, rtol=1e-5, atol=1e-6, msg=lambda m, n=n: f"{what} {n}: {m}")

    # offload (nvme, stage 3, world 2) → no offload (stage 1, world 1): continues like the original run
    ref = saved["reshard"]
    assert w1["from_nvme_s3"]["steps"] == K
    close(w1["from_nvme_s3"], ref["straight"][K:], ref["params"], "2→1 nvme s3 → plain s1")
    # no offload → offload, world 1 → 2: continues like the world-1 run
    for stage, dev in FROM_PLAIN:
        close(resumed[0][("from_plain", stage, dev)], w1["straight"][K:], w1["params"], f"1→2 {dev} s{stage}")


def _frozen_pnvme_group(root: str) -> list:
    import torch.distributed as dist
    from models import micro_batch

    import shardspeed

    cfg = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
           "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0,
                                 "offload_param": {"device": "nvme", "nvme_path": os.path.join(root, "nvme")}}}

    def engine(seed):
        m = make_model("mlp_frozen", seed)
        e, *_ = shardspeed.initialize(model=m, model_parameters=[p for p in m.parameters() if p.requires_grad],
                                      config=cfg)
        return e

    def params(e):
        with shardspeed.zero.GatheredParameters(list(e.module.parameters())):
            return {n: p.detach().clone() for n, p in e.module.named_parameters()}

    e = engine(0)
    for b in make_batches("mlp_frozen", 2, 2 * dist.get_world_size()):
        x, y = micro_batch(b, dist.get_rank(), dist.get_world_size(), 0, 1)
        e.backward(e(x, y))
        e.step()
    e.save_checkpoint(os.path.join(root, "ck"))
    saved = params(e)
    frozen = [n for n, p in e.module.named_parameters() if not p.requires_grad]
    _close(e)
    e = engine(5)  # other weights, frozen ones included: they must come from the checkpoint (into the file)
    before = params(e)
    e.load_checkpoint(os.path.join(root, "ck"))
    loaded = params(e)
    _close(e)
    dist.barrier()  # both ranks closed: the directory is empty again
    return [frozen, any(not torch.equal(saved[n], before[n]) for n in frozen),
            all(torch.equal(saved[n], loaded[n]) for n in saved), os.listdir(os.path.join(root, "nvme"))]


def test_param_nvme_frozen_checkpoint(tmp_path):
    """offload_param nvme with frozen parameters (saved from, and loaded into, the parameter file)."""
    for frozen, differed, equal, left in run_distributed(_frozen_pnvme_group, 2, str(tmp_path), timeout=300):
        assert frozen and differed and equal
        assert left == [], "close() removes the parameter files"
