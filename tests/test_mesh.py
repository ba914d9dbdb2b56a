"""The (pipe, data, model) device mesh, DeepSpeed's group names (`engine.mpu`, `shardspeed.utils.groups`),
a user's Megatron-style `mpu=`, and one-line errors for meshes that do not fit the world.

Training checks feed the ranks of a model group the same batches (as tensor-parallel peers get) and
compare every rank with the one-process reference (tests/models.py), fp32 to 1e-5: a data group that is
wrongly the model group averages half the global batch, and a norm that counts a replica twice (or not
at all) clips differently (CLIP binds).
"""
from __future__ import annotations

import pytest
import torch
from distributed import run_distributed
from models import gathered_params, make_batches, make_model, micro_batch, reference_train

import shardspeed
from shardspeed.errors import ConfigError
from shardspeed.mesh.topology import check_user_groups, mesh_ranks, mesh_sizes

STEPS, GAS, MICRO, LR, CLIP = 3, 2, 2, 1e-2, 0.5


def _config(stage: int, **extra) -> dict:
    return dict({
        "train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": GAS, "gradient_clipping": CLIP,
        "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.01}},
        "zero_optimization": {"stage": stage, "reduce_bucket_size": 300, "stage3_param_persistence_threshold": 0},
    }, **extra)


def _batches():
    """The global batches (micro × gas × dp 2); the ranks of a model group see the same ones."""
    return make_batches("mlp", STEPS, MICRO * GAS * 2, seed=1)


def _train(engine, dp_rank: int):
    """Train as data rank ``dp_rank`` of 2; this rank's micro losses."""
    losses = []
    for batch in _batches():
        for k in range(GAS):
            x, y = micro_batch(batch, dp_rank, 2, k, GAS)
            loss = engine(x, y)
            engine.backward(loss)
            engine.step()
            losses.append(float(loss.detach()))
    return losses


class UserMPU:
    """A small Megatron-style model-parallel unit at world 4 with model-parallel size 2, laid out unlike
    the mesh: data groups [0, 1] and [2, 3], model groups [0, 2] and [1, 3]."""

    def __init__(self, data_groups, model_groups, claim_model_size=None):
        import torch.distributed as dist

        me = dist.get_rank()
        self.dp = self.mp = None
        for ranks in data_groups:
            g = dist.new_group(ranks)
            if me in ranks:
                self.dp, self.dp_ranks = g, ranks
        for ranks in model_groups:
            g = dist.new_group(ranks)
            if me in ranks:
                self.mp, self.mp_ranks = g, ranks
        self.claim_model_size = claim_model_size

    def get_data_parallel_group(self):
        return self.dp

    def get_data_parallel_rank(self):
        import torch.distributed as dist
        return dist.get_rank(self.dp)

    def get_data_parallel_world_size(self):
        return len(self.dp_ranks)

    def get_model_parallel_group(self):
        return self.mp

    def get_model_parallel_rank(self):
        import torch.distributed as dist
        return dist.get_rank(self.mp)

    def get_model_parallel_world_size(self):
        return self.claim_model_size or len(self.mp_ranks)


def _group_report(get) -> dict:
    """Ranks, sizes and member lists through the DeepSpeed getter ``get(name)``."""
    import torch.distributed as dist

    out = {}
    for name in ("data", "model", "tensor_model", "pipe", "pipeline_model", "slice"):
        group = get(f"get_{name}_parallel_group")()
        out[name] = (get(f"get_{name}_parallel_rank")(), get(f"get_{name}_parallel_world_size")(),
                     list(range(dist.get_world_size())) if group is None else dist.get_process_group_ranks(group))
    out["tp_src"] = get("get_tensor_model_parallel_src_rank")()
    return out


