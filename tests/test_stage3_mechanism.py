"""Stage 3's mechanism on module structures it did not choose (issue 21): reads outside the module, frozen
units, ranks with no trainable element. The model zoo (test_model_zoo.py) checks whole real models; these
check the mechanism's own promises: what is gathered, when it is released, and how often."""
from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from tests.distributed import run_distributed

LR, WD = 1e-2, 0.01
SMALL = {"stage3_prefetch_bucket_size": 200, "stage3_param_persistence_threshold": 0, "reduce_bucket_size": 200}


class ParentReadsChild(nn.Module):
    """The parent passes ``proj.weight`` to a functional and never calls ``proj`` (as MultiheadAttention does
    with ``out_proj``); ``proj`` is big enough to be a unit of its own at SMALL buckets."""

    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(8, 16)
        self.proj = nn.Linear(16, 16)
        self.head = nn.Linear(16, 3)

    def forward(self, x, y):
        h = torch.tanh(self.inp(x))
        h = F.linear(h, self.proj.weight, self.proj.bias)
        return F.cross_entropy(self.head(h), y)


def _llama(lora: bool):
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
                      num_key_value_heads=2, max_position_embeddings=32, attn_implementation="eager")
    model = LlamaForCausalLM(cfg)
    if lora:
        model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                                                 lora_dropout=0.0))
        for n, p in model.named_parameters():
            if "lora_B" in n:  # zero by default: give the adapters something to train from the first step
                nn.init.normal_(p, std=0.02)
    return model


def _config(stage: int, **zero) -> dict:
    return {"train_batch_size": 8, "train_micro_batch_size_per_gpu": 8 // _world(), "gradient_clipping": 0.0,
            "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": WD}},
            "zero_optimization": dict(stage=stage, **zero)}


def _world() -> int:
    import torch.distributed as dist

    return dist.get_world_size() if dist.is_initialized() else 1


def _batches(steps: int = 3):
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(8, 8, generator=g), torch.randint(0, 3, (8,), generator=g)) for _ in range(steps)]


