"""Where our step's time goes on a busy node: py-spy samples one contention_worker run under a load.

Runs ``py-spy record`` (a bench-time tool: ``pip install py-spy`` into the venv; not a dependency of
the project) on ``contention_worker.py ours CONFIG`` while bench_contention's load runs beside it,
and prints, from the collapsed stacks: samples per thread, the frames with the most self samples
(native frames included with ``--native``), and the inclusive samples of a few engine functions.
A sample is one thread seen at one instant (``--idle``: waiting threads too), every 1/rate s; without
``--native``, py-spy samples without stopping the process (``--nonblocking``), so the run is timed as usual.

Usage: flock /tmp/ofl-bench.lock .venv/bin/python tools/bench/profile_contention.py
           [--config c] [--load busy2] [--steps 8] [--rate 100] [--native] [--out FILE]
"""
from __future__ import annotations

import argparse
import collections
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from bench_contention import _load, start_load, stop_load  # noqa: E402

INCLUSIVE = ("forward (", "backward (", "step (", "grad_land", "_land (", "acquire (", "fetch (", "call_adam",
             "adam_step", "_copy_in", "on_grad", "_launch", "wait (", "futex", "gomp", "GOMP", "sched_yield",
             "do_spin", "gomp_team_barrier_wait", "ofl_parallel", "wait_for_call", "run_on_pool", "copy_")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="c")
    ap.add_argument("--load", default="busy2")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--rate", type=int, default=100)
    ap.add_argument("--native", action="store_true")
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    pyspy = shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")
    if not Path(pyspy).exists():
        raise SystemExit("py-spy not found: pip install py-spy into this venv")
    nvme = tempfile.mkdtemp(prefix="profile-contention-")
    raw = Path(nvme) / "stacks.txt"
    cmd = [pyspy, "record", "--rate", str(args.rate), "--format", "raw", "--threads", "--idle",
           "-o", str(raw)] + (["--native"] if args.native else ["--nonblocking"]) + \
          ["--", sys.executable, str(HERE / "contention_worker.py"), "ours", args.config, "--steps", str(args.steps),
           "--nvme-path", nvme]
    procs = start_load(args.load)
    load_before = _load()
    try:
        time.sleep(1.0 if procs else 0.0)
        r = subprocess.run(cmd, capture_output=True, text=True, env=dict(os.environ, PYTHONUNBUFFERED="1"))
    finally:
        stop_load(procs)
    result = next((ln for ln in r.stdout.splitlines() if ln.startswith("RESULT ")), None)
    if not raw.exists():
        raise SystemExit(f"py-spy wrote nothing: {r.stderr[-2000:]}")
    threads, self_, incl = collections.Counter(), collections.Counter(), collections.Counter()
    total = 0
    for line in raw.read_text().splitlines():
        stack, _, n = line.rpartition(" ")
        if not stack:
            continue
        n = int(n)
        frames = stack.split(";")
        total += n
        threads[frames[0]] += n
        self_[frames[-1]] += n
        seen = set()
        for key in INCLUSIVE:
            if any(key in f for f in frames[1:]) and key not in seen:
                seen.add(key)
                incl[key] += n
    shutil.rmtree(nvme, ignore_errors=True)
    lines = [f"# Profile: ours, config {args.config}, load {args.load}, {args.steps} steps, py-spy {args.rate} Hz"
             f"{' --native' if args.native else ''}", "",
             f"- command: `flock /tmp/ofl-bench.lock .venv/bin/python tools/bench/profile_contention.py "
             f"{' '.join(argv if argv is not None else sys.argv[1:])}`",
             f"- load average before {load_before}, after {_load()}; other work shared the machine",
             f"- samples (a thread seen, running or waiting): {total}", ""]
    if result:
        import json
        rows = json.loads(result[7:])["rows"][2:]
        med = lambda k: sorted(x[k] for x in rows)[len(rows) // 2]  # noqa: E731
        lines += [f"- worker's own step times (steps 3-{args.steps}, median): forward {med('fwd'):.2f} s, "
                  f"backward {med('bwd'):.2f} s, step {med('step'):.2f} s", ""]
    lines += ["## Samples per thread", "", "| thread | samples | share |", "| --- | --- | --- |"]
    lines += [f"| {t} | {n} | {n / total:.1%} |" for t, n in threads.most_common(12)]
    lines += ["", "## Self samples (top frames)", "", "| frame | samples | share |", "| --- | --- | --- |"]
    lines += [f"| `{f[:140]}` | {n} | {n / total:.1%} |" for f, n in self_.most_common(args.top)]
    lines += ["", "## Inclusive samples of chosen frames", "", "| frame contains | samples | share |",
              "| --- | --- | --- |"]
    lines += [f"| `{k}` | {n} | {n / total:.1%} |" for k, n in incl.most_common()]
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        Path(args.out).write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
