"""The shipped corpus, the character tokenizer, the split and the training windows."""
import pytest
import torch

from csrc.errors import ConfigError
from offload.models import CharTokenizer, TextWindows, load_corpus, split_tokens


def test_corpus_is_shipped_ascii_of_demo_size():
    text = load_corpus()
    assert 30_000 <= len(text) <= 300_000
    assert text.isascii()


def test_tokenizer_round_trips_the_corpus():
    text = load_corpus()
    tok = CharTokenizer(text)
    ids = tok.encode(text)
    assert ids.dtype == torch.long and ids.numel() == len(text)
    assert tok.decode(ids) == text
    assert tok.chars == sorted(set(text)) and tok.vocab_size == len(set(text))


def test_unknown_character_is_an_error():
    with pytest.raises(ConfigError, match="'z'"):
        CharTokenizer("abc").encode("abz")


def test_split_holds_out_every_tenth_chunk():
    tokens = torch.arange(95)
    train, val = split_tokens(tokens, chunk_tokens=4, val_every=10)
    chunks = [list(range(i, min(i + 4, 95))) for i in range(0, 95, 4)]
    assert val.tolist() == chunks[9] + chunks[19]
    assert train.tolist() == [t for k, c in enumerate(chunks) if k not in (9, 19) for t in c]


def test_windows_target_is_input_shifted_by_one():
    tokens = torch.arange(1000) * 7 % 101
    ds = TextWindows(tokens, block_size=32, num_windows=50, seed=3)
    assert len(ds) == 50
    for i in range(len(ds)):
        x, y = ds[i]
        s = int(ds.offsets[i])
        assert torch.equal(x, tokens[s:s + 32]) and torch.equal(y, tokens[s + 1:s + 33])
    again = TextWindows(tokens, block_size=32, num_windows=50, seed=3)
    assert torch.equal(again.offsets, ds.offsets)
    assert not torch.equal(TextWindows(tokens, block_size=32, num_windows=50, seed=4).offsets, ds.offsets)


def test_evenly_spaced_windows_reach_both_ends():
    tokens = torch.arange(200)
    ds = TextWindows(tokens, block_size=10, num_windows=5, seed=None)
    assert ds.offsets.tolist() == [0, 47, 94, 142, 189]
    assert ds[4][1][-1].item() == 199


def test_too_few_tokens_is_an_error():
    with pytest.raises(ConfigError, match="too few"):
        TextWindows(torch.arange(10), block_size=10, num_windows=1)
