"""Training step of a ~100M-parameter GPT: the engine against plain torch, in the same run.

Contenders, each with its own copy of the same model (same seed) and the same batches:
  torch        plain torch, ``torch.optim.AdamW(fused=True)`` (the peer)
  none         offload.initialize, optimizer state on the model's device
  cpu          offload_optimizer cpu: fp32 master + moments in host memory (the tier)
  nvme         offload_optimizer nvme, swap file under --nvme-path, ``buffer_count`` state
               blocks in host memory at least (as many as the host memory budget holds),
               CRC-32C on every transfer unless "nocrc" (one contender per --nvme spec:
               COUNT or COUNT:nocrc)

A step is one training iteration: forward, backward and the optimizer step. In every round
each contender runs --steps-per-round consecutive steps, in an order that rotates from
round to round; the first of them is not measured (it absorbs the switch from the other
contenders: its NVMe writes would otherwise finish for free while others run). Reported per
contender: the median step time over all measured steps, the optimizer step alone
(``engine.step()`` / ``opt.step()``), the time the step waited on I/O (deltas of
``engine.offload_stats().io_wait_seconds_total``), overlap = 1 - wait / step, and the
median over rounds of the paired ratio of its step time to torch's in the same round.

Usage: python tools/bench/bench_step.py [--rounds 3] [--steps-per-round 3] [--batch 2]
       [--seq 128] [--nvme-path DIR] [--nvme 4 4:nocrc] [--daemon-ranks N] [--out FILE]
       python tools/bench/bench_step.py --stage3 ...   (the stage 3 rows: tools/bench/step_stage3.py)
       python tools/bench/bench_step.py --gpu ...      (the GPU rows, ~1B bf16: tools/bench/step_gpu.py)
       python tools/bench/bench_step.py --record ...   (the step record's cost, resume time: step_record.py)
Run under `flock /tmp/ofl-bench.lock` when other benchmarks share the machine.
"""
from __future__ import annotations

