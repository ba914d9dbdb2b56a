"""DCP interop (``shardspeed.checkpoint.dcp``): export to and import from ``torch.distributed.checkpoint``.

World 2 trains a tied model at ZeRO 2 (a frozen-free tied LM: aliases, biases, a LayerNorm) and writes the
same state twice, as a DCP directory and as our own checkpoint (the reference). World 4 at ZeRO 3 loads
each into its own engine: every optimizer piece and state, the counters and the next step's loss agree
exactly. World 1 loads our checkpoint and returns the whole tensors by name, against which a plain
``dcp.load`` in this process (no engine, no process group: torchtitan's way, with a model's
``state_dict()`` and flattened optimizer keys) must read the same values. Errors: a missing tensor and a
wrong shape are CheckpointErrors naming the key.
"""
from __future__ import annotations

import torch
import torch.distributed.checkpoint as dcp
from distributed import run_distributed
from models import make_batches, make_model, micro_batch

from shardspeed.checkpoint.engine_view import EngineView
from shardspeed.errors import CheckpointError


def _engine(stage: int):
    import shardspeed

    cfg = {"train_batch_size": 4, "train_micro_batch_size_per_gpu": 4 // _world(),
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.01}},
           "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 10, "warmup_max_lr": 1e-2}},
           "zero_optimization": {"stage": stage, "reduce_bucket_size": 300,
                                 "stage3_param_persistence_threshold": 100}}
    return shardspeed.initialize(model=make_model("tied", seed=3), config=cfg)[0]


def _world():
    import torch.distributed as dist

    return dist.get_world_size()


def _train(e, steps):
    import torch.distributed as dist

    out = []
    for b in make_batches("tied", steps, 4, seed=e.global_steps + 7):
        loss = e(*micro_batch(b, dist.get_rank(), dist.get_world_size(), 0, 1))
        e.backward(loss)
        e.step()
        out.append(loss.item())
    return out


def _save(d):
    from shardspeed.checkpoint.dcp import save_dcp

    e = _engine(2)
    _train(e, 3)
    save_dcp(e, f"{d}/dcp")
    e.save_checkpoint(f"{d}/ours", tag="t")


def _optimizer_state(e):
    out = []
    for g in e.optimizer.param_groups:
        out.append({k: v for k, v in g.items() if k != "params"})
        for t in g["params"]:
            out.append((t.detach().clone(), {k: v.clone() if torch.is_tensor(v) else v
                                             for k, v in e.optimizer.state.get(t, {}).items()}))
    return out


def _load4(d):
    from shardspeed.checkpoint.dcp import load_dcp

    a, b = _engine(3), _engine(3)
    state = load_dcp(a, f"{d}/dcp")
    b.load_checkpoint(f"{d}/ours")
    errors = []
    for name in ("missing", "shape"):
        try:
            load_dcp(_engine(3), f"{d}/bad_{name}")
        except CheckpointError as exc:
            errors.append(str(exc))
    return {"a": _optimizer_state(a), "b": _optimizer_state(b), "steps": (a.global_steps, b.global_steps),
            "state_steps": state["counters"]["global_steps"], "losses": (_train(a, 2), _train(b, 2)),
            "errors": errors}


def _load1(d):
    e = _engine(0)
    e.load_checkpoint(f"{d}/ours")
    view = EngineView(e)
    moments = {pc.name: {k: v.clone() for k, v in e.optimizer.state[pc.master].items()}
               for pieces in view.pieces() for pc in pieces}
    return {"model": {k: v.clone() for k, v in e.module.state_dict().items()}, "moments": moments}


def _equal(x, y):
    if torch.is_tensor(x):
        return torch.equal(x, y)
    if isinstance(x, dict):
        return x.keys() == y.keys() and all(_equal(x[k], y[k]) for k in x)
    if isinstance(x, (list, tuple)):
        return len(x) == len(y) and all(_equal(a, b) for a, b in zip(x, y))
    return x == y


def test_dcp_round_trip_across_world_sizes(tmp_path):
    d = str(tmp_path)
    run_distributed(_save, 2, d)
    # two broken copies: a model with a tensor the checkpoint lacks, and one whose shape differs
    sd = {"wte.weight": torch.zeros(32, 16)}
    dcp.save(sd, checkpoint_id=f"{d}/bad_missing", no_dist=True)
    full = run_distributed(_load1, 1, d)[0]
    bad = {k: v.clone() for k, v in full["model"].items()}
    bad["ln.weight"] = torch.zeros(17)
    dcp.save(bad, checkpoint_id=f"{d}/bad_shape", no_dist=True)

    r = run_distributed(_load4, 4, d)
    for rank in r:
        assert _equal(rank["a"], rank["b"])
        assert rank["steps"] == (3, 3) and rank["state_steps"] == 3
        assert rank["losses"][0] == rank["losses"][1]
        assert "bad_missing/.metadata has no tensor 'wpe.weight'" in rank["errors"][0], rank["errors"][0]
        assert "'ln.weight' has shape [17]" in rank["errors"][1], rank["errors"][1]

    # torchtitan's way: a plain model's state_dict and flattened optimizer keys, no process group
    model = make_model("tied", seed=99)
    sd = model.state_dict()
    dcp.load(sd, checkpoint_id=f"{d}/dcp", no_dist=True)
    for k, v in full["model"].items():
        assert torch.equal(sd[k], v), k
    optim = {f"state.{n}.{k}": torch.empty(sd[n].shape if v.dim() else v.shape, dtype=v.dtype)
             for n, st in full["moments"].items() for k, v in st.items()}
    optim["param_groups.wte.weight.lr"] = 0.0
    dcp.load({"optimizer": optim}, checkpoint_id=f"{d}/dcp", no_dist=True)
    for n, st in full["moments"].items():
        for k, v in st.items():
            assert torch.equal(optim[f"state.{n}.{k}"].reshape(v.shape), v), (n, k)
    assert optim["param_groups.wte.weight.lr"] > 0
