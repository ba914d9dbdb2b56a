"""Stage-3 unit selection is pure: it only reads the module tree."""
import torch.nn as nn

from shardspeed.models.gpt import GPT, GPTConfig
from shardspeed.zero.stage3_units import select_units, unit_max_numel


def _names(model, units):
    names = {id(p): n for n, p in model.named_parameters()}
    return [(type(m).__name__, sorted(names[id(p)] for p in ps)) for m, ps in units]


def test_gpt_blocks_become_units_and_root_keeps_the_rest():
    model = GPT(GPTConfig.preset("tiny"))
    total = sum(p.numel() for p in model.parameters())
    units = select_units(model, unit_max_numel(total, 50_000_000))
    kinds = [type(m).__name__ for m, _ in units]
    assert kinds == ["Embedding", "Block", "Block", "Block", "Block", "GPT"]
    # every parameter once, tied LM head included through the embedding
    seen = [id(p) for _, ps in units for p in ps]
    assert len(seen) == len(set(seen)) == len(list(model.parameters()))
    assert any("lm_head" not in n and n == "wte.weight" for n in _names(model, units)[0][1])


def test_containers_never_own_units_and_leaves_always_can():
    model = nn.Sequential(nn.ModuleList([nn.Linear(10, 10), nn.Linear(10, 10)]), nn.LayerNorm(10))
    units = select_units(model, max_numel=50)  # each Linear (110) is over the cap but is a leaf
    owners = [type(m).__name__ for m, _ in units]
    assert "ModuleList" not in owners
    assert owners.count("Linear") == 2


def test_cap_is_a_quarter_of_the_model_at_most():
    assert unit_max_numel(1000, 50_000_000) == 250
    assert unit_max_numel(10**9, 50_000_000) == 50_000_000
    assert unit_max_numel(1000, 0) == 250
