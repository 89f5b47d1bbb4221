"""The step benches' shared pieces: the ~100M GPT, its contenders and config, the batches, rounds and report.

bench_step.py and its row modules (step_stage3, step_record, step_ranks, step_gpu) import these from
here, not from bench_step, which imports the row modules: the benches import one way, as the package does.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from offload.builder import initialize  # noqa: E402

LR, WEIGHT_DECAY = 3e-4, 0.1


class Block(nn.Module):
    """Pre-norm decoder block: causal self-attention and a 4x GELU MLP."""

    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.fc, self.out = nn.Linear(dim, 4 * dim), nn.Linear(4 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, d // self.heads).unbind(2)
        att = nn.functional.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                                         is_causal=True)
        x = x + self.proj(att.transpose(1, 2).reshape(b, t, d))
        return x + self.out(nn.functional.gelu(self.fc(self.ln2(x))))


class GPT(nn.Module):
    """Token and position embeddings, decoder blocks, a head tied to the token embedding."""

    def __init__(self, vocab: int, seq: int, dim: int, layers: int, heads: int) -> None:
        super().__init__()
        self.tok, self.pos = nn.Embedding(vocab, dim), nn.Embedding(seq, dim)
        self.blocks = nn.ModuleList(Block(dim, heads) for _ in range(layers))
        self.ln = nn.LayerNorm(dim)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1]))
        for block in self.blocks:
            x = block(x)
        logits = self.ln(x) @ self.tok.weight.t()
        return nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())


class TorchContender:
    name = "torch"

    def __init__(self, model: GPT) -> None:
        self.model = model
        self.opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY, fused=True)

    def step(self, idx: torch.Tensor, targets: torch.Tensor) -> tuple[float, float, float, float]:
        t0 = time.perf_counter()
        self.opt.zero_grad(set_to_none=True)
        loss = self.model(idx, targets)
        loss.backward()
        t1 = time.perf_counter()
        self.opt.step()
        t2 = time.perf_counter()
        return t2 - t0, t2 - t1, 0.0, loss.item()

    def close(self) -> None:
        pass


class EngineContender:
    def __init__(self, name: str, model: GPT, config: dict) -> None:
        self.name = name
        self.engine, _, _, _ = initialize(model=model, config=config)

    def step(self, idx: torch.Tensor, targets: torch.Tensor) -> tuple[float, float, float, float]:
        wait0 = self.engine.offload_stats().io_wait_seconds_total
        t0 = time.perf_counter()
        loss = self.engine(idx, targets)
        self.engine.backward(loss)
        t1 = time.perf_counter()
        self.engine.step()
        t2 = time.perf_counter()
        wait = self.engine.offload_stats().io_wait_seconds_total - wait0
        return t2 - t0, t2 - t1, wait, loss.item()

    def close(self) -> None:
        self.engine.close()


def engine_config(device: str, batch: int, nvme_path: str, buffer_count: int, checksum: bool = True,
                  overlap: bool = False) -> dict:
    offload: dict = {"device": device}
    if device == "nvme":
        offload.update(nvme_path=nvme_path, buffer_count=buffer_count)
    return {
        "offload": {"checksum": checksum, **({"overlap_step": True} if overlap else {})},
        "train_micro_batch_size_per_gpu": batch,
        "gradient_accumulation_steps": 1,
        "steps_per_print": 10 ** 9,
        "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": WEIGHT_DECAY}},
        "zero_optimization": {"stage": 1, "offload_optimizer": offload, "reduce_bucket_size": 50_000_000,
                              "sub_group_size": 100_000_000},
    }


def _load() -> str:
    try:
        return " ".join(Path("/proc/loadavg").read_text().split()[:3])
    except OSError:
        return "?"


def _fmt(values: list[float], scale: float = 1.0, digits: int = 2) -> str:
    return f"{statistics.median(values) * scale:.{digits}f} ({min(values) * scale:.{digits}f}-{max(values) * scale:.{digits}f})"


def model_arguments(ap: argparse.ArgumentParser) -> None:
    """The batch and the GPT's size (~100M by default)."""
    for flag, default in (("batch", 2), ("seq", 128), ("vocab", 16384), ("dim", 768), ("layers", 12), ("heads", 12)):
        ap.add_argument(f"--{flag}", type=int, default=default)


def parse_step_args(ap: argparse.ArgumentParser, argv: list[str]) -> argparse.Namespace:
    args = ap.parse_args(argv)
    if args.steps_per_round < 2:
        ap.error("--steps-per-round must be >= 2 (the first step of each is not measured)")
    return args


def model_and_batches(args: argparse.Namespace) -> tuple[GPT, list[torch.Tensor]]:
    """The bench's GPT (seed 0) and its 8 batches of token ids (seed 1)."""
    torch.manual_seed(0)
    base = GPT(args.vocab, args.seq, args.dim, args.layers, args.heads)
    gen = torch.Generator().manual_seed(1)
    return base, [torch.randint(0, args.vocab, (args.batch, args.seq + 1), generator=gen) for _ in range(8)]


def rotating_rounds(contenders: list, rounds: int, steps_per_round: int, data: list):
    """(round, contender, index of the step in its run, batch) in bench order: every contender runs
    ``steps_per_round`` steps per round on the same batches, the order rotating from round to round."""
    for r in range(rounds):
        for c in contenders[r % len(contenders):] + contenders[:r % len(contenders)]:
            for s in range(steps_per_round):
                yield r, c, s, data[(r * steps_per_round + s) % len(data)]


def publish(lines: list[str], out: str | None) -> None:
    """The report to stdout, and to ``out`` when given (the step benches' one way out)."""
    report = "\n".join(lines) + "\n"
    print(report)
    if out:
        Path(out).write_text(report)
