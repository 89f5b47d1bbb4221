"""How long `offload status` takes, start to answer, against the floor of any Python command.

Run under the shared lock (the machine is shared):

    flock /tmp/ofl-bench.lock .venv/bin/python tools/bench/bench_status.py [--rounds 9] [--regions 2000] \
        [--baseline-repo ../main]

Starts a daemon (a 256 MiB pool, one session holding ``--regions`` regions, so STATUS walks
something), then times, interleaved round by round, three fresh processes:

- ``python -c pass``: the interpreter's own start, the floor every CLI pays (the peer);
- ``python -m offload.cli status --socket S``: ours, the whole command;
- ``python -c "import torch"``: what `status` paid when its argument parser imported torch;
- with ``--baseline-repo DIR``, also `offload status` from another checkout (the code before a change).

Prints the medians and ours over the floor as a ratio.
"""
from __future__ import annotations

import argparse
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))


def _config(workdir: str) -> str:
    swap = os.path.join(workdir, "swap")
    os.makedirs(swap)
    path = os.path.join(workdir, "node.toml")
    Path(path).write_text(
        f'[server]\nsocket_path = "{workdir}/d.sock"\n[pool]\ncapacity_bytes = {256 << 20}\nsegment_bytes = {4 << 20}\n'
        f'[sessions]\ndefault_quota_bytes = {64 << 20}\n[swap]\npaths = ["{swap}"]\ncapacity_bytes = {256 << 20}\n'
        '[metrics]\naddress = ""\n')
    return path


def _timed(cmd: list[str], env: dict[str, str]) -> float:
    """Seconds ``cmd`` took, run in the checkout that ``env``'s PYTHONPATH names (``-m`` imports from the cwd first)."""
    t0 = time.perf_counter()
    subprocess.run(cmd, cwd=env["PYTHONPATH"], env=env, check=True, stdout=subprocess.DEVNULL)
    return time.perf_counter() - t0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--regions", type=int, default=2000)
    parser.add_argument("--baseline-repo", help="another checkout whose `offload status` is timed too")
    args = parser.parse_args()
    from daemon.client import TierClient, TierClientConfig, daemon_status
    from csrc.errors import DaemonNotRunningError

    workdir = tempfile.mkdtemp(prefix="ofl-bs-", dir="/tmp")
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    daemon = subprocess.Popen([sys.executable, "-m", "offload.cli", "daemon", "--config", _config(workdir),
                               "--log-level", "warning"], cwd=REPO, env=env)
    sock = os.path.join(workdir, "d.sock")
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                daemon_status(sock)
                break
            except (DaemonNotRunningError, OSError):
                if daemon.poll() is not None or time.monotonic() > deadline:
                    raise SystemExit("the daemon did not start")
                time.sleep(0.1)
        client = TierClient(TierClientConfig(socket_path=sock, job_id="bench", timeout_seconds=30,
                                             token_dir=workdir))
        for i in range(args.regions):
            client.allocate(f"r{i}", 4096)
        runs = {"python -c pass": [sys.executable, "-c", "pass"],
                "offload status": [sys.executable, "-m", "offload.cli", "status", "--socket", sock],
                "python -c 'import torch'": [sys.executable, "-c", "import torch"]}
        envs = {name: env for name in runs}
        if args.baseline_repo:
            name = f"offload status ({args.baseline_repo})"
            runs[name] = runs["offload status"]
            envs[name] = {**env, "PYTHONPATH": os.path.abspath(args.baseline_repo)}
        times: dict[str, list[float]] = {name: [] for name in runs}
        for _ in range(args.rounds):
            for name, cmd in runs.items():
                times[name].append(_timed(cmd, envs[name]))
        client.close()
    finally:
        daemon.send_signal(signal.SIGTERM)
        daemon.wait(60)
        shutil.rmtree(workdir, ignore_errors=True)
    med = {name: statistics.median(t) for name, t in times.items()}
    print(f"load {open('/proc/loadavg').read().split()[:3]}, {args.rounds} rounds, {args.regions} regions in 1 session")
    print("| command | median s | min s | max s |\n|---|---:|---:|---:|")
    for name, t in times.items():
        print(f"| `{name}` | {med[name]:.3f} | {min(t):.3f} | {max(t):.3f} |")
    print(f"\nours / floor (offload status / python -c pass): {med['offload status'] / med['python -c pass']:.2f}x")
    if args.baseline_repo:
        base = med[f"offload status ({args.baseline_repo})"]
        print(f"baseline / ours: {base / med['offload status']:.1f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
