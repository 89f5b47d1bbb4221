"""The GPT against hand-written oracles: causal masking, the loss, the parameter count."""
import math

import pytest
import torch
import torch.nn.functional as F

from csrc.errors import ConfigError
from offload.models import GPT, GPTConfig

CONFIG = GPTConfig(vocab_size=23, block_size=16, n_layer=2, n_head=2, n_embd=16)


def test_later_tokens_do_not_change_earlier_logits():
    model = GPT(CONFIG, seed=1).eval()
    gen = torch.Generator().manual_seed(0)
    idx = torch.randint(0, CONFIG.vocab_size, (3, CONFIG.block_size), generator=gen)
    cut = 7
    changed = idx.clone()
    changed[:, cut:] = (idx[:, cut:] + 1 + torch.randint(0, 5, idx[:, cut:].shape, generator=gen)) % CONFIG.vocab_size
    with torch.no_grad():
        before, after = model(idx), model(changed)
    torch.testing.assert_close(after[:, :cut], before[:, :cut], rtol=0, atol=0)
    # The changed positions do change, so the check above is not vacuous.
    assert (after[:, cut:] - before[:, cut:]).abs().amax() > 1e-3


def _attention_by_hand(attn, x):
    """Masked softmax attention written out, for CausalSelfAttention's weights."""
    batch, seq, width = x.shape
    heads = attn.n_head
    q, k, v = attn.qkv(x).split(width, dim=-1)
    q, k, v = (t.view(batch, seq, heads, width // heads).transpose(1, 2) for t in (q, k, v))
    scores = q @ k.transpose(-1, -2) / math.sqrt(width // heads)
    future = torch.triu(torch.ones(seq, seq, dtype=torch.bool), diagonal=1)
    weights = scores.masked_fill(future, float("-inf")).softmax(-1)
    return attn.proj((weights @ v).transpose(1, 2).reshape(batch, seq, width))


def test_attention_matches_masked_softmax_by_hand():
    model = GPT(CONFIG, seed=2).eval()
    attn = model.blocks[0].attn
    x = torch.randn(2, 9, CONFIG.n_embd, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        torch.testing.assert_close(attn(x), _attention_by_hand(attn, x))


def test_loss_is_cross_entropy_of_its_logits():
    model = GPT(CONFIG, seed=4)
    gen = torch.Generator().manual_seed(5)
    idx = torch.randint(0, CONFIG.vocab_size, (4, 10), generator=gen)
    targets = torch.randint(0, CONFIG.vocab_size, (4, 10), generator=gen)
    logits = model(idx)
    assert logits.shape == (4, 10, CONFIG.vocab_size)
    expected = F.cross_entropy(logits.reshape(-1, CONFIG.vocab_size), targets.reshape(-1))
    torch.testing.assert_close(model(idx, targets), expected)


def _count_by_formula(c: GPTConfig) -> int:
    e, b = c.n_embd, int(c.bias)
    layer_norm = e + b * e
    block = 2 * layer_norm + (e * 3 * e + b * 3 * e) + (e * e + b * e) + (e * 4 * e + b * 4 * e) + (4 * e * e + b * e)
    head = 0 if c.tied_head else c.vocab_size * e
    return c.vocab_size * e + c.block_size * e + c.n_layer * block + layer_norm + head


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("tied", [True, False])
def test_parameter_count_matches_formula(bias, tied):
    config = GPTConfig(vocab_size=31, block_size=12, n_layer=3, n_head=4, n_embd=24, bias=bias, tied_head=tied)
    model = GPT(config)
    assert model.num_parameters() == _count_by_formula(config)
    assert (model.head.weight is model.tok_emb.weight) == tied


def test_init_is_deterministic_and_leaves_global_rng_alone():
    state = torch.get_rng_state()
    a, b, c = GPT(CONFIG, seed=7), GPT(CONFIG, seed=7), GPT(CONFIG, seed=8)
    assert torch.equal(torch.get_rng_state(), state)
    for (name, pa), pb, pc in zip(a.state_dict().items(), b.state_dict().values(), c.state_dict().values()):
        assert torch.equal(pa, pb), name
    assert not torch.equal(a.tok_emb.weight, c.tok_emb.weight)


def test_longer_than_block_size_is_an_error():
    model = GPT(CONFIG)
    with pytest.raises(ConfigError, match="block_size"):
        model(torch.zeros(1, CONFIG.block_size + 1, dtype=torch.long))


@pytest.mark.parametrize("kwargs, field", [
    ({"n_embd": 18, "n_head": 4}, "n_head"),
    ({"n_layer": 0}, "n_layer"),
    ({"dropout": 1.0}, "dropout"),
])
def test_bad_config_names_the_field(kwargs, field):
    with pytest.raises(ConfigError, match=field):
        GPTConfig(**{"vocab_size": 10, "block_size": 8, **kwargs})
