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
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from machine import cpu_description as _cpu_model  # noqa: E402  (one reader of the CPU's name for the benches)
from cpu_adam import resolve_isa  # noqa: E402
from step_common import (EngineContender, TorchContender, _fmt, _load, engine_config, model_and_batches,  # noqa: E402
                         model_arguments, parse_step_args, publish)


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


if __name__ == "__main__":
    sys.exit(main())