def _reference(make, batches, params=None):
    model = make()
    opt = torch.optim.AdamW(params(model) if params else model.parameters(), lr=LR, weight_decay=WD)
    losses = []
    for x, y in batches:
        loss = model(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(float(loss.detach()))
    return losses, {n: p.detach().clone() for n, p in model.named_parameters()}


def _global_mean(loss) -> float:
    import torch.distributed as dist

    t = loss.detach().clone()
    dist.all_reduce(t)
    return float(t) / dist.get_world_size()


def _parent_reads_child_case() -> dict:
    import torch.distributed as dist

    import shardspeed

    torch.manual_seed(0)
    engine, *_ = shardspeed.initialize(model=ParentReadsChild(), config=_config(3, **SMALL))
    pm = engine.param_manager
    r, n = dist.get_rank(), 8 // dist.get_world_size()
    losses, reads, gathers = [], [], []
    for x, y in _batches():
        before_r, before_g = pm.read_gathers, pm.gather_count
        loss = engine(x[r * n:(r + 1) * n], y[r * n:(r + 1) * n])
        engine.backward(loss)
        engine.step()
        losses.append(_global_mean(loss))
        reads.append(pm.read_gathers - before_r)
        gathers.append(pm.gather_count - before_g)
    owners = len({id(u) for u in pm.units})
    return {"losses": losses, "reads": reads, "gathers": gathers, "units": owners}


def _gpt_tokens(step: int):
    g = torch.Generator().manual_seed(100 + step)
    idx = torch.randint(0, 256, (8, 33), generator=g)
    return idx[:, :-1], idx[:, 1:]


def _coalesce_case() -> dict:
    """A tiny GPT at a third-of-a-layer prefetch bucket: each block's norms are a small unit of their own."""
    import torch.distributed as dist

    import shardspeed
    from shardspeed.models import GPT, GPTConfig

    torch.manual_seed(0)
    cfg = _config(3, stage3_prefetch_bucket_size=20_000, stage3_param_persistence_threshold=0)
    engine, *_ = shardspeed.initialize(model=GPT(GPTConfig.preset("tiny", dropout=0.0)), config=cfg)
    r, n = dist.get_rank(), 8 // dist.get_world_size()
    losses, scatters = [], []
    for step in range(3):
        x, y = _gpt_tokens(step)
        before = engine.comms_summary().get("reduce_scatter", {}).get("count", 0)
        loss = engine(x[r * n:(r + 1) * n], y[r * n:(r + 1) * n])
        engine.backward(loss)
        engine.step()
        losses.append(_global_mean(loss))
        scatters.append(engine.comms_summary()["reduce_scatter"]["count"] - before)
    red = engine.reducer
    return {"losses": losses, "scatters": scatters, "coalesce_numel": red.coalesce_numel,
            "layout": [(u.layout.padded_numel, 0) for u in red.units], "launch_log": [i for i, _ in red.launch_log]}


def _lora_live_case(lora: bool) -> dict:
    """Largest share of the model gathered at once during backward, and the final losses."""
    import torch.distributed as dist

    import shardspeed
    from shardspeed.zero.unit import UnitState

    model = _llama(lora)
    engine, *_ = shardspeed.initialize(model=model, model_parameters=[p for p in model.parameters() if p.requires_grad],
                                       config=_config(3, **SMALL))
    pm = engine.param_manager
    total = sum(u.numel for u in pm.units)
    peak = {"backward": 0.0}

    def record(*_):
        live = sum(u.numel for u in pm.units if u.state is UnitState.GATHERED)
        peak["backward"] = max(peak["backward"], live / total)

    for p in model.parameters():
        if p.requires_grad:
            p.register_post_accumulate_grad_hook(record)
    g = torch.Generator().manual_seed(2)
    r, n = dist.get_rank(), 4 // dist.get_world_size()
    losses = []
    for _ in range(2):
        x = torch.randint(0, 64, (4, 8), generator=g)[r * n:(r + 1) * n]
        loss = engine(input_ids=x, labels=x).loss
        engine.backward(loss)
        engine.step()
        losses.append(_global_mean(loss))
    units = [(u.numel, bool(u.grad_params)) for u in pm.units]
    return {"peak": peak["backward"], "losses": losses, "units": units}


def _few_trainable_case(stage: int) -> dict:
    """Two trainable elements at world 4: two ranks own none of them (they still step, save and load)."""
    import tempfile

    import torch.distributed as dist

    import shardspeed

    model = _few_trainable()
    engine, opt, *_ = shardspeed.initialize(model=model, model_parameters=[model[1].bias], config=_config(stage))
    r, n = dist.get_rank(), 8 // dist.get_world_size()
    losses = []
    for x, y in _batches():
        loss = F.cross_entropy(engine(x[r * n:(r + 1) * n]), y[r * n:(r + 1) * n])
        engine.backward(loss)
        engine.step()
        losses.append(_global_mean(loss))
    with tempfile.TemporaryDirectory() as d:
        path = [d]
        dist.broadcast_object_list(path, 0)
        engine.save_checkpoint(path[0])
        engine.load_checkpoint(path[0])
        dist.barrier()
    with shardspeed.zero.GatheredParameters([model[1].bias]):
        bias = model[1].bias.detach().clone()
    return {"losses": losses, "bias": bias, "groups": len(opt.param_groups)}


def _few_trainable() -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 3))
    for p in model.parameters():
        p.requires_grad_(False)
    model[1].bias.requires_grad_(True)
    return model


def _world2_cases() -> dict:
    warnings.filterwarnings("ignore")
    out = {"parent": _parent_reads_child_case(), "coalesce": _coalesce_case()}
    try:
        import peft  # noqa: F401
        import transformers  # noqa: F401
    except ImportError:
        return out
    out["lora"] = _lora_live_case(True)
    out["full"] = _lora_live_case(False)
    return out


