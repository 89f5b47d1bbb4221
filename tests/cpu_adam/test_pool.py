"""Where the kernels' threads come from: the OpenMP team and the own pool give the same bits, from
concurrent callers, in a forked child and on busy CPUs ([Note: one thread team] in csrc/ofl_parallel.h)."""
from __future__ import annotations

import os
import subprocess
import sys
import threading
import time

import pytest
import torch

from cpu_adam import AdamConfig, adam_step, available_isas, grad_sumsq, set_thread_source, team_stats
from cpu_adam.threads import team_found

needs_team = pytest.mark.skipif(not team_found(), reason="no single libgomp in this process: every call uses the pool")

SIZES = [70001, 3, 200003, 131072]  # > 2 chunks of 65,536: every call uses the pool


def _state(seed):
    gen = torch.Generator().manual_seed(seed)
    params = [torch.randn(n, generator=gen) for n in SIZES]
    grads = [[torch.randn(n, generator=gen).to(torch.bfloat16) for n in SIZES] for _ in range(4)]
    return params, [torch.zeros(n) for n in SIZES], [torch.zeros(n) for n in SIZES], grads


def _run(seed, threads, isa=None):
    """Four steps with bf16 grads and a bf16 copy; returns every result and the grad norms."""
    params, ms, vs, grads = _state(seed)
    steps = [torch.zeros(()) for _ in SIZES]
    outs = [torch.empty(n, dtype=torch.bfloat16) for n in SIZES]
    config = AdamConfig(num_threads=threads, weight_decay=0.1, isa=isa)
    norms = []
    for g in grads:
        norms.append(grad_sumsq(g, num_threads=threads, isa=isa))
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


@pytest.fixture
def source():
    """Sets the thread source for one test and puts the default back."""
    yield set_thread_source
    set_thread_source("team")


@pytest.mark.parametrize("isa", available_isas(), ids=lambda isa: isa.name.lower())
def test_team_and_pool_give_the_bits_of_one_thread(isa, source):
    expected = _run(6, 1, isa)
    for where in ("team", "pool"):
        source(where)
        before = team_stats().calls
        for threads in (2, 3, 7):
            assert _same(_run(6, threads, isa), expected), (where, threads)
        ran_on_team = team_stats().calls - before
        if where == "pool":
            assert ran_on_team == 0
        elif team_found():
            assert ran_on_team == 3 * 4 * 2  # every call of the three runs: 4 sumsq + 4 steps each


@needs_team
def test_calls_from_other_threads_use_the_pool():
    before = team_stats().calls
    result = []
    thread = threading.Thread(target=lambda: result.append(_run(7, 2)))
    thread.start()
    thread.join(timeout=120)
    assert team_stats().calls == before
    assert result and _same(result[0], _run(7, 1))
    assert _same(_run(7, 2), result[0]) and team_stats().calls == before + 8  # the main thread's: on the team


@needs_team
def test_a_team_smaller_than_the_call_runs_every_share():
    # OMP_THREAD_LIMIT caps libgomp's team below the call's count: members must take every
    # share, not one each.
    code = ("import sys; sys.path.insert(0, %r)\n"
            "from tests.cpu_adam.test_pool import _run, _same\n"
            "from cpu_adam import team_stats\n"
            "assert _same(_run(8, 7), _run(8, 1)) and team_stats().calls == 8, team_stats()\n")
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = dict(os.environ, OMP_THREAD_LIMIT="2", OFFLOAD_CPU_ADAM_THREADS="team")
    done = subprocess.run([sys.executable, "-c", code % root], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]


def test_forked_child_makes_its_own_pool():
    expected = _run(4, 1)
    assert _same(_run(4, 2), expected)  # the parent's pool now has a worker, or its team ran the call
    pid = os.fork()
    if pid == 0:  # the child: the parent's workers (ours and libgomp's) do not exist here
        ok = False
        try:
            torch.set_num_threads(1)  # torch's own OpenMP pool hangs in a forked child
            calls = team_stats().calls
            ok = _same(_run(4, 2), expected) and _same(_run(4, 3), expected) and team_stats().calls == calls
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
