"""What ``offload.overlap_step`` pays to keep a step undoable with the state in host memory: the copy
of one sub-group's state block (master, exp_avg, exp_avg_sq) against the Adam pass over the same
sub-group, paired and repeated ([Note: overlapped step] in offload.zero.overlap).

    flock /tmp/ofl-bench.lock .venv/bin/python tools/bench/bench_rollback_copy.py [--numel N] [--repeats R]
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from cpu_adam import AdamConfig, adam_step


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--numel", type=int, default=1 << 22, help="sub-group elements (the offloaded cap: 4M)")
    ap.add_argument("--repeats", type=int, default=21)
    args = ap.parse_args()
    n = args.numel
    state = torch.randn(3 * n)
    state[2 * n:].abs_()  # exp_avg_sq >= 0
    copy, grad, out = torch.empty_like(state), torch.randn(n), torch.empty(n)
    config = AdamConfig(lr=1e-3)

    def adam() -> None:
        adam_step([state[:n]], [grad], [state[n:2 * n]], [state[2 * n:]], [torch.full((1,), 1.0)], config=config,
                  params_out=[out])

    def keep() -> None:
        copy.copy_(state)

    times: dict[str, list[float]] = {"adam": [], "copy": []}
    for _ in range(args.repeats + 1):  # the first of each is not measured
        for name, fn in (("adam", adam), ("copy", keep)):
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    adam_s, copy_s = times["adam"][1:], times["copy"][1:]
    ratios = [c / a for a, c in zip(adam_s, copy_s)]
    print(f"sub-group of {n} elements, {torch.get_num_threads()} torch threads: Adam pass "
          f"{statistics.median(adam_s) * 1e3:.2f} ms, rollback copy {statistics.median(copy_s) * 1e3:.2f} ms "
          f"(median); copy / Adam {statistics.median(ratios):.2f} (median of {len(ratios)} paired ratios, "
          f"{min(ratios):.2f}-{max(ratios):.2f})")


if __name__ == "__main__":
    main()
