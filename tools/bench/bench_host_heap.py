"""Host memory over a long run: resident memory per step of the engine with the heap trim
([Note: host heap creep] in offload/runtime/host_heap.py), without it, with glibc's mmap threshold fixed
instead, and of plain torch (the peer), each in its own process, in the same run.

    .venv/bin/python tools/bench/bench_host_heap.py [--steps 60] [--rounds 3] [--dim 1536] [--layers 1]
        [--out FILE]

A GPT (vocab 64, seq 16, batch 2; width --dim, --layers blocks) trains --steps optimizer steps on
the CPU, ZeRO stage 1 with the optimizer in host memory (torch's AdamW for the peer). Per contender
and round: VmRSS after step 10 and after the last step, the highest VmRSS after any step, VmHWM,
the median step time (steps 6 on) and, with the trim, how many trims ran and their median time.
Reported: medians over rounds, and the ratios of the engine's figures to its own without the trim
and to plain torch's.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(Path(__file__).resolve().parent))

CONTENDERS = ("trim", "no trim", "mmap threshold 1 MiB", "torch")
MIB = 1 << 20


def _worker(contender: str, steps: int, dim: int, layers: int) -> dict:
    import torch

    from offload import initialize
    from offload.runtime import host_heap
    from offload.models.gpt import GPT, GPTConfig

    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=64, block_size=16, n_layer=layers, n_head=4, n_embd=dim))
    trims: list[float] = []
    if contender == "torch":
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)

        def step(ids):
            opt.zero_grad(set_to_none=True)
            model(ids[:, :-1], ids[:, 1:]).backward()
            opt.step()
    else:
        release = host_heap.release_free_heap

        def timed() -> bool:
            t0 = time.perf_counter()
            done = release()
            trims.append(time.perf_counter() - t0)
            return done

        host_heap.release_free_heap = timed  # what HeapTrimmer calls
        config = {"train_batch_size": 2, "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}},
                  "zero_optimization": {"stage": 1, "offload_optimizer": {"device": "cpu"}},
                  "offload": {"release_host_heap": contender == "trim"}}
        engine, _, _, _ = initialize(model=model, config=config)

        def step(ids):
            engine.backward(engine(ids[:, :-1], ids[:, 1:]))
            engine.step()
    g = torch.Generator().manual_seed(0)
    rss, seconds = [], []
    for _ in range(steps):
        ids = torch.randint(0, 64, (2, 17), generator=g)
        t0 = time.perf_counter()
        step(ids)
        seconds.append(time.perf_counter() - t0)
        rss.append(host_heap.resident_bytes())
    status = Path("/proc/self/status").read_text()
    hwm = next(int(line.split()[1]) * 1024 for line in status.splitlines() if line.startswith("VmHWM:"))
    return {"rss": rss, "seconds": seconds, "hwm": hwm, "trims": trims}


def _run(contender: str, args) -> dict:
    env = dict(os.environ, PYTHONPATH=str(REPO))
    if contender == "mmap threshold 1 MiB":
        env["MALLOC_MMAP_THRESHOLD_"] = str(MIB)  # a fixed threshold: large tensors always mmap'd
    proc = subprocess.run([sys.executable, __file__, "--worker", contender, "--steps", str(args.steps),
                           "--dim", str(args.dim), "--layers", str(args.layers)],
                          env=env, capture_output=True, text=True, timeout=1800)
    if proc.returncode != 0:
        raise SystemExit(f"{contender}: worker failed\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--dim", type=int, default=1536)
    ap.add_argument("--layers", type=int, default=1)
    ap.add_argument("--out", default=None, help="write the markdown report here too")
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        print(json.dumps(_worker(args.worker, args.steps, args.dim, args.layers)))
        return 0
    if args.steps < 12:
        ap.error("--steps must be >= 12 (figures are read after step 10)")
    from step_common import _load, publish

    rows: dict[str, dict[str, list[float]]] = {c: {} for c in CONTENDERS}
    for r in range(args.rounds):
        order = CONTENDERS[r % len(CONTENDERS):] + CONTENDERS[:r % len(CONTENDERS)]
        for c in order:
            got = _run(c, args)
            fig = {"rss10": got["rss"][9] / MIB, "rss_end": got["rss"][-1] / MIB, "rss_max": max(got["rss"]) / MIB,
                   "hwm": got["hwm"] / MIB, "step_ms": statistics.median(got["seconds"][5:]) * 1e3,
                   "trims": len(got["trims"]),
                   "trim_ms": statistics.median(got["trims"]) * 1e3 if got["trims"] else 0.0}
            for k, v in fig.items():
                rows[c].setdefault(k, []).append(v)
            print(f"round {r + 1}/{args.rounds}: {c}: RSS {fig['rss10']:.0f} -> {fig['rss_end']:.0f} MiB, "
                  f"step {fig['step_ms']:.1f} ms", flush=True)
    med = {c: {k: statistics.median(v) for k, v in f.items()} for c, f in rows.items()}
    lines = [f"# Host memory over {args.steps} steps: heap trim, no trim, fixed mmap threshold, plain torch",
             "", f"- command: `python tools/bench/bench_host_heap.py --steps {args.steps} --rounds {args.rounds} "
                 f"--dim {args.dim} --layers {args.layers}`; load average at the end {_load()}",
             f"- GPT width {args.dim}, {args.layers} block(s), vocab 64, batch 2 x 16 tokens, fp32 on the CPU; "
             "the engine at ZeRO stage 1 with offload_optimizer cpu; torch: AdamW; one process per contender "
             f"and round, rotating order; medians over {args.rounds} rounds", "",
             "| contender | RSS after step 10 MiB | RSS at the end MiB | highest RSS MiB | VmHWM MiB | growth after step 10 MiB "
             "| step ms | step / no trim | trims | trim ms |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    base = med["no trim"]["step_ms"]
    for c in CONTENDERS:
        m = med[c]
        lines.append(f"| {c} | {m['rss10']:.0f} | {m['rss_end']:.0f} | {m['rss_max']:.0f} | {m['hwm']:.0f} | "
                     f"{m['rss_max'] - m['rss10']:+.0f} | {m['step_ms']:.1f} | {m['step_ms'] / base:.2f}x | "
                     f"{m['trims']:.0f} | {m['trim_ms']:.1f} |")
    torch_growth = med["torch"]["rss_max"] - med["torch"]["rss10"]
    lines += ["", f"Growth after step 10 (highest RSS - RSS after step 10): trim {med['trim']['rss_max'] - med['trim']['rss10']:+.0f} "
              f"MiB, no trim {med['no trim']['rss_max'] - med['no trim']['rss10']:+.0f} MiB, plain torch {torch_growth:+.0f} MiB."]
    publish(lines, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