def _world4() -> dict:
    """Everything that needs 4 ranks, in one process group."""
    import torch.distributed as dist

    import shardspeed.utils.groups as groups
    from shardspeed.mesh.init import group_timeout
    from shardspeed.mesh.mpu import MeshMPU
    from shardspeed.mesh.topology import Topology, describe_group

    rank = dist.get_rank()
    out: dict = {"rank": rank}
    # 1. data 2 × model 2 (tensor_parallel.autotp_size 2; the model dim holds replicas, which see the same
    #    batches as tensor-parallel peers do; the norm counts each parameter once): stages 0 and 3
    topologies = []
    for stage in (0, 3):
        engine, *_ = shardspeed.initialize(model=make_model("mlp"),
                                           config=_config(stage, tensor_parallel={"autotp_size": 2}))
        slice_, dp_rank = engine.mpu.get_tensor_model_parallel_rank(), engine.mpu.get_data_parallel_rank()
        out[f"mesh{stage}"] = {
            "losses": _train(engine, dp_rank), "params": gathered_params(engine),
            "dp": engine.dp_world_size, "batch": engine.train_batch_size(), "slice": slice_,
            "mpu": _group_report(lambda n, e=engine: getattr(e.mpu, n)),
            "groups": _group_report(lambda n: getattr(groups, n)),
        }
        topologies.append(engine.mpu.topology)
    out["mesh_reused"] = topologies[0] is topologies[1]  # a second engine creates no new groups
    # 2. a user's mpu (model-parallel size 2, data groups [0, 1] and [2, 3]) selects the data group
    mpu = UserMPU([[0, 1], [2, 3]], [[0, 2], [1, 3]])
    engine, *_ = shardspeed.initialize(model=make_model("mlp"), config=_config(2), mpu=mpu)
    out["user"] = {"losses": _train(engine, rank % 2), "params": gathered_params(engine),
                   "dp": engine.dp_world_size, "same_mpu": engine.mpu is mpu,
                   "groups": (groups.get_data_parallel_rank(), groups.get_data_parallel_world_size(),
                              groups.get_data_parallel_group_ranks(), groups.get_model_parallel_world_size(),
                              groups.get_model_parallel_rank())}
    # 3. topologies that cannot train yet: pipe 2 × data 2, and pipe 2 × model 2 (a pipe × model group)
    for shape in ((2, 1), (2, 2)):
        topo = Topology.from_mesh(pipe=shape[0], model=shape[1])
        out[f"topo{shape}"] = (topo.mesh_shape, topo.shard_rank, _group_report(lambda n, t=topo: getattr(MeshMPU(t), n)))
        topologies.append(topo)
    # every group of every mesh has the world group's timeout (torch's default for a new group: 30 minutes),
    # and error messages name each group by its dimension
    out["timeouts"] = sorted({group_timeout(g).total_seconds() for t in topologies
                              for g in (t.shard_group, t.pipe_group, t.model_group, t.pipe_model_group)})
    out["names"] = [describe_group(g) for g in (topo.shard_group, topo.pipe_group, topo.model_group, topo.pipe_model_group)]
    # 4. errors, raised alike on every rank
    errors = {}
    bad = {"stages3": _config(0, pipeline={"stages": 3}), "stages2": _config(0, pipeline={"stages": 2}),
           "tp3": _config(0, tensor_parallel={"autotp_size": 3})}
    for name, cfg in bad.items():
        try:
            shardspeed.initialize(model=make_model("mlp"), config=cfg)
        except ConfigError as e:
            errors[name] = str(e)
    for name, make in (("user_short", lambda: UserMPU([[0, 1], [2, 3]], [[0, 2], [1, 3]], claim_model_size=1)),
                       ("user_overlap", lambda: UserMPU([[0, 1], [1, 2, 3]], [[0, 2], [1, 3]])),
                       ("user_tp_disagrees", lambda: UserMPU([[0, 1], [2, 3]], [[0, 2], [1, 3]]))):
        extra = {"tensor_parallel": {"autotp_size": 4}} if name == "user_tp_disagrees" else {}
        try:
            shardspeed.initialize(model=make_model("mlp"), config=_config(0, **extra), mpu=make())
        except ConfigError as e:
            errors[name] = str(e)
    out["errors"] = errors
    return out


def _check_training(results, key, case):
    """Every rank's parameters, and the mean loss per step over ranks, equal the one-process reference's."""
    ref = reference_train("mlp", _batches(), LR, CLIP)
    for r, res in enumerate(results):
        assert res[key]["dp"] == 2
        for name, p in ref["params"].items():
            torch.testing.assert_close(res[key]["params"][name], p, rtol=1e-5, atol=1e-5,
                                       msg=lambda m, r=r, name=name: f"{case} rank {r} param {name}: {m}")
    per_step = torch.tensor([res[key]["losses"] for res in results]).view(len(results), STEPS, GAS).mean(dim=(0, 2))
    torch.testing.assert_close(per_step, torch.tensor(ref["losses"]), rtol=1e-5, atol=1e-5,
                               msg=lambda m: f"{case} losses: {m}")


