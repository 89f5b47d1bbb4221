"""bench_adam.py's interleaved mode: CPUAdam as a user's loop runs it, right after torch's own CPU work.

Each round runs, for every thread source of ours (``team``: torch's OpenMP team, the default; ``pool``:
the kernels' own threads, [Note: one thread team] in csrc/ofl_parallel.h), in an order shuffled from
round to round, one pair: a step of torch's fused AdamW, then at once one step of CPUAdam over the same
shapes (one CPUAdam, stepped on the source of the pair), each timed alone. Our step so always starts while torch's OpenMP workers are still spinning
after theirs, and torch's starts right after ours: the hand-off between the two is in both figures.
Reported per source: both optimizers' median Mparams/s in its pairs, and the median of the per-pair
ratios torch's time / ours (above 1: ours is faster), with p10-p90.

The load (``--load busyN``: N processes each spinning a Python busy loop) runs for the whole mode.
"""
from __future__ import annotations

import random
import statistics
import time
from typing import Callable

import torch

from cpu_adam import CPUAdam, set_thread_source, team_stats

SOURCES = ("team", "pool")


def target_for(n: int, tensors: int) -> float:
    """Issue 43's bar for ours / torch: 1.3x where the tensors are of 1e4 or fewer params, else 1.0x."""
    return 1.3 if tensors >= 100 and n // tensors <= 10_000 else 1.0


Params = Callable[[], list[torch.Tensor]]


def measure_pairs(params: Params, rounds: int, lr: float, wd: float, threads: int,
                  sources: tuple[str, ...] = SOURCES) -> dict[str, list[tuple[float, float]]]:
    """(torch's seconds, ours' seconds) of every pair, per source of our threads; ``params()`` makes the
    same params with grads each time it is called."""
    torch_opt = torch.optim.AdamW(params(), lr=lr, weight_decay=wd, fused=True)
    # One optimizer of ours, stepped on either source (the same bits): torch's state and ours then take
    # turns in the caches as in a user's loop, whatever the source; one instance a source would leave
    # ours' state twice as long out of use as torch's, and out of a cache that holds both.
    ours_opt = CPUAdam(params(), lr=lr, weight_decay=wd, num_threads=threads)
    for _ in range(3):  # warm up: the state's allocation and first touch, torch's first fused calls
        for s in sources:
            torch_opt.step()
            set_thread_source(s)
            ours_opt.step()
    pairs: dict[str, list[tuple[float, float]]] = {s: [] for s in sources}
    order = list(sources)
    shuffler = random.Random(0)
    clock = time.perf_counter
    try:
        for _ in range(rounds):
            shuffler.shuffle(order)
            for s in order:
                set_thread_source(s)
                t0 = clock()
                torch_opt.step()
                t1 = clock()
                ours_opt.step()
                t2 = clock()
                pairs[s].append((t1 - t0, t2 - t1))
    finally:
        set_thread_source("team")
    return pairs


def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def rows_for(case: str, n: int, tensors: int, pairs: dict[str, list[tuple[float, float]]],
             summary: dict[str, dict[str, str]]) -> list[str]:
    rows = []
    want = target_for(n, tensors)
    for source, got in pairs.items():
        torch_mps = [n / t / 1e6 for t, _ in got]
        ours_mps = [n / o / 1e6 for _, o in got]
        ratios = [t / o for t, o in got]
        med = statistics.median(ratios)
        text = f"{med:.2f}x ({_pct(ratios, 0.1):.2f}-{_pct(ratios, 0.9):.2f})"
        verdict = f">= {want:.1f}x: {'met' if med >= want else '**not met**'}"
        summary.setdefault(case, {})[source] = f"{text}; {verdict}"
        rows.append(f"| {case} | {source} | {statistics.median(ours_mps):,.0f} "
                    f"({_pct(ours_mps, 0.1):,.0f}-{_pct(ours_mps, 0.9):,.0f}) "
                    f"| {statistics.median(torch_mps):,.0f} ({_pct(torch_mps, 0.1):,.0f}-{_pct(torch_mps, 0.9):,.0f}) "
                    f"| **{text}** | {verdict} |")
    return rows


def run(shapes: list[tuple[int, int]], params_for: Callable[[int, int], Params], rounds_for: Callable[[int], int],
        lr: float, wd: float, threads: int, emit: Callable[[list[str]], list[str]]) -> list[str]:
    """The mode's table, one case a shape (n params in that many tensors: ``params_for(n, tensors)``)."""
    rows = emit(["", "| case | our threads | ours Mparams/s (after torch's step) | torch fused Mparams/s "
                 "(after ours) | torch time / ours, per pair | target |", "| --- | --- | --- | --- | --- | --- |"])
    summary: dict[str, dict[str, str]] = {}
    calls = team_stats()
    for n, tensors in shapes:
        rounds = rounds_for(n)
        case = f"{n:.0e} x {tensors} ({rounds} pairs a source)"
        pairs = measure_pairs(params_for(n, tensors), rounds, lr, wd, threads)
        rows += emit(rows_for(case, n, tensors, pairs, summary))
    after = team_stats()
    late = after.late_calls - calls.late_calls
    rows += emit(["", f"- our calls on torch's OpenMP team: {after.calls - calls.calls}, of them closed late "
                  f"(a member the scheduler ran late, >= 0.2 ms): {late}, "
                  f"waiting {after.late_seconds - calls.late_seconds:.3f} s in all"])
    return rows
