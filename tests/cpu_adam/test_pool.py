"""The kernels' worker pool: the same bits from concurrent callers and in a forked child."""
from __future__ import annotations

import os
import subprocess
import sys
import threading
import time

import torch

from cpu_adam import AdamConfig, adam_step, grad_sumsq

SIZES = [70001, 3, 200003, 131072]  # > 2 chunks of 65,536: every call uses the pool


def _state(seed):
    gen = torch.Generator().manual_seed(seed)
    params = [torch.randn(n, generator=gen) for n in SIZES]
    grads = [[torch.randn(n, generator=gen).to(torch.bfloat16) for n in SIZES] for _ in range(4)]
    return params, [torch.zeros(n) for n in SIZES], [torch.zeros(n) for n in SIZES], grads


def _run(seed, threads):
    """Four steps with bf16 grads and a bf16 copy; returns every result and the grad norms."""
    params, ms, vs, grads = _state(seed)
    steps = [torch.zeros(()) for _ in SIZES]
    outs = [torch.empty(n, dtype=torch.bfloat16) for n in SIZES]
    config = AdamConfig(num_threads=threads, weight_decay=0.1)
    norms = []
    for g in grads:
        norms.append(grad_sumsq(g, num_threads=threads))
        adam_step(params, g, ms, vs, steps, config=config, grad_scale=0.5, params_out=outs)
    return torch.cat(params + ms + vs), torch.cat(outs), norms


def _same(a, b):
    return torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) and a[2] == b[2]


def test_concurrent_callers_get_the_bits_of_a_lone_caller():
    # While one call holds the pool, the other runs on threads of its own: both paths
    # must give what a single thread gives.
    expected = {seed: _run(seed, 1) for seed in (1, 2, 3)}
    got: dict[int, list] = {seed: [] for seed in expected}

    def worker(seed):
        for _ in range(3):
            got[seed].append(_run(seed, 2))

    threads = [threading.Thread(target=worker, args=(seed,)) for seed in expected]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not any(t.is_alive() for t in threads)
    for seed, runs in got.items():
        assert len(runs) == 3 and all(_same(run, expected[seed]) for run in runs)


def test_forked_child_makes_its_own_pool():
    expected = _run(4, 1)
    assert _same(_run(4, 2), expected)  # the parent's pool now has a worker
    pid = os.fork()
    if pid == 0:  # the child: the parent's worker does not exist here
        ok = False
        try:
            torch.set_num_threads(1)  # torch's own OpenMP pool hangs in a forked child
            ok = _same(_run(4, 2), expected) and _same(_run(4, 3), expected)
        finally:
            os._exit(0 if ok else 1)
    deadline = time.monotonic() + 120
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        if time.monotonic() > deadline:
            os.kill(pid, 9)
            os.waitpid(pid, 0)
            raise AssertionError("the forked child hung in the kernels' pool")
        time.sleep(0.05)
    assert os.waitstatus_to_exitcode(status) == 0
    assert _same(_run(4, 2), expected)  # and the parent's pool still works


def test_busy_cpus_make_late_workers_not_other_bits():
    # Processes that keep every CPU busy make workers start late; the caller takes
    # back the ones that have not started ([Note: late workers]) and runs their shares:
    # what it computes must not change.
    expected = _run(5, 1)
    spin = "import time\nend = time.monotonic() + 30\nwhile time.monotonic() < end: pass\n"
    busy = [subprocess.Popen([sys.executable, "-c", spin]) for _ in range(os.cpu_count() or 1)]
    try:
        time.sleep(0.2)
        for _ in range(3):
            assert _same(_run(5, 2), expected) and _same(_run(5, 4), expected)
    finally:
        for p in busy:
            p.kill()
            p.wait()
