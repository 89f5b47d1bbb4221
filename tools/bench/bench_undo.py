"""The undo log's cost on the C Adam pass: ``adam_step`` (today's pass) against ``UndoLog.step`` (the
pass the engine's recorded step runs: [Note: undo log] in csrc/adam_undo.c), over the same buffers.

The state is laid out as the engine's offloaded step sees it: ``--sub-groups`` blocks of
``--numel`` fp32 elements (master, exp_avg, exp_avg_sq; a bf16 gradient accumulator of the same
length and a bf16 param copy written in the same pass; default 24 x 4M, the ~100M GPT of
bench_step), the undo log in a shared mapping. Each repetition steps every sub-group once with one
contender then once with the other, the first of the two alternating, so both see the same machine;
reported: the median pass time of each and the median of the paired ratios logged / plain, with
the load average beside them. The numerics are checked too: both contenders step identical copies
and must stay bit-equal.

python tools/bench/bench_undo.py [--numel 4194304] [--sub-groups 24] [--repeats 15] [--threads N] [--out FILE]
"""
from __future__ import annotations

import argparse
import datetime
import mmap
import os
import statistics
import sys
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[1]))
sys.path.insert(0, str(HERE))
from machine import cpu_description  # noqa: E402

from cpu_adam import AdamConfig, adam_step, default_num_threads, resolve_isa  # noqa: E402
from cpu_adam.undo import UndoLog, undo_bytes  # noqa: E402


def _blocks(n_sub: int, numel: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n_sub):
        out.append((torch.randn(numel, generator=g), torch.randn(numel, generator=g).to(torch.bfloat16),
                    torch.randn(numel, generator=g) * 0.01, torch.rand(numel, generator=g) * 1e-4,
                    torch.empty(numel, dtype=torch.bfloat16)))
    return out


def _pass(blocks, config, step, log: UndoLog | None) -> float:
    t0 = time.perf_counter()
    for p, g, m, v, out in blocks:
        steps = [torch.full((1,), float(step))]
        if log is None:
            adam_step([p], [g], [m], [v], steps, config=config, grad_scale=0.5, params_out=[out])
        else:
            log.begin()
            log.step([p], [g], [m], [v], steps, config=config, call=0, grad_scale=0.5, params_out=[out])
    return time.perf_counter() - t0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--numel", type=int, default=4 << 20)
    ap.add_argument("--sub-groups", type=int, default=24)
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    threads = args.threads or default_num_threads()
    config = AdamConfig(lr=1e-3, weight_decay=0.01, num_threads=threads)
    plain = _blocks(args.sub_groups, args.numel, 0)
    logged = _blocks(args.sub_groups, args.numel, 0)
    buf = mmap.mmap(-1, undo_bytes(threads, args.numel))
    log = UndoLog(buf, fresh=True, slots=threads, max_elems=args.numel)
    _pass(plain, config, 1, None)  # warm-up: first touch of the pages, the workers started
    _pass(logged, config, 1, log)
    times = {"plain": [], "logged": []}
    ratios, loads = [], []
    for r in range(args.repeats):
        order = [("plain", None), ("logged", log)] if r % 2 == 0 else [("logged", log), ("plain", None)]
        got = {}
        for name, lg in order:
            got[name] = _pass(plain if lg is None else logged, config, r + 2, lg)
            times[name].append(got[name])
        ratios.append(got["logged"] / got["plain"])
        loads.append(os.getloadavg()[0])
        print(f"rep {r + 1}: plain {got['plain']:.4f} s, logged {got['logged']:.4f} s, ratio {ratios[-1]:.3f}, "
              f"load {loads[-1]:.2f}", flush=True)
    same = all(torch.equal(a[i], b[i]) for a, b in zip(plain, logged) for i in (0, 2, 3, 4))
    elems = args.sub_groups * args.numel
    cmd = " ".join(["python", "tools/bench/bench_undo.py"] + (argv if argv is not None else sys.argv[1:]))
    lines = [
        f"# The undo log's cost on the C Adam pass, {datetime.date.today().isoformat()}",
        "",
        f"- machine: {cpu_description()}, {os.cpu_count()} CPUs; {threads} Adam threads, path "
        f"{resolve_isa(None).name.lower()}; torch {torch.__version__}",
        f"- command: `{cmd}`",
        f"- {args.sub_groups} sub-groups x {args.numel} elements ({elems / 1e6:.1f}M: fp32 master and moments, bf16 "
        "gradient, bf16 param copy written in the pass), one pass = every sub-group stepped once; "
        f"{args.repeats} repetitions, plain and logged alternating first",
        f"- load average (1 min) during the run: {min(loads):.2f}-{max(loads):.2f} (median {statistics.median(loads):.2f}); "
        "other developers' work shared the 2 cores",
        "",
        "| contender | pass s, median (min-max) | ns / element |",
        "| --- | --- | --- |",
    ]
    for name, ts in times.items():
        lines.append(f"| {name} (`{'adam_step' if name == 'plain' else 'UndoLog.step'}`) | "
                     f"{statistics.median(ts):.4f} ({min(ts):.4f}-{max(ts):.4f}) | "
                     f"{statistics.median(ts) / elems * 1e9:.3f} |")
    lines += ["", f"Logged / plain, median of the paired ratios: **{statistics.median(ratios):.3f}x** "
              f"(min {min(ratios):.3f}, max {max(ratios):.3f}); results bit-equal: {same}"]
    report = "\n".join(lines) + "\n"
    print(report)
    if args.out:
        Path(args.out).write_text(report)
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