def test_world4_mesh_mpu_and_errors():
    results = run_distributed(_world4, 4, timeout=400)
    # mesh (pipe 1, data 2, model 2): global rank = data × 2 + model; data groups [0, 2] and [1, 3]
    for stage in (0, 3):
        key = f"mesh{stage}"
        _check_training(results, key, f"data 2 × model 2, stage {stage}")
        for r, res in enumerate(results):
            d, m = divmod(r, 2)
            want = {"data": (d, 2, [m, m + 2]), "model": (m, 2, [2 * d, 2 * d + 1]),
                    "tensor_model": (m, 2, [2 * d, 2 * d + 1]), "slice": (m, 2, [2 * d, 2 * d + 1]),
                    "pipe": (0, 1, [r]), "pipeline_model": (0, 1, [r]), "tp_src": 2 * d}
            assert res[key]["mpu"] == want, (r, res[key]["mpu"])
            assert res[key]["groups"] == want, (r, res[key]["groups"])
            assert res[key]["batch"] == MICRO * GAS * 2 and res[key]["slice"] == m
    assert all(res["mesh_reused"] for res in results)
    # user mpu: data groups [0, 1] and [2, 3] (not the mesh's), model-parallel size 2
    _check_training(results, "user", "user mpu, stage 2")
    for r, res in enumerate(results):
        assert res["user"]["same_mpu"]
        assert res["user"]["groups"] == (r % 2, 2, [2 * (r // 2), 2 * (r // 2) + 1], 2, r // 2)
    # pipe 2 × data 2: global rank = pipe × 2 + data; "model parallel" is pipe × model (DeepSpeed's grid)
    for r, res in enumerate(results):
        shape, dp_rank, rep = res["topo(2, 1)"]
        p, d = divmod(r, 2)
        assert shape == (2, 2, 1) and dp_rank == d
        assert rep["pipe"] == (p, 2, [d, d + 2]) and rep["pipeline_model"] == rep["pipe"]
        assert rep["data"] == (d, 2, [2 * p, 2 * p + 1])
        assert rep["model"] == (p, 2, [d, d + 2])
        assert rep["tensor_model"] == (0, 1, [r]) and rep["slice"] == rep["tensor_model"]
        shape, dp_rank, rep = res["topo(2, 2)"]
        p, m = divmod(r, 2)
        assert shape == (2, 1, 2) and dp_rank == 0 and rep["data"] == (0, 1, [r])
        assert rep["model"] == (r, 4, [0, 1, 2, 3]) and rep["pipe"] == (p, 2, [m, m + 2])
        assert rep["tensor_model"] == (m, 2, [2 * p, 2 * p + 1])
    for r, res in enumerate(results):  # run_distributed's collective_timeout, in every group
        assert res["timeouts"] == [60.0], (r, res["timeouts"])
        p, m = divmod(r, 2)  # pipe 2 × model 2
        assert res["names"] == [f"the data group (global ranks [{r}])", f"the pipe group (global ranks [{m}, {m + 2}])",
                                f"the model group (global ranks [{2 * p}, {2 * p + 1}])",
                                "the pipe_model group (global ranks [0, 1, 2, 3])"], (r, res["names"])
    errors = [res["errors"] for res in results]
    assert all(e == errors[0] for e in errors), "every rank raises the same error"
    e = errors[0]
    assert e["stages3"] == "world 4 is not divisible by pipeline.stages 3 × tensor_parallel.autotp_size 1 = 3"
    assert e["tp3"] == "world 4 is not divisible by pipeline.stages 1 × tensor_parallel.autotp_size 3 = 3"
    assert "pipeline.stages 2 needs a shardspeed.pipe.PipelineModule model" in e["stages2"]
    assert e["user_short"] == ("mpu: data-parallel size 2 × model-parallel size 1 = 2 ranks on rank 0, but the "
                               "world has 4")
    assert e["user_overlap"] == "mpu: data-parallel groups disagree: rank 0 is in [0, 1], rank 1 in [1, 2, 3]"
    assert e["user_tp_disagrees"].startswith("tensor_parallel.autotp_size 4 disagrees with mpu=")
    assert all("\n" not in m for m in e.values())


# ---- without processes --------------------------------------------------------------------------------
def test_mesh_sizes_and_layout():
    assert mesh_sizes(4) == (1, 4, 1)
    assert mesh_sizes(8, pipe=2, model=2) == (2, 2, 2)
    assert mesh_ranks(2, 2, 2) == [[[0, 1], [2, 3]], [[4, 5], [6, 7]]]
    with pytest.raises(ConfigError) as info:
        mesh_sizes(4, pipe=3)
    assert str(info.value) == "world 4 is not divisible by pipeline.stages 3 × tensor_parallel.autotp_size 1 = 3"
    with pytest.raises(ConfigError, match=r"world 6 is not divisible by .* 2 × tensor_parallel.autotp_size 2 = 4"):
        mesh_sizes(6, pipe=2, model=2)


def _report(rank, members, claimed=(None, None), mp=1, tp=1, pp=1):
    return (rank, members, claimed, mp, tp, pp)


def test_user_groups_are_checked():
    ok = [_report(r, [r // 2 * 2, r // 2 * 2 + 1], (r % 2, 2), mp=2) for r in range(4)]
    check_user_groups(ok)
    cases = {
        "data-parallel size 2 × model-parallel size 1 = 2 ranks on rank 0, but the world has 4":
            [_report(r, [r // 2 * 2, r // 2 * 2 + 1]) for r in range(4)],
        "rank 1 is not in its own data-parallel group":
            [_report(0, [0]), _report(1, None)],
        "get_data_parallel_rank() says 1 but the rank is number 0":
            [_report(0, [0, 1], (1, 2)), _report(1, [0, 1], (1, 2))],
        "get_data_parallel_world_size() says 4 but its data-parallel group has 2 ranks":
            [_report(0, [0, 1], (0, 4)), _report(1, [0, 1], (1, 4))],
        "data-parallel groups disagree: rank 0 is in [0, 1], rank 1 in [1]":
            [_report(0, [0, 1], mp=1), _report(1, [1], mp=2)],
        # Megatron counts tensor only in "model parallel": data × model × pipe = world is accepted
        None: [_report(r, [r, r + 4], mp=2, pp=2) for r in range(4)] + [_report(r + 4, [r, r + 4], mp=2, pp=2)
                                                                          for r in range(4)],
    }
    for message, reports in cases.items():
        if message is None:
            check_user_groups(reports)
            continue
        with pytest.raises(ConfigError) as info:
            check_user_groups(reports)
        assert message in str(info.value) and "\n" not in str(info.value)


def test_one_process_builder_errors():
    """At world 1 (no spawned ranks): a mesh that does not fit, and a user mpu that disagrees."""
    import torch.distributed as dist

    with pytest.raises(ConfigError, match="world 1 is not divisible by pipeline.stages 2 × "
                                          "tensor_parallel.autotp_size 1 = 2"):
        shardspeed.initialize(model=make_model("mlp"), config=_config(0, pipeline={"stages": 2}))

    class BadMPU:  # the world as data group, plus a model-parallel size of 2 that has no ranks
        def get_data_parallel_group(self):
            return dist.group.WORLD

        def get_model_parallel_world_size(self):
            return 2

    with pytest.raises(ConfigError, match="data-parallel size 1 × model-parallel size 2 = 2 ranks on rank 0, "
                                          "but the world has 1"):
        shardspeed.initialize(model=make_model("mlp"), config=_config(0), mpu=BadMPU())


def test_config_blocks():
    from shardspeed.config import load_config, parse_config

    cfg = load_config(_config(0, tensor_parallel={"autotp_size": 2, "tp_overlap_comm": True},
                              pipeline={"stages": "auto"}), world_size=2)
    assert (cfg.pipeline.num_stages, cfg.tensor_parallel.size, cfg.train_batch_size) == (1, 2, MICRO * GAS * 2)
    assert parse_config(_config(0)).train_batch_size is None  # batch sizes wait for the data size
    assert load_config(parse_config(_config(0)), world_size=3).train_batch_size == MICRO * GAS * 3
    assert load_config(_config(0, tensor_parallel={"enabled": False})).tensor_parallel.size == 1
    tp = load_config(_config(0, tensor_parallel={"autotp_size": 2, "preset_model": "llama", "sequence_parallel": True,
                                                 "partition_config": {"layer_specs": []}}), world_size=2).tensor_parallel
    assert (tp.preset_model, tp.sequence_parallel, tp.partition_config) == ("llama", True, {"layer_specs": []})
    for block, message in (
            ({"tensor_parallel": {"vocab_parallel_lm_head": True}},
             "'tensor_parallel.vocab_parallel_lm_head': this DeepSpeed AutoTP/inference option is not implemented"),
            ({"tensor_parallel": {"tp": {"tp_size": 2}}}, "'tensor_parallel.tensor_parallel': this DeepSpeed"),
            ({"tensor_parallel": {"autotp_size": -1}}, "tensor_parallel.autotp_size = -1 is invalid"),
            ({"pipeline": {"stages": 0}}, "'pipeline.stages' = 0 is invalid: it must be \"auto\" or an integer")):
        with pytest.raises(ConfigError) as info:
            load_config(_config(0, **block))
        assert message in str(info.value) and "\n" not in str(info.value)
