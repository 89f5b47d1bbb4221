"""Stage 3 rows of the training step bench: the ~100M GPT with its params offloaded, against plain torch.

The model is ``offload.models.gpt.GPT`` at bench_step.py's shape (its own GPT computes the tied head
as ``ln(x) @ tok.weight.t()`` in the top module, outside the embedding's forward: stage 3 gathers a
parameter around its owner's forward only, so the head is a Linear module sharing the weight here).
Contenders (the same model, seed and batches; fp32, one rank):
  torch               plain torch, ``torch.optim.AdamW(fused=True)`` (the peer)
  s3 param cpu        ZeRO stage 3, offload_param cpu, offload_optimizer cpu
  s3 param nvme       offload_param nvme (``--param-buffers`` shards in host memory), offload_optimizer cpu
  s3 param+opt nvme   offload_param nvme and offload_optimizer nvme

Per contender: the median step time (forward + backward + optimizer step), the time the step waited
on parameter fetches (``coordinator.fetch_wait_seconds``: a unit's shard not yet in host memory
when the module needs it), all parameter-shard I/O waits (fetches plus the step's shard reads and
write-backs, ``shards.io_wait_seconds``), the optimizer's I/O wait, overlap = 1 - all waits / step,
and the median over rounds of the paired ratio of its step time to torch's in the same round.
Rounds rotate the order; the first step of each contender in a round is not measured.

Usage: python tools/bench/step_stage3.py [--rounds 3] [--steps-per-round 3] [--param-buffers 5]
       [--nvme-path DIR] [--out FILE]   (or bench_step.py --stage3 ...)
Run under `flock /tmp/ofl-bench.lock`.
"""
from __future__ import annotations

import argparse
import copy
import datetime
import gc
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from machine import cpu_description as _cpu_model  # noqa: E402
from step_common import LR, WEIGHT_DECAY, TorchContender, _fmt, _load, publish  # noqa: E402

from offload.builder import initialize  # noqa: E402
from offload.models.gpt import GPT, GPTConfig  # noqa: E402


class Stage3Contender:
    def __init__(self, name: str, model: GPT, config: dict) -> None:
        self.name = name
        self.engine, _, _, _ = initialize(model=model, config=config)
        self.parts = self.engine.stage3

    def _waits(self) -> tuple[float, float, float]:
        return (self.parts.coordinator.fetch_wait_seconds, self.parts.shards.io_wait_seconds,
                self.engine.offload_stats().io_wait_seconds_total)

    def step(self, idx: torch.Tensor, targets: torch.Tensor) -> tuple[float, tuple[float, float, float], float]:
        before = self._waits()
        t0 = time.perf_counter()
        loss = self.engine(idx, targets)
        self.engine.backward(loss)
        self.engine.step()
        dt = time.perf_counter() - t0
        return dt, tuple(b - a for a, b in zip(before, self._waits())), loss.item()

    def close(self) -> None:
        self.engine.close()


