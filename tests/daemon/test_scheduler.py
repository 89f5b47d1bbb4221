"""daemon.scheduler: deficit round robin by bytes, prefetch first, per-session order."""
from __future__ import annotations

import asyncio

import pytest

from csrc.errors import OffloadError, SessionError
from daemon.config import SchedulerConfig
from daemon.scheduler import FairScheduler, JobClass


def _recorder(log, tag, seconds=0.0):
    async def run():
        log.append(tag)
        await asyncio.sleep(seconds)
    return run


def test_equal_demand_moves_equal_bytes_whatever_the_request_size():
    async def main():
        sched = FairScheduler(SchedulerConfig(max_inflight_jobs=1, quantum_bytes=1 << 20))
        log = []
        futs = []
        # Session "small" sends 1 MiB jobs, "big" sends 4 MiB jobs; both queue 16 MiB.
        for i in range(16):
            futs.append(sched.submit("small", JobClass.PREFETCH, 1 << 20, _recorder(log, ("small", 1 << 20))))
        for i in range(4):
            futs.append(sched.submit("big", JobClass.PREFETCH, 4 << 20, _recorder(log, ("big", 4 << 20))))
        await asyncio.wait_for(asyncio.gather(*futs), 10)
        # Over every prefix, the bytes served differ by at most one big job plus a quantum.
        served = {"small": 0, "big": 0}
        for who, n in log:
            served[who] += n
            if served["small"] < 16 << 20 and served["big"] < 16 << 20:
                assert abs(served["small"] - served["big"]) <= (4 << 20) + (1 << 20)
        assert sched.served_bytes == {"small": 16 << 20, "big": 16 << 20}
    asyncio.run(main())


def test_prefetches_go_before_writebacks():
    async def main():
        sched = FairScheduler(SchedulerConfig(max_inflight_jobs=1, quantum_bytes=1 << 20))
        log = []
        gate = asyncio.Event()

        async def blocker():
            await gate.wait()
        first = sched.submit("x", JobClass.WRITEBACK, 1, blocker)  # occupies the only slot
        futs = [sched.submit(f"w{i}", JobClass.WRITEBACK, 1 << 20, _recorder(log, f"w{i}")) for i in range(3)]
        futs += [sched.submit(f"p{i}", JobClass.PREFETCH, 1 << 20, _recorder(log, f"p{i}")) for i in range(3)]
        assert sched.depth(JobClass.PREFETCH) == 3 and sched.depth(JobClass.WRITEBACK) == 3
        gate.set()
        await asyncio.wait_for(asyncio.gather(first, *futs), 10)
        assert log[:3] == ["p0", "p1", "p2"] and sorted(log[3:]) == ["w0", "w1", "w2"]
    asyncio.run(main())


def test_one_session_runs_in_order_and_one_at_a_time():
    async def main():
        sched = FairScheduler(SchedulerConfig(max_inflight_jobs=4, quantum_bytes=1 << 20))
        log = []
        running = {"n": 0, "max": 0}

        def job(tag):
            async def run():
                running["n"] += 1
                running["max"] = max(running["max"], running["n"])
                log.append(tag)
                await asyncio.sleep(0.001)
                running["n"] -= 1
            return run
        futs = [sched.submit("s", JobClass.WRITEBACK if i % 2 else JobClass.PREFETCH, 100, job(i)) for i in range(10)]
        await asyncio.wait_for(asyncio.gather(*futs), 10)
        assert log == list(range(10)) and running["max"] == 1
    asyncio.run(main())


def test_sessions_overlap_up_to_the_limit():
    async def main():
        sched = FairScheduler(SchedulerConfig(max_inflight_jobs=2, quantum_bytes=1 << 20))
        futs = [sched.submit(f"s{i}", JobClass.PREFETCH, 10, _recorder([], i, 0.05)) for i in range(4)]
        await asyncio.sleep(0.01)
        assert sched.inflight == 2
        await asyncio.wait_for(asyncio.gather(*futs), 10)
    asyncio.run(main())


def test_errors_reach_the_waiter_and_forget_fails_queued_jobs():
    async def main():
        sched = FairScheduler(SchedulerConfig(max_inflight_jobs=1, quantum_bytes=1 << 20))

        async def boom():
            raise OSError(28, "No space left on device")
        with pytest.raises(OSError, match="No space"):
            await asyncio.wait_for(sched.submit("a", JobClass.WRITEBACK, 1, boom), 5)
        gate = asyncio.Event()

        async def blocker():
            await gate.wait()
        running = sched.submit("a", JobClass.PREFETCH, 1, blocker)
        queued = sched.submit("a", JobClass.PREFETCH, 1, blocker)
        forget = asyncio.ensure_future(sched.forget("a"))
        await asyncio.sleep(0.01)
        assert not forget.done()  # waits for the running job
        gate.set()
        await asyncio.wait_for(forget, 5)
        await running
        with pytest.raises(SessionError):
            await queued
    asyncio.run(main())


def test_drain_finishes_work_and_refuses_new():
    async def main():
        sched = FairScheduler(SchedulerConfig(max_inflight_jobs=1, quantum_bytes=1 << 20))
        log = []
        futs = [sched.submit("a", JobClass.PREFETCH, 1, _recorder(log, i, 0.01)) for i in range(5)]
        assert await sched.drain(10.0)
        assert log == [0, 1, 2, 3, 4] and all(f.done() for f in futs)
        with pytest.raises(OffloadError, match="shutting down"):
            sched.submit("a", JobClass.PREFETCH, 1, _recorder(log, 9))
    asyncio.run(main())


def test_a_session_overlaps_disjoint_jobs_but_never_conflicting_ones():
    async def main():
        sched = FairScheduler(SchedulerConfig(max_inflight_jobs=8, max_inflight_jobs_per_session=2,
                                              quantum_bytes=1 << 20))
        active: set[str] = set()
        overlaps = []

        def job(tag, names):
            async def run():
                clash = [a for a in active if set(a.split("+")) & set(names)]
                assert not clash, (tag, clash)
                overlaps.append(len(active))
                key = "+".join(names)
                active.add(key)
                await asyncio.sleep(0.01)
                active.discard(key)
            return run
        plan = [("p0", ["a"]), ("p1", ["b"]), ("e0", ["a"]), ("p2", ["c"]), ("e1", ["b"]), ("p3", ["a"])]
        futs = [sched.submit("s", JobClass.PREFETCH, 1, job(t, n), n) for t, n in plan]
        flush = sched.submit("s", JobClass.WRITEBACK, 1, job("flush", ["a", "b", "c"]), None)
        await asyncio.wait_for(asyncio.gather(*futs, flush), 10)
        assert max(overlaps) == 1  # two at a time, never more than the per-session limit
    asyncio.run(main())
