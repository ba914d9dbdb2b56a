"""``initialize(optimizer=torch_optimizer)`` gives back the user's own object, and it is the one the engine
steps (issue 36, item 5): a script that keeps its reference and sets ``param_groups[0]["lr"]`` on it changes
the engine's learning rate, as under DeepSpeed (whose ZeRO wrapper steps the user's optimizer).

World 2, the tiny MLP, fp32, a torch optimizer passed in, ZeRO 0, 2 and 3 and ZeRO 2 with the optimizer
offloaded to the host: three steps at lr 1e-2, then 0 (the weights must not move a bit), then 2e-2, set
through the user's reference between steps. With SGD (momentum 0.9) the weights equal plain torch's over
the same global batches and learning rates to 1e-6; with AdamW offloaded (the host's tiled Adam reads the
group's lr each step) the weights stand still at lr 0 and move at the others."""
from __future__ import annotations

import torch
from distributed import run_distributed
from models import make_batches, make_model, micro_batch

LRS = (1e-2, 0.0, 2e-2)
#: name: (stage, offload_optimizer device, optimizer)
CASES = {"z0": (0, None, "sgd"), "z2": (2, None, "sgd"), "z3": (3, None, "sgd"), "z2_offload": (2, "cpu", "sgd"),
         "z3_offload_adamw": (3, "cpu", "adamw")}


def _optimizer(kind: str, params):
    if kind == "sgd":
        return torch.optim.SGD(params, lr=LRS[0], momentum=0.9)
    return torch.optim.AdamW(params, lr=LRS[0])


def _config(stage: int, offload) -> dict:
    zero: dict = {"stage": stage, "stage3_param_persistence_threshold": 0}
    if offload:
        zero["offload_optimizer"] = {"device": offload}
    return {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1, "zero_optimization": zero}


def _full_params(engine, stage: int) -> dict:
    import shardspeed.zero

    with shardspeed.zero.GatheredParameters(list(engine.module.parameters()), enabled=stage == 3):
        return {n: p.detach().clone() for n, p in engine.module.named_parameters()}


def _reference(batches) -> dict:
    model = make_model("mlp")
    opt = _optimizer("sgd", model.parameters())
    for lr, (x, y) in zip(LRS, batches):
        opt.param_groups[0]["lr"] = lr
        opt.zero_grad()
        model(x, y).backward()
        opt.step()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _cases():
    import torch.distributed as dist

    import shardspeed

    rank, world = dist.get_rank(), dist.get_world_size()
    batches = make_batches("mlp", len(LRS), 2 * world)
    out: dict = {"reference": _reference(batches)}
    for name, (stage, offload, kind) in CASES.items():
        model = make_model("mlp")
        user_opt = _optimizer(kind, model.parameters())
        engine, returned, _, _ = shardspeed.initialize(model=model, optimizer=user_opt, config=_config(stage, offload))
        res: dict = {"same_object": returned is user_opt and engine.optimizer is user_opt, "lrs": [], "moved": []}
        for lr, batch in zip(LRS, batches):
            user_opt.param_groups[0]["lr"] = lr  # through the script's own reference
            res["lrs"].append(engine.get_lr()[0])
            before = _full_params(engine, stage)
            x, y = micro_batch(batch, rank, world, 0, 1)
            engine.backward(engine(x, y))
            engine.step()
            after = _full_params(engine, stage)
            res["moved"].append(any(not torch.equal(before[k], after[k]) for k in after))
        res["params"] = _full_params(engine, stage)
        out[name] = res
    return out


def test_user_optimizer_is_the_engines_and_its_lr_is_live():
    for rank, res in enumerate(run_distributed(_cases, 2, timeout=300)):
        ref = res["reference"]
        for name in CASES:
            got = res[name]
            assert got["same_object"], (name, rank)
            assert got["lrs"] == list(LRS), (name, rank, got["lrs"])
            assert got["moved"] == [True, False, True], (name, rank, got["moved"])  # lr 0: not a bit moved
            if CASES[name][2] != "sgd":
                continue
            for k, p in ref.items():
                torch.testing.assert_close(got["params"][k], p, rtol=0, atol=1e-6, msg=lambda m, k=k, n=name: f"{n} {k}: {m}")
