"""Where a contender's step goes: forward, backward and step in wall time, CPU time and page faults.

The contention bench (bench_contention.py) times each phase in wall seconds, which a shared
machine moves by 2x from one run to the next. This adds what the process itself spent in each
phase, which moves much less: user and system CPU seconds of all its threads (``getrusage``) and
minor page faults (fresh pages: a large tensor allocated by mmap and freed again, a kernel copy
through a socket). A phase whose wall time is well above its CPU time waited (on another rank, on
a descheduled thread); one whose system time is large is paging or copying through the kernel.

Each line is one rank: the median over steps 3..N of each phase. Same model, data and configs as
contention_worker.py (this imports it); run it under torchrun with OMP_NUM_THREADS=1 for config e,
and with DS_ACCELERATOR=cpu in DeepSpeed's venv for DeepSpeed:

    .venv/bin/python tools/bench/contention_sections.py ours a --steps 6
    OMP_NUM_THREADS=1 .venv/bin/python -m torch.distributed.run --standalone --nproc_per_node 2 \\
        tools/bench/contention_sections.py ours e --steps 6
    DS_ACCELERATOR=cpu OMP_NUM_THREADS=1 /work/wt/dsvenv/bin/python -m torch.distributed.run --standalone \\
        --nproc_per_node 2 tools/bench/contention_sections.py deepspeed e --steps 6
"""
from __future__ import annotations

import argparse
import os
import resource
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import contention_worker as worker  # noqa: E402 - the bench's own model, data and contenders

PHASES = ("fwd", "bwd", "step")


def _now() -> tuple[float, float, float, int]:
    ru = resource.getrusage(resource.RUSAGE_SELF)
    return time.perf_counter(), ru.ru_utime, ru.ru_stime, ru.ru_minflt


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("contender", choices=("ours", "deepspeed", "torch"))
    ap.add_argument("config", choices=sorted(worker.CONFIGS))
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--nvme-path", default=None)
    ap.add_argument("--omp-waits", choices=("auto", "sleep", "spin"), default=None,
                    help="set torch's OpenMP waits first, as offload.initialize does ([Note: OpenMP waits]); for "
                         "plain torch too (our venv only). Default: as the contender leaves them (ours: auto)")
    args = ap.parse_args(argv)
    if args.omp_waits is not None:
        from offload.runtime.omp_wait import quiet_omp_waits
        quiet_omp_waits(mode=args.omp_waits)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    nvme = args.nvme_path or tempfile.mkdtemp(prefix="sections-")
    runner = worker.make(args.contender, args.config, nvme, world)
    data = worker.batches(rank, args.steps)
    rows, losses = [], []
    for s in range(args.steps):
        idx, tgt = data[s][:, :-1], data[s][:, 1:]
        marks = [_now()]
        loss = runner.forward(idx, tgt)
        marks.append(_now())
        runner.backward(loss)
        marks.append(_now())
        runner.step()
        marks.append(_now())
        rows.append([[b[k] - a[k] for k in range(4)] for a, b in zip(marks, marks[1:])])
        losses.append(float(loss.item()))
    later = rows[2:] or rows
    parts = []
    for p, name in enumerate(PHASES):
        wall, usr, sys_, flt = (statistics.median(r[p][k] for r in later) for k in range(4))
        parts.append(f"{name}: wall {wall:.3f} usr {usr:.3f} sys {sys_:.3f} faults {flt:.0f}")
    print(f"rank {rank} {args.contender} {args.config} load {'/'.join(f'{x:.2f}' for x in os.getloadavg())} :: "
          + " | ".join(parts) + f" :: losses {' '.join(f'{x:.6f}' for x in losses)}", flush=True)
    return 0


if __name__ == "__main__":
    rc = main()
    sys.stdout.flush()
    os._exit(rc)  # as the worker: gloo's and DeepSpeed's threads can hang the interpreter's teardown