def _world4_cases() -> dict:
    return {s: _few_trainable_case(s) for s in (1, 2, 3)}


@pytest.fixture(scope="module")
def world2():
    return run_distributed(_world2_cases, 2, timeout=300)[0]


@pytest.fixture(scope="module")
def world4():
    return run_distributed(_world4_cases, 4, timeout=300)[0]


def test_parent_reading_a_child_weight_trains_like_torch(world2):
    ref, _ = _reference(lambda: (torch.manual_seed(0), ParentReadsChild())[1], _batches())
    got = world2["parent"]
    assert got["losses"] == pytest.approx(ref, abs=1e-6)


def test_small_units_are_reduced_together_and_train_like_torch(world2):
    """Stage 3 reduces units under an eighth of the median unit in groups (test_reducer has the rule): fewer
    reduce-scatters than units, as many as the rule gives, and the losses of a one-process torch loop."""
    from test_reducer import _n_units

    from shardspeed.models import GPT, GPTConfig

    got = world2["coalesce"]
    assert got["scatters"][-1] == _n_units(got, "s3c") < len(got["layout"]), got
    model = (torch.manual_seed(0), GPT(GPTConfig.preset("tiny", dropout=0.0)))[1]
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WD)
    ref = []
    for step in range(3):
        loss = model(*_gpt_tokens(step))
        loss.backward()
        opt.step()
        opt.zero_grad()
        ref.append(float(loss.detach()))
    assert got["losses"] == pytest.approx(ref, abs=1e-5)


def test_a_unit_read_outside_its_module_is_gathered_by_the_reader_from_the_next_step(world2):
    got = world2["parent"]
    assert got["reads"][0] > 0, "the first forward gathers proj's unit on the read"
    assert got["reads"][1:] == [0, 0], "from then on the parent's own hooks gather it: no read is left to catch"
    assert got["gathers"][1] == got["gathers"][2]


def _peft_or_skip(world2):
    if "lora" not in world2:
        pytest.skip("transformers and peft are not installed")


def test_lora_at_stage_3_trains_like_torch(world2):
    _peft_or_skip(world2)
    from tests.test_stage3_mechanism import _llama as make

    model = make(True)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=LR, weight_decay=WD)
    g = torch.Generator().manual_seed(2)
    ref = []
    for _ in range(2):
        x = torch.randint(0, 64, (4, 8), generator=g)
        loss = model(input_ids=x, labels=x).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        ref.append(float(loss))
    assert world2["lora"]["losses"] == pytest.approx(ref, abs=1e-5)


def test_lora_units_split_frozen_from_trainable_and_backward_holds_few(world2):
    """Frozen base weights are released when their modules' backward is done, as trainable units are when
    their gradients are in: LoRA's backward holds no more of the model than full fine-tuning's."""
    _peft_or_skip(world2)
    lora, full = world2["lora"], world2["full"]
    trainable = [n for n, t in lora["units"] if t]
    assert trainable and len(trainable) < len(lora["units"]), "LoRA adapters have units of their own"
    assert lora["peak"] <= full["peak"] + 0.05, (lora["peak"], full["peak"])
    assert lora["peak"] < 0.5, f"{lora['peak']:.0%} of the model gathered at once in backward"


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_ranks_owning_no_trainable_element_step_save_and_load(world4, stage):
    def params(m):
        return [m[1].bias]

    def make():
        return _few_trainable()

    batches = _batches()
    model = make()
    opt = torch.optim.AdamW(params(model), lr=LR, weight_decay=WD)
    ref = []
    for x, y in batches:
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        ref.append(float(loss))
    got = world4[stage]
    assert got["losses"] == pytest.approx(ref, abs=1e-6)
    assert torch.allclose(got["bias"], model[1].bias.detach(), atol=1e-6)
    assert got["groups"] == 1
