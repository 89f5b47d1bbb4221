"""The undo-logged Adam pass ([Note: undo log] in csrc/adam_undo.c): bit for bit ``adam_step``'s
results, and a process SIGKILLed inside the pass (a forked child, its tensors and log in shared
memory) is finished by a second call with ``resume=True``, bit-equal to a pass never killed."""
from __future__ import annotations

import errno
import mmap
import os

import pytest
import torch

from cpu_adam import AdamConfig, adam_step, available_isas
from cpu_adam.undo import UndoLog, arm_fault_for_tests, undo_bytes

SIZES = [70000, 3, 100001, 0, 4099, 65536, 17]  # chunks cut inside tensors, tensors inside chunks
CALLS = [SIZES[:3], SIZES[3:]]  # a pass of two calls (two param groups of a sub-group)


def _states(sizes, seed, grad_dtype):
    g = torch.Generator().manual_seed(seed)
    return ([torch.randn(n, generator=g) for n in sizes],
            [torch.randn(n, generator=g).to(grad_dtype) for n in sizes],
            [torch.randn(n, generator=g) * 0.1 for n in sizes],
            [torch.rand(n, generator=g) * 0.01 for n in sizes])


def _shared(tensors):
    """Copies of ``tensors`` (fp32) in one MAP_SHARED mapping: what a forked child writes, we see."""
    total = sum(t.numel() for t in tensors)
    buf = mmap.mmap(-1, max(4, 4 * total))
    flat = torch.frombuffer(buf, dtype=torch.float32, count=total)
    out, at = [], 0
    for t in tensors:
        out.append(flat[at:at + t.numel()])
        out[-1].copy_(t)
        at += t.numel()
    return out, buf


def _steps(n, value=4.0):
    return [torch.full((1,), value) for _ in range(n)]  # one element: no OpenMP


def _reference(calls, config, grad_dtype, out_dtype):
    done = []
    for c, sizes in enumerate(calls):
        p, g, m, v = _states(sizes, c, grad_dtype)
        outs = [torch.empty(n, dtype=out_dtype) for n in sizes] if out_dtype else None
        adam_step(p, g, m, v, _steps(len(sizes)), config=config, grad_scale=0.25, params_out=outs)
        done.append((p, m, v))
    return done


def _log(calls, slots):
    size = undo_bytes(slots, max(sum(s) for s in calls))
    buf = mmap.mmap(-1, size)
    return UndoLog(buf, fresh=True, slots=slots, max_elems=max(sum(s) for s in calls)), buf


def _grads(calls, grad_dtype):
    return [_states(sizes, c, grad_dtype)[1] for c, sizes in enumerate(calls)]


def _pass(log, calls, tensors, config, grads, out_dtype, *, resume):
    """The pass; no torch op but the kernels' (a forked child must not enter torch's OpenMP)."""
    restored = 0
    for c, sizes in enumerate(calls):
        g = grads[c]
        p, m, v = tensors[c]
        outs = [torch.empty(n, dtype=out_dtype) for n in sizes] if out_dtype else None  # never in a child
        restored += log.step(p, g, m, v, _steps(len(sizes)), config=config, call=c, resume=resume, grad_scale=0.25,
                             params_out=outs)
    return restored


def _equal(tensors, ref):
    return all(torch.equal(a, b) for got, want in zip(tensors, ref) for xs, ys in zip(got, want) for a, b in zip(xs, ys))


@pytest.mark.parametrize("isa", [i.name.lower() for i in available_isas()])
@pytest.mark.parametrize("grad_dtype,out_dtype,threads", [(torch.float32, None, 1), (torch.bfloat16, torch.bfloat16, 2),
                                                          (torch.float16, torch.float16, 3)])
def test_logged_pass_equals_adam_step(isa, grad_dtype, out_dtype, threads):
    config = AdamConfig(lr=1e-3, weight_decay=0.01, num_threads=threads, isa=isa)
    ref = _reference(CALLS, config, grad_dtype, out_dtype)
    tensors = [[t for t in _states(s, c, grad_dtype)[i]] for c, s in enumerate(CALLS) for i in (0, 2, 3)]
    tensors = [tensors[3 * c:3 * c + 3] for c in range(len(CALLS))]
    log, _ = _log(CALLS, threads)
    log.begin()
    assert _pass(log, CALLS, tensors, config, _grads(CALLS, grad_dtype), out_dtype, resume=False) == 0
    assert _equal(tensors, ref)


