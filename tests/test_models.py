import math

import pytest
import torch

from shardspeed.models import GPT, PRESETS, GPTConfig
from shardspeed.models.gpt import Block


@pytest.fixture
def tiny():
    torch.manual_seed(0)
    return GPT(GPTConfig.preset("tiny"))


def test_logits_shape(tiny):
    idx = torch.randint(0, 256, (3, 17))
    logits = tiny(idx)
    assert logits.shape == (3, 17, 256)


def test_loss_at_init_is_about_ln_vocab(tiny):
    torch.manual_seed(1)
    idx = torch.randint(0, 256, (4, 64))
    targets = torch.randint(0, 256, (4, 64))
    loss = tiny(idx, targets)
    assert loss.dim() == 0 and torch.isfinite(loss)
    assert loss.item() == pytest.approx(math.log(256), abs=0.1)


def test_lm_head_tied_to_token_embedding(tiny):
    assert tiny.lm_head.weight is tiny.wte.weight
    assert tiny.lm_head.weight.data_ptr() == tiny.wte.weight.data_ptr()
    names = [n for n, _ in tiny.named_parameters()]
    assert "lm_head.weight" not in names  # shared: listed once, as wte.weight


def test_blocks_are_a_module_list_of_blocks(tiny):
    assert isinstance(tiny.blocks, torch.nn.ModuleList)
    assert len(tiny.blocks) == 4 and all(isinstance(b, Block) for b in tiny.blocks)


def test_init_is_deterministic_given_seed():
    torch.manual_seed(123)
    a = GPT(GPTConfig.preset("tiny"))
    torch.manual_seed(123)
    b = GPT(GPTConfig.preset("tiny"))
    for (na, pa), (nb, pb) in zip(a.named_parameters(), b.named_parameters()):
        assert na == nb and torch.equal(pa, pb)


def test_backward_reaches_every_parameter(tiny):
    idx = torch.randint(0, 256, (2, 16))
    tiny(idx, idx.roll(-1, dims=1)).backward()
    for name, p in tiny.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all(), name


def test_causal_future_tokens_do_not_change_past_logits(tiny):
    tiny.eval()
    idx = torch.randint(0, 256, (1, 20))
    changed = idx.clone()
    changed[0, 10:] = (changed[0, 10:] + 1) % 256
    assert torch.allclose(tiny(idx)[0, :10], tiny(changed)[0, :10], atol=1e-6)


def test_sequence_longer_than_block_size_is_an_error(tiny):
    with pytest.raises(ValueError, match="block_size"):
        tiny(torch.zeros(1, 65, dtype=torch.long))


def test_config_validation_and_unknown_preset():
    with pytest.raises(ValueError, match="divisible"):
        GPTConfig(n_embd=65, n_head=4)
    with pytest.raises(ValueError, match="unknown GPT preset"):
        GPTConfig.preset("gpt5")
    assert GPTConfig.preset("small", vocab_size=300).vocab_size == 300


def _params_by_formula(c: GPTConfig) -> int:
    d, L = c.n_embd, c.n_layer
    per_block = 4 * d + (3 * d * d + 3 * d) + (d * d + d) + (4 * d * d + 4 * d) + (4 * d * d + d)
    return c.vocab_size * d + c.block_size * d + L * per_block + 2 * d


@pytest.mark.parametrize("name", list(PRESETS))
def test_preset_param_counts(name):
    cfg = GPTConfig.preset(name)
    with torch.device("meta"):  # shapes only: the 1.3B preset allocates nothing
        model = GPT(cfg)
    assert model.num_params() == _params_by_formula(cfg)
    assert model.num_params(non_embedding=True) == model.num_params() - cfg.block_size * cfg.n_embd


def test_preset_sizes():
    def n(name):
        with torch.device("meta"):
            return GPT(GPTConfig.preset(name)).num_params()

    assert 150_000 <= n("tiny") <= 300_000
    assert 1_000_000 <= n("small") <= 10_000_000
    assert 45e6 <= n("gpt2-50m") <= 55e6
    big = GPTConfig.preset("gpt2-1.3b")
    assert (big.n_layer, big.n_embd, big.n_head, big.block_size) == (24, 2048, 16, 1024)
    assert 1.25e9 <= n("gpt2-1.3b") <= 1.35e9


def test_flops_per_token_formula(tiny):
    c = tiny.config
    n = tiny.num_params(non_embedding=True)
    assert tiny.flops_per_token() == 6 * n + 12 * c.n_layer * c.n_embd * c.block_size
    assert tiny.flops_per_token(seq_len=10) == 6 * n + 12 * c.n_layer * c.n_embd * 10
