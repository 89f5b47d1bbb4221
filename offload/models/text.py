"""The demo's data: the shipped corpus, a character tokenizer, and (input, target) windows.

``corpus.txt`` ships beside this module as package data (nothing is downloaded).
It is plain ASCII English: prose written for this project, followed by a few texts
in the public domain (Lincoln, the Declaration of Independence, the Preamble,
Shakespeare, Blake, Shelley, Wordsworth, Lazarus), typed out by hand, so small
differences from the canonical editions are possible.

``split_tokens`` holds out every ``val_every``-th chunk for validation, so both
splits mix prose and verse. ``TextWindows`` is a map-style ``Dataset`` of windows
at offsets drawn once from a seeded generator: item ``i`` is always the same pair,
whatever order a sampler asks for it in, and ``target`` is ``input`` shifted by one.
"""
from __future__ import annotations

import logging
from importlib import resources

import torch
from torch.utils.data import Dataset

from csrc.errors import ConfigError

logger = logging.getLogger(__name__)

__all__ = ["load_corpus", "CharTokenizer", "split_tokens", "TextWindows"]


def load_corpus() -> str:
    """The shipped corpus as text."""
    return resources.files(__package__).joinpath("corpus.txt").read_text(encoding="utf-8")


class CharTokenizer:
    """One id per distinct character of the text it is built from, in code point order."""

    def __init__(self, text: str) -> None:
        if not text:
            raise ConfigError("CharTokenizer needs a non-empty text to take its vocabulary from")
        self.chars = sorted(set(text))
        self._ids = {ch: i for i, ch in enumerate(self.chars)}

    @property
    def vocab_size(self) -> int:
        return len(self.chars)

    def encode(self, text: str) -> torch.Tensor:
        """Token ids (int64) of ``text``; a character outside the vocabulary is an error."""
        try:
            return torch.tensor([self._ids[ch] for ch in text], dtype=torch.long)
        except KeyError as exc:
            raise ConfigError(f"character {exc.args[0]!r} is not in the tokenizer's vocabulary") from None

    def decode(self, ids: torch.Tensor | list[int]) -> str:
        """The text of token ids ``ids``."""
        values = ids.tolist() if isinstance(ids, torch.Tensor) else ids
        return "".join(self.chars[i] for i in values)


def split_tokens(tokens: torch.Tensor, *, chunk_tokens: int = 1024,
                 val_every: int = 10) -> tuple[torch.Tensor, torch.Tensor]:
    """(train, val): chunk ``k`` of ``chunk_tokens`` goes to val when ``k % val_every ==
    val_every - 1``, to train otherwise; each split is its chunks concatenated in order."""
    if chunk_tokens < 1 or val_every < 2:
        raise ConfigError(f"split_tokens: chunk_tokens must be >= 1 and val_every >= 2, "
                          f"got {chunk_tokens} and {val_every}")
    chunks = torch.split(tokens, chunk_tokens)
    val = [c for k, c in enumerate(chunks) if k % val_every == val_every - 1]
    train = [c for k, c in enumerate(chunks) if k % val_every != val_every - 1]
    if not val or not train:
        raise ConfigError(f"split_tokens: {tokens.numel()} tokens are too few for a split "
                          f"with chunk_tokens={chunk_tokens}, val_every={val_every}")
    return torch.cat(train), torch.cat(val)


class TextWindows(Dataset):
    """``num_windows`` pairs (tokens[s:s+L], tokens[s+1:s+L+1]) of length L = ``block_size``.

    Offsets ``s`` are drawn uniformly from a generator seeded with ``seed``, or, with
    ``seed=None``, spaced evenly from the start to the end (for a fixed validation set).
    """

    def __init__(self, tokens: torch.Tensor, *, block_size: int, num_windows: int,
                 seed: int | None = 0) -> None:
        if block_size < 1 or num_windows < 1:
            raise ConfigError(f"TextWindows: block_size and num_windows must be >= 1, "
                              f"got {block_size} and {num_windows}")
        last = tokens.numel() - block_size - 1
        if last < 0:
            raise ConfigError(f"TextWindows: {tokens.numel()} tokens are too few for block_size {block_size}")
        self.tokens = tokens
        self.block_size = block_size
        if seed is None:
            self.offsets = torch.linspace(0, last, num_windows).round().long()
        else:
            gen = torch.Generator().manual_seed(seed)
            self.offsets = torch.randint(0, last + 1, (num_windows,), generator=gen)

    def __len__(self) -> int:
        return self.offsets.numel()

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        s = int(self.offsets[i])
        window = self.tokens[s:s + self.block_size + 1]
        return window[:-1], window[1:]
