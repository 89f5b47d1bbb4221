"""A small GPT: the decoder-only transformer that ``offload demo`` trains.

Token and position embeddings, ``n_layer`` pre-LayerNorm decoder blocks (causal
self-attention, then a GELU MLP, each added back onto the residual stream), a final
LayerNorm and a linear head onto the vocabulary, tied to the token embedding or not.
Attention is ``F.scaled_dot_product_attention(is_causal=True)``, so position ``t``
sees positions ``0..t`` only.

Initialisation draws from a ``torch.Generator`` seeded by the caller, so two models
built with the same config and seed are equal, and building one leaves torch's
global random state alone.
"""
from __future__ import annotations

import logging
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from csrc.errors import ConfigError

logger = logging.getLogger(__name__)

__all__ = ["GPTConfig", "GPT", "init_module"]


@dataclass(frozen=True, kw_only=True)
class GPTConfig:
    """Shape of the model; ``GPT(config)`` builds it."""

    vocab_size: int
    """Number of token ids (the tokenizer's vocabulary)."""
    block_size: int
    """Context length in tokens: the longest sequence ``forward`` accepts."""
    n_layer: int = 4
    """Number of decoder blocks."""
    n_head: int = 4
    """Attention heads per block; must divide ``n_embd``."""
    n_embd: int = 128
    """Width of the residual stream (embedding size)."""
    dropout: float = 0.0
    """Dropout probability on embeddings, attention and MLP outputs (0 for none)."""
    bias: bool = True
    """Whether Linear and LayerNorm layers carry a bias."""
    tied_head: bool = True
    """Whether the LM head shares its weight with the token embedding."""

    def __post_init__(self) -> None:
        for name in ("vocab_size", "block_size", "n_layer", "n_head", "n_embd"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ConfigError(f"GPTConfig.{name} must be a positive int, got {value!r}")
        if self.n_embd % self.n_head:
            raise ConfigError(f"GPTConfig.n_embd ({self.n_embd}) must be a multiple of n_head ({self.n_head})")
        if not 0.0 <= self.dropout < 1.0:
            raise ConfigError(f"GPTConfig.dropout must be in [0, 1), got {self.dropout!r}")


class CausalSelfAttention(nn.Module):
    """Multi-head self-attention where each position attends to itself and earlier ones."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.n_head = config.n_head
        self.dropout = config.dropout
        self.qkv = nn.Linear(config.n_embd, 3 * config.n_embd, bias=config.bias)
        self.proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.resid_drop = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, width = x.shape
        # (B, T, 3C) -> three (B, nh, T, hs) tensors.
        q, k, v = self.qkv(x).view(batch, seq, 3, self.n_head, width // self.n_head).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=self.dropout if self.training else 0.0,
                                           is_causal=True)
        y = y.transpose(1, 2).reshape(batch, seq, width)
        return self.resid_drop(self.proj(y))


class MLP(nn.Module):
    """Position-wise feed-forward: widen 4x, GELU, project back."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.fc = nn.Linear(config.n_embd, 4 * config.n_embd, bias=config.bias)
        self.proj = nn.Linear(4 * config.n_embd, config.n_embd, bias=config.bias)
        self.drop = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(self.proj(F.gelu(self.fc(x))))


class Block(nn.Module):
    """One pre-LayerNorm decoder block: x + attn(ln(x)), then x + mlp(ln(x))."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.ln_attn = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.attn = CausalSelfAttention(config)
        self.ln_mlp = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.mlp = MLP(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_attn(x))
        return x + self.mlp(self.ln_mlp(x))


def init_module(module: nn.Module, std: float, *, generator: torch.Generator | None = None) -> None:
    """GPT-2's init of one module's own params: Linear and Embedding weights N(0, std), biases zero,
    LayerNorms one and zero; other modules are left alone."""
    with torch.no_grad():
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, 0.0, std, generator=generator)
            if getattr(module, "bias", None) is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.LayerNorm):
            nn.init.ones_(module.weight)
            if module.bias is not None:
                nn.init.zeros_(module.bias)


class GPT(nn.Module):
    """The decoder-only language model; ``forward(idx, targets)`` returns the mean loss."""

    def __init__(self, config: GPTConfig, *, seed: int = 0) -> None:
        super().__init__()
        self.config = config
        # The layers' own default init draws from the global generator; fork it so
        # building a model leaves it as it was (_init_weights overwrites those draws).
        with torch.random.fork_rng(devices=[]):
            self.tok_emb = nn.Embedding(config.vocab_size, config.n_embd)
            self.pos_emb = nn.Embedding(config.block_size, config.n_embd)
            self.drop = nn.Dropout(config.dropout)
            self.blocks = nn.ModuleList(Block(config) for _ in range(config.n_layer))
            self.ln_final = nn.LayerNorm(config.n_embd, bias=config.bias)
            self.head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        if config.tied_head:
            self.head.weight = self.tok_emb.weight
        self._init_weights(seed)

    def _init_weights(self, seed: int) -> None:
        """GPT-2's scheme: N(0, 0.02) weights, zero biases, unit LayerNorms, and the two
        projections that write into the residual stream scaled by 1/sqrt(2 n_layer) so
        its variance does not grow with depth."""
        gen = torch.Generator().manual_seed(seed)
        residual_std = 0.02 / math.sqrt(2 * self.config.n_layer)
        with torch.no_grad():
            for name, module in self.named_modules():
                if module is self.head and self.config.tied_head:
                    continue
                init_module(module, residual_std if name.endswith(".proj") else 0.02, generator=gen)

    def num_parameters(self) -> int:
        """Distinct parameter elements (a tied head counts once)."""
        return sum(p.numel() for p in self.parameters())

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        """Logits (B, T, vocab) for token ids ``idx`` (B, T); with ``targets`` (B, T),
        the mean cross-entropy of those logits against them instead."""
        seq = idx.shape[1]
        if seq > self.config.block_size:
            raise ConfigError(f"sequence length {seq} exceeds GPTConfig.block_size {self.config.block_size}")
        pos = torch.arange(seq, device=idx.device)
        x = self.drop(self.tok_emb(idx) + self.pos_emb(pos))
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.ln_final(x))
        if targets is None:
            return logits
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
