"""Contention bench: our engine against DeepSpeed and plain torch on the ~98M GPT, on a quiet and a busy node.

Configs (contention_worker.CONFIGS): a stage 2 optimizer cpu, b stage 2 optimizer nvme, c stage 3
params+optimizer cpu, d stage 3 params+optimizer nvme, e config a on 2 ranks (torchrun, gloo,
OMP_NUM_THREADS=1). Contenders: ours (this tree's .venv), DeepSpeed (its own virtual environment,
``--ds-python``, DS_ACCELERATOR=cpu; skipped with the reason where it cannot be imported) and plain
torch (AdamW, clip_grad_norm_). The same model init (seed 0), data and hyperparameters for all three.

Loads, each started before a cell's contenders and stopped after, at this process's priority:
  quiet    nothing added (the machine's own background stays: the load average is printed)
  busyN    N processes each spinning a Python busy loop
  membw    one process copying a 256 MiB buffer into another in a loop (a memory-bandwidth hog)
Every (load, config) cell runs its contenders alternately, ``--rounds`` times with the order
rotated, each run a fresh process of ``--steps`` steps; a run's figure is the median of its steps
3..steps. Reported per cell: forward / backward / step and total medians over the rounds' runs, each
contender's loaded/quiet factor (its total under the load over its total quiet, same run), the paired
ratio ours/DeepSpeed (median over rounds of the two runs' ratio), the load average beside every
figure, bytes read from storage per step, and the largest relative loss difference against torch.

A fourth contender, ``base``, is our engine from another tree (``--baseline DIR``: main before a change),
so that before and after are measured in the same run, alternately.

Usage: flock /tmp/ofl-bench.lock .venv/bin/python tools/bench/bench_contention.py
           [--configs a,b,c,d,e] [--loads quiet,busy2,membw] [--contenders ours,deepspeed,torch[,base]]
           [--baseline DIR]
           [--rounds 2] [--steps 8] [--ds-python /work/wt/dsvenv/bin/python] [--nvme-path DIR] [--out FILE]
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
WORKER = HERE / "contention_worker.py"
DEFAULT_DS_PYTHON = "/work/wt/dsvenv/bin/python"
BUSY = "while True: pass"
MEMBW = ("a = bytearray(256 << 20)\nb = bytearray(256 << 20)\nm = memoryview(b)\n"
         "while True:\n    m[:] = a\n")


def _load() -> str:
    return "/".join(f"{x:.2f}" for x in os.getloadavg())


def start_load(name: str) -> list[subprocess.Popen]:
    if name == "quiet":
        return []
    if name.startswith("busy"):
        n = int(name[4:] or 1)
        return [subprocess.Popen([sys.executable, "-c", BUSY]) for _ in range(n)]
    if name == "membw":
        return [subprocess.Popen([sys.executable, "-c", MEMBW])]
    raise SystemExit(f"unknown load {name!r}: quiet, busyN or membw")


def stop_load(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        p.kill()
    for p in procs:
        p.wait()


def ds_available(python: str) -> str | None:
    """None when DeepSpeed imports in ``python``; else why not."""
    if not Path(python).exists():
        return f"no interpreter at {python} (make the venv: see the module doc)"
    env = dict(os.environ, DS_ACCELERATOR="cpu")
    r = subprocess.run([python, "-c", "import deepspeed; print(deepspeed.__version__)"], capture_output=True,
                       text=True, env=env, timeout=300)
    if r.returncode != 0:
        return "deepspeed does not import: " + (r.stderr.strip().splitlines() or ["?"])[-1]
    return None


def run_one(contender: str, config: str, args, nvme_root: str) -> dict:
    python = args.ds_python if contender == "deepspeed" else sys.executable
    nvme = tempfile.mkdtemp(prefix=f"contention-{contender}-{config}-", dir=nvme_root)
    env = dict(os.environ, DS_ACCELERATOR="cpu", PYTHONUNBUFFERED="1")
    worker, what = WORKER, contender
    if contender == "base":  # our engine as another tree has it (its worker puts that tree first on the path)
        worker, what = Path(args.baseline) / "tools" / "bench" / WORKER.name, "ours"
    if contender != "ours":
        env["PYTHONPATH"] = str(worker.parents[2])
    cmd = [python, str(worker), what, config, "--steps", str(args.steps), "--nvme-path", nvme]
    if config == "e":
        env["OMP_NUM_THREADS"] = "1"
        cmd = [python, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"] + cmd[1:]
    load_before = _load()
    t0 = time.perf_counter()
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=args.timeout, cwd=str(ROOT))
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {args.timeout} s", "load": load_before}
    finally:
        shutil.rmtree(nvme, ignore_errors=True)
    wall = time.perf_counter() - t0
    for line in r.stdout.splitlines():
        if line.startswith("RESULT "):
            out = json.loads(line[7:])
            out.update(load=load_before, load_after=_load(), wall_s=wall)
            return out
    tail = (r.stderr.strip().splitlines() or r.stdout.strip().splitlines() or ["?"])[-3:]
    return {"error": f"exit {r.returncode}: " + " | ".join(tail), "load": load_before}


def summarise(out: dict) -> dict:
    rows = out["rows"][2:]  # steps 3..N
    med = {k: statistics.median(r[k] for r in rows) for k in ("fwd", "bwd", "step")}
    med["total"] = statistics.median(r["fwd"] + r["bwd"] + r["step"] for r in rows)
    med["read_gib"] = statistics.median(r["read_bytes"] for r in rows) / 2 ** 30
    return med


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--configs", default="a,b,c,d,e")
    ap.add_argument("--loads", default="quiet,busy2,membw")
    ap.add_argument("--contenders", default="ours,deepspeed,torch")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--steps", type=int, default=8, help="per run; the median is over steps 3..steps")
    ap.add_argument("--ds-python", default=DEFAULT_DS_PYTHON)
    ap.add_argument("--baseline", default=None,
                    help="a tree of this project (e.g. `git archive main`, its csrc/*.so copied in, "
                         "contention_worker.py copied to its tools/bench/): contender `base` runs our engine from there")
    ap.add_argument("--nvme-path", default=None, help="directory for swap files (default: a temporary one)")
    ap.add_argument("--timeout", type=int, default=900, help="seconds per run")
    ap.add_argument("--out", default=None, help="write the markdown report here too")
    args = ap.parse_args(argv)
    if args.steps < 4:
        ap.error("--steps must be >= 4 (the median is over steps 3..steps)")
    configs = args.configs.split(",")
    loads = args.loads.split(",")
    contenders = args.contenders.split(",")
    skipped = {}
    if "base" in contenders and not args.baseline:
        ap.error("contender base needs --baseline DIR")
    if "deepspeed" in contenders:
        why = ds_available(args.ds_python)
        if why:
            skipped["deepspeed"] = why
            contenders.remove("deepspeed")
            print(f"DeepSpeed skipped: {why}", flush=True)
    started = datetime.datetime.now(datetime.timezone.utc)
    nvme_root = tempfile.mkdtemp(prefix="bench-contention-", dir=args.nvme_path)
    results: dict[tuple[str, str, str], list[dict]] = {}
    ratio_rounds: dict[tuple[str, str], list[float]] = {}
    try:
        for r in range(args.rounds):
            for load in loads:
                procs = start_load(load)
                try:
                    time.sleep(1.0 if procs else 0.0)
                    for config in configs:
                        k = (r + configs.index(config)) % len(contenders)
                        order = contenders[k:] + contenders[:k]
                        got = {}
                        for c in order:
                            out = run_one(c, config, args, nvme_root)
                            results.setdefault((load, config, c), []).append(out)
                            if "error" in out:
                                print(f"round {r + 1} {load} {config} {c}: {out['error']} (load {out['load']})",
                                      flush=True)
                                continue
                            s = summarise(out)
                            got[c] = s["total"]
                            print(f"round {r + 1} {load:6s} {config} {c:9s} {s['total']:.3f} s "
                                  f"({s['fwd']:.2f}/{s['bwd']:.2f}/{s['step']:.2f}) load {out['load']}", flush=True)
                        for mine in ("ours", "base"):
                            if mine in got and "deepspeed" in got:
                                ratio_rounds.setdefault((load, config, mine), []).append(got[mine] / got["deepspeed"])
                finally:
                    stop_load(procs)
    finally:
        shutil.rmtree(nvme_root, ignore_errors=True)
    report(args, argv, configs, loads, contenders, skipped, results, ratio_rounds, started)
    return 0


def _med(xs):
    return statistics.median(xs) if xs else float("nan")


def report(args, argv, configs, loads, contenders, skipped, results, ratio_rounds, started) -> None:
    cmd = ["flock /tmp/ofl-bench.lock .venv/bin/python tools/bench/bench_contention.py"] + \
        (argv if argv is not None else sys.argv[1:])
    lines = [f"# Contention bench: ~98M GPT, ours vs DeepSpeed vs torch, {started:%Y-%m-%d %H:%M} UTC", "",
             f"- machine: {platform.node()}, {os.cpu_count()} CPUs (affinity {len(os.sched_getaffinity(0))}); "
             f"load average at the end {_load()}",
             f"- command: `{' '.join(cmd)}`",
             f"- {args.rounds} rounds, {args.steps} steps per run (median of steps 3-{args.steps}), contenders "
             "alternated with the order rotated; times are medians over the rounds' runs, in seconds: total "
             "(forward / backward / step); `load` is the 1/5/15-min load average when the run started",
             "- loaded/quiet: the contender's total under the load over its own quiet total in this run; "
             "ours/DS: median over rounds of the paired ratio"]
    for c, why in skipped.items():
        lines.append(f"- {c} skipped: {why}")
    lines += ["", "| load | config | " + " | ".join(f"{c} s | {c} loaded/quiet" for c in contenders)
              + " | ours/DS | base/DS | read GiB/step | loss drift vs " + ("torch" if "torch" in contenders else "deepspeed")
              + " (largest relative difference over the steps) | load avg |",
              "| --- | --- | " + " | ".join("--- | ---" for _ in contenders) + " | --- | --- | --- | --- | --- |"]
    for load in loads:
        for config in configs:
            cells, reads, drifts, lavg = [], [], [], []
            ref_name = "torch" if "torch" in contenders else "deepspeed"
            torch_losses = [o["rows"] for o in results.get((load, config, ref_name), []) if "error" not in o]
            for c in contenders:
                outs = [o for o in results.get((load, config, c), []) if "error" not in o]
                errs = [o["error"] for o in results.get((load, config, c), []) if "error" in o]
                if not outs:
                    cells += [f"failed: {errs[0][:80] if errs else '?'}", ""]
                    continue
                sums = [summarise(o) for o in outs]
                tot = _med([s["total"] for s in sums])
                quiet = [summarise(o)["total"] for o in results.get(("quiet", config, c), []) if "error" not in o]
                factor = f"{tot / _med(quiet):.2f}x" if quiet and load != "quiet" else ""
                cells += [f"{tot:.2f} ({_med([s['fwd'] for s in sums]):.2f} / {_med([s['bwd'] for s in sums]):.2f}"
                          f" / {_med([s['step'] for s in sums]):.2f})", factor]
                lavg += [o["load"] for o in outs]
                if c in ("ours", "base", "deepspeed"):
                    reads.append(f"{c} {_med([s['read_gib'] for s in sums]):.2f}")
                    if torch_losses and c != ref_name:
                        ref = [r["loss"] for r in torch_losses[0]]
                        d = max(abs(r["loss"] - x) / abs(x) for o in outs for r, x in zip(o["rows"], ref))
                        drifts.append(f"{c} {d:.1e}")
            ratios = ["**%.2fx**" % _med(ratio_rounds[(load, config, m)]) if (load, config, m) in ratio_rounds else ""
                      for m in ("ours", "base")]
            lines.append(f"| {load} | {config} | " + " | ".join(cells) + f" | {' | '.join(ratios)}"
                         f" | {', '.join(reads)} | {', '.join(drifts)} | {'; '.join(lavg)} |")
    lines += ["", "Losses, first run of each (step 1..N):"]
    for config in configs:
        for c in contenders:
            outs = [o for load in loads for o in results.get((load, config, c), []) if "error" not in o]
            if outs:
                lines.append(f"- {config} {c}: " + " ".join(f"{r['loss']:.6f}" for r in outs[0]["rows"]))
    text = "\n".join(lines) + "\n"
    print(text, flush=True)
    if args.out:
        Path(args.out).write_text(text)


if __name__ == "__main__":
    sys.exit(main())