def _killed_then_resumed(config, grad_dtype, faults, slots):
    """A child runs the pass and dies at each fault in turn (the first in the pass, then in its
    resume, ...); then this process resumes it. Returns the tensors and the pieces restored."""
    tensors, keep = [], []
    for c, sizes in enumerate(CALLS):
        p, _, m, v = _states(sizes, c, grad_dtype)
        shared = []
        for ts in (p, m, v):
            out, buf = _shared(ts)
            shared.append(out)
            keep.append(buf)
        tensors.append(shared)
    log, keep_log = _log(CALLS, slots)
    log.begin()
    grads = _grads(CALLS, grad_dtype)
    restored_in_children = 0
    for k, fault in enumerate(faults):
        pid = os.fork()
        if pid == 0:  # the trainer: dies inside the pass (its first run, or a resume of it)
            arm_fault_for_tests(*fault)
            _pass(log, CALLS, tensors, config, grads, None, resume=k > 0)
            os._exit(0)
        _, status = os.waitpid(pid, 0)
        assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == 9, f"fault {fault} did not fire"
    restored = _pass(log, CALLS, tensors, config, grads, None, resume=True)
    return tensors, restored + restored_in_children, keep, keep_log


# AVX-512 journals vector by vector inside the kernel, the others copy the old values ahead of it
FORMS = [i.name.lower() for i in available_isas() if i.name in ("SCALAR", "AVX512_BF16", "AVX512")][:2]


@pytest.mark.parametrize("isa", FORMS)
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("fault", [(0, 0, 0), (0, 1, 4464), (0, 2, 30000), (1, 0, 12000), (1, 1, 0)])
def test_killed_inside_the_pass_is_finished_exactly(threads, fault, isa):
    config = AdamConfig(lr=1e-3, weight_decay=0.01, num_threads=threads, isa=isa)
    ref = _reference(CALLS, config, torch.bfloat16, None)
    tensors, restored, *_ = _killed_then_resumed(config, torch.bfloat16, [fault], threads)
    assert restored >= 1  # the piece the kill cut in half was put back (old values, or the new ones redone)
    assert _equal(tensors, ref)


@pytest.mark.parametrize("isa", FORMS)
def test_killed_again_in_the_resume_is_finished_exactly(isa):
    config = AdamConfig(lr=1e-3, num_threads=2, isa=isa)
    ref = _reference(CALLS, config, torch.float32, None)
    tensors, restored, *_ = _killed_then_resumed(config, torch.float32, [(0, 2, 20000), (0, 2, 24096)], 2)
    assert _equal(tensors, ref)


def test_a_log_of_fewer_threads_runs_on_fewer_threads():
    config = AdamConfig(lr=1e-3, num_threads=4)
    ref = _reference(CALLS, config, torch.float32, None)
    tensors, restored, *_ = _killed_then_resumed(config, torch.float32, [(0, 1, 100)], 1)
    assert restored == 1 and _equal(tensors, ref)


def test_bad_logs_are_refused():
    small, _ = _log([[10]], 1)
    small.begin()
    big = _states([8 * 65536 + 1], 0, torch.float32)  # the map has room for 8 chunks
    with pytest.raises(OSError) as err:
        small.step(*big, _steps(1), config=AdamConfig(), call=0)
    assert err.value.errno == errno.E2BIG  # more elements than the log was made for
    p, g, m, v = _states([100], 0, torch.float32)
    raw = mmap.mmap(-1, undo_bytes(1, 100))
    with pytest.raises(OSError) as err:
        UndoLog(raw, fresh=False).step(p, g, m, v, _steps(1), config=AdamConfig(), call=0)
    assert err.value.errno == errno.EINVAL  # not a log
    log, _ = _log([[100]], 1)
    log.begin()
    with pytest.raises(OSError) as err:
        log.step(p, g, m, v, _steps(1), config=AdamConfig(), call=1, resume=True)
    assert err.value.errno == errno.EINVAL  # a resumed call after the one in flight