def stage3_config(param: str, optimizer: str, *, batch: int, nvme_path: str, param_buffers: int) -> dict:
    def where(device: str, buffers: int) -> dict:
        return {"device": device, **({"nvme_path": nvme_path, "buffer_count": buffers} if device == "nvme" else {})}

    return {"train_micro_batch_size_per_gpu": batch, "gradient_accumulation_steps": 1, "steps_per_print": 10 ** 9,
            "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": WEIGHT_DECAY}},
            "zero_optimization": {"stage": 3, "offload_param": where(param, param_buffers),
                                  "offload_optimizer": where(optimizer, 4), "sub_group_size": 100_000_000}}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps-per-round", type=int, default=3, help="the first of them is not measured")
    for flag, default in (("batch", 2), ("seq", 128), ("vocab", 16384), ("dim", 768), ("layers", 12), ("heads", 12)):
        ap.add_argument(f"--{flag}", type=int, default=default, help=f"as bench_step.py's ({default})")
    ap.add_argument("--param-buffers", type=int, default=5, help="offload_param.buffer_count")
    ap.add_argument("--nvme-path", default=None, help="directory for the swap files (default: a temporary one)")
    ap.add_argument("--out", default=None, help="write the markdown report here too")
    args = ap.parse_args(argv)
    if args.steps_per_round < 2:
        ap.error("--steps-per-round must be >= 2 (the first step of each is not measured)")

    torch.manual_seed(0)
    base = GPT(GPTConfig(vocab_size=args.vocab, block_size=args.seq, n_layer=args.layers, n_head=args.heads,
                         n_embd=args.dim, tied_head=True))
    n_params = sum(p.numel() for p in base.parameters())
    gen = torch.Generator().manual_seed(1)
    data = [torch.randint(0, args.vocab, (args.batch, args.seq + 1), generator=gen) for _ in range(8)]
    tmp = tempfile.TemporaryDirectory(prefix="bench-step3-", dir=args.nvme_path)
    contenders: list = [TorchContender(copy.deepcopy(base))]
    for name, param, opt in (("s3 param cpu", "cpu", "cpu"), ("s3 param nvme", "nvme", "cpu"),
                             ("s3 param+opt nvme", "nvme", "nvme")):
        contenders.append(Stage3Contender(name, copy.deepcopy(base), stage3_config(
            param, opt, batch=args.batch, nvme_path=tmp.name, param_buffers=args.param_buffers)))
    del base
    gc.collect()
    print(f"{n_params / 1e6:.1f}M params; contenders: {', '.join(c.name for c in contenders)}", flush=True)

    steps: dict[str, list[float]] = {c.name: [] for c in contenders}
    waits: dict[str, list[tuple[float, float, float]]] = {c.name: [] for c in contenders}
    ratios: dict[str, list[float]] = {c.name: [] for c in contenders[1:]}
    losses: dict[str, list[float]] = {c.name: [] for c in contenders}
    for c in contenders:  # warm-up: the first step records the fetch order
        c.step(data[0][:, :-1], data[0][:, 1:])
    cursor = 0
    for r in range(args.rounds):
        order = contenders[r % len(contenders):] + contenders[:r % len(contenders)]
        round_step: dict[str, list[float]] = {}
        for c in order:
            for s in range(args.steps_per_round):
                batch = data[(cursor + s) % len(data)]
                if isinstance(c, TorchContender):
                    dt, _, _, loss = c.step(batch[:, :-1], batch[:, 1:])
                    wait = (0.0, 0.0, 0.0)
                else:
                    dt, wait, loss = c.step(batch[:, :-1], batch[:, 1:])
                losses[c.name].append(loss)
                if s == 0:
                    continue
                steps[c.name].append(dt)
                waits[c.name].append(wait)
                round_step.setdefault(c.name, []).append(dt)
        cursor += args.steps_per_round
        for name in ratios:
            ratios[name].append(statistics.median(round_step[name]) / statistics.median(round_step["torch"]))
        print(f"round {r + 1}/{args.rounds}: " + ", ".join(f"{n} {statistics.median(v):.2f}s"
                                                          for n, v in round_step.items()), flush=True)
    prefetches = {c.name: c.parts.coordinator.stats().prefetches for c in contenders if isinstance(c, Stage3Contender)}
    for c in contenders:
        c.close()
    tmp.cleanup()

    cmd = ["flock /tmp/ofl-bench.lock .venv/bin/python tools/bench/step_stage3.py"] + \
        (argv if argv is not None else sys.argv[1:])
    lines = [
        f"# Training step bench, stage 3 rows: ~100M GPT, {datetime.date.today().isoformat()}", "",
        f"- machine: {_cpu_model()} ({os.cpu_count()} CPUs, {torch.get_num_threads()} torch threads); torch "
        f"{torch.__version__}; Python {platform.python_version()}; load average at the end {_load()}",
        f"- command: `{' '.join(cmd)}`",
        f"- model: offload.models.gpt.GPT at bench_step.py's shape, {n_params / 1e6:.1f}M params (vocab {args.vocab}, dim {args.dim}, "
        f"{args.layers} layers, {args.heads} heads, tied head), fp32, batch {args.batch} x seq {args.seq}; "
        f"ZeRO stage 3 on one rank, offload_param.buffer_count {args.param_buffers}, stage3_* limits at "
        "DeepSpeed's defaults",
        f"- {args.rounds} rounds x {len(contenders)} contenders x {args.steps_per_round} steps (first not "
        "measured), rotating order; medians (min-max) over measured steps",
        "- fetch wait: the step waited for a param shard a module needed; param I/O wait: fetch waits plus "
        "the optimizer step's shard reads and write-backs; opt I/O wait: the optimizer state's; overlap = "
        "1 - (param I/O wait + opt I/O wait) / step", "",
        "| contender | step s | fetch wait s | fetch wait / step | param I/O wait s | opt I/O wait s | overlap "
        "| step / torch |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for c in contenders:
        st, w = steps[c.name], waits[c.name]
        if c.name == "torch":
            lines.append(f"| torch | {_fmt(st)} |  |  |  |  |  |  |")
            continue
        fetch = [x[0] for x in w]
        share = [x[0] / t for x, t in zip(w, st)]
        overlap = [1 - (x[1] + x[2]) / t for x, t in zip(w, st)]
        lines.append(f"| {c.name} | {_fmt(st)} | {_fmt(fetch, digits=3)} | {_fmt(share, digits=3)} | "
                     f"{_fmt([x[1] for x in w], digits=3)} | {_fmt([x[2] for x in w], digits=3)} | "
                     f"{_fmt(overlap, digits=3)} | **{_fmt(ratios[c.name])}x** |")
    drift = {n: max(abs(a - b) / b for a, b in zip(v, losses["torch"])) for n, v in losses.items() if n != "torch"}
    lines += ["", "Shard prefetches started: " + ", ".join(f"{n} {k}" for n, k in prefetches.items()),
              "Same losses as torch at every step (largest relative difference): "
              + ", ".join(f"{n} {d:.1e}" for n, d in drift.items())]
    publish(lines, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