import argparse
import copy
import datetime
import gc
import math
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_adam import cpu_description as _cpu_model  # noqa: E402  (one reader of the CPU's name for the benches)
from cpu_adam import resolve_isa  # noqa: E402
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


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if "--stage3" in argv:  # the stage-3 rows live in their own module
        import step_stage3

        return step_stage3.main([a for a in argv if a != "--stage3"])
    if "--record" in argv:  # the restartable step's cost and resume time: tools/bench/step_record.py
        import step_record

        return step_record.main([a for a in argv if a != "--record"])
    if "--gpu" in argv:  # the GPU rows (bf16, ~1B): tools/bench/step_gpu.py
        import step_gpu

        return step_gpu.main([a for a in argv if a != "--gpu"])
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps-per-round", type=int, default=3, help="the first of them is not measured")
    model_arguments(ap)
    ap.add_argument("--nvme-path", default=None, help="directory for the swap file (default: a temporary one)")
    ap.add_argument("--nvme", nargs="*", default=["4", "4:nocrc"],
                    help="one nvme contender per spec: buffer_count, with :nocrc for no checksums")
    ap.add_argument("--out", default=None, help="write the markdown report here too")
    ap.add_argument("--overlap", action="store_true",
                    help="add a contender: cpu with offload.overlap_step true (the step under backward)")
    ap.add_argument("--daemon-ranks", type=int, default=0,
                    help="add the ranks row (step_ranks.py): N ranks, nvme through one daemon vs embedded stores")
    args = parse_step_args(ap, argv)
    base, data = model_and_batches(args)
    n_params = sum(p.numel() for p in base.parameters())
    tmp = tempfile.TemporaryDirectory(prefix="bench-step-", dir=args.nvme_path)
    contenders = [TorchContender(copy.deepcopy(base))]
    for device in ("none", "cpu"):
        contenders.append(EngineContender(device, copy.deepcopy(base), engine_config(device, args.batch, tmp.name, 4)))
    if args.overlap:
        contenders.append(EngineContender("cpu, overlap_step", copy.deepcopy(base),
                                          engine_config("cpu", args.batch, tmp.name, 4, overlap=True)))
    for spec in args.nvme:
        count, _, flag = spec.partition(":")
        name = f"nvme (buffer_count {count}{', no CRC' if flag == 'nocrc' else ''})"
        contenders.append(EngineContender(name, copy.deepcopy(base), engine_config(
            "nvme", args.batch, tmp.name, int(count), checksum=flag != "nocrc")))
    del base
    gc.collect()
    print(f"{n_params / 1e6:.1f}M params; contenders: {', '.join(c.name for c in contenders)}", flush=True)

    samples = {c.name: {"step": [], "opt": [], "wait": []} for c in contenders}
    ratios: dict[str, list[float]] = {c.name: [] for c in contenders[1:]}
    opt_ratios: dict[str, list[float]] = {c.name: [] for c in contenders[1:]}
    losses: dict[str, list[float]] = {c.name: [] for c in contenders}
    cursor = 0
    for c in contenders:  # warm-up: first step allocates, first NVMe read
        c.step(data[0][:, :-1], data[0][:, 1:])
    for r in range(args.rounds):
        order = contenders[r % len(contenders):] + contenders[:r % len(contenders)]
        round_step: dict[str, list[float]] = {}
        round_opt: dict[str, list[float]] = {}
        for c in order:
            for s in range(args.steps_per_round):
                batch = data[(cursor + s) % len(data)]
                step, opt, wait, loss = c.step(batch[:, :-1], batch[:, 1:])
                losses[c.name].append(loss)
                if s == 0:
                    continue
                samples[c.name]["step"].append(step)
                samples[c.name]["opt"].append(opt)
                samples[c.name]["wait"].append(wait)
                round_step.setdefault(c.name, []).append(step)
                round_opt.setdefault(c.name, []).append(opt)
        cursor += args.steps_per_round
        for name in ratios:
            ratios[name].append(statistics.median(round_step[name]) / statistics.median(round_step["torch"]))
            opt_ratios[name].append(statistics.median(round_opt[name]) / statistics.median(round_opt["torch"]))
        print(f"round {r + 1}/{args.rounds}: " + ", ".join(f"{n} {statistics.median(v):.2f}s"
                                                          for n, v in round_step.items()), flush=True)
    states = {c.name: c.engine.offload_stats() for c in contenders if isinstance(c, EngineContender)}
    overlaps = {c.name: c.engine.overlap for c in contenders
                if isinstance(c, EngineContender) and c.engine.overlap is not None}
    engines = {c.name: c.engine.offload_stats().tier for c in contenders if isinstance(c, EngineContender)}
    for c in contenders:
        c.close()
    tmp.cleanup()

    lines = [
        f"# Training step bench: ~100M GPT, {datetime.date.today().isoformat()}",
        "",
        f"- machine: {_cpu_model()} ({os.cpu_count()} CPUs, {torch.get_num_threads()} torch threads, CPU Adam "
        f"path {resolve_isa(None).name.lower()}); torch {torch.__version__}; Python {platform.python_version()}; "
        f"load average at the end {_load()}",
        f"- command: `{' '.join(['python', 'tools/bench/bench_step.py'] + (argv if argv is not None else sys.argv[1:]))}`",
        f"- model: GPT, {n_params / 1e6:.1f}M params (vocab {args.vocab}, dim {args.dim}, {args.layers} layers, "
        f"{args.heads} heads, tied head), fp32, batch {args.batch} x seq {args.seq}; ZeRO stage 1 on one rank",
        f"- {args.rounds} rounds x {len(contenders)} contenders x {args.steps_per_round} steps (first not "
        "measured), rotating order; medians (min-max) over measured steps; ratio: median over rounds of "
        "the paired ratio to torch's in the same round",
        "- step = forward + backward + optimizer step; opt = the optimizer step alone; wait = time the "
        "step waited on tier I/O; overlap = 1 - wait / step",
        "",
        "| contender | step s | opt s | I/O wait s | overlap | step / torch | opt / torch | optimizer state |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for c in contenders:
        s = samples[c.name]
        overlap = [1 - w / t for w, t in zip(s["wait"], s["step"])]
        ratio = f"**{_fmt(ratios[c.name])}x**" if c.name in ratios else ""
        opt_ratio = f"{_fmt(opt_ratios[c.name])}x" if c.name in opt_ratios else ""
        where = ""
        if c.name in states:  # between steps: on the device, in host memory, or on NVMe
            st = states[c.name]
            where = f"{st.optimizer_device} {sum(st.state_bytes_by_tier.values()) / 1e9:.2f} GB"
        wait = _fmt(s["wait"], digits=3) if c.name != "torch" else ""
        ov = _fmt(overlap, digits=3) if c.name != "torch" else ""
        lines.append(f"| {c.name} | {_fmt(s['step'])} | {_fmt(s['opt'], digits=3)} | {wait} | {ov} | {ratio} | {opt_ratio} | {where} |")
    lines += ["", "Tiers: " + "; ".join(f"{n}: {t}" for n, t in engines.items()), ""]
    for name, ov in overlaps.items():  # offload.overlap_step: the step's time under backward and after it
        st = states[name]
        paired = [a / b for a, b in zip(ratios[name], ratios["cpu"])]  # the same round's torch cancels
        lines += [f"{name} / cpu, step time: {_fmt(paired)}x (median over rounds of the paired ratio)", ""]
        lines += [f"{name}, over all {st.optimizer_steps} steps: optimizer step under backward "
                  f"{ov.seconds_under_backward:.2f} s (of which copies kept for a rollback {ov.backup_seconds:.2f} s), "
                  f"after backward {st.step_seconds_total:.2f} s; {ov.early_sub_groups} sub-groups stepped early, "
                  f"{ov.rollbacks} steps rolled back", ""]
    drift = {n: max(abs(a - b) / b for a, b in zip(v, losses["torch"])) for n, v in losses.items() if n != "torch"}
    lines.append("Same losses as torch at every step (largest relative difference): "
                 + ", ".join(f"{n} {d:.1e}" for n, d in drift.items()))
    if args.daemon_ranks:  # after the one-rank contenders have closed: the ranks need the memory
        from step_ranks import ranks_row
        lines += ["", *ranks_row(ranks=args.daemon_ranks, rounds=args.rounds, steps_per_round=args.steps_per_round,
                                 batch=args.batch, seq=args.seq, vocab=args.vocab, dim=args.dim, layers=args.layers,
                                 heads=args.heads, buffer_count=4, nocrc=False, nvme_path=args.nvme_path)]
    publish(lines, args.out)
    return 0 if all(math.isfinite(d) for d in drift.values()) else 1


def publish(lines: list[str], out: str | None) -> None:
    """The report to stdout, and to ``out`` when given (the step benches' one way out)."""
    report = "\n".join(lines) + "\n"
    print(report)
    if out:
        Path(out).write_text(report)


if __name__ == "__main__":
    sys.exit(main())
