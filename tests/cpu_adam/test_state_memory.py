"""Adam state on huge pages: zeros of the param's shape, owned by the tensor, on 2 MiB pages where THP allows."""
from __future__ import annotations

import gc
from pathlib import Path

import pytest
import torch

from cpu_adam import CPUAdam
from cpu_adam.state_memory import HUGE_MIN_BYTES, zeros_state_like


def _anon_huge_kib() -> int:
    for line in Path("/proc/self/smaps_rollup").read_text().splitlines():
        if line.startswith("AnonHugePages:"):
            return int(line.split()[1])
    return 0


def _thp_mode() -> str:
    try:
        text = Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text()
    except OSError:
        return "never"
    return text[text.index("[") + 1:text.index("]")]


@pytest.mark.parametrize("shape", [(3,), (1000, 7), (HUGE_MIN_BYTES // 4 + 5,), (640, 9000)])
def test_state_is_what_zeros_like_gives(shape):
    param = torch.randn(shape)
    state = zeros_state_like(param)
    assert state.shape == param.shape and state.dtype == torch.float32 and state.is_contiguous()
    assert torch.equal(state, torch.zeros_like(param))
    gc.collect()  # the tensor alone keeps its memory alive
    state.add_(2.0)
    assert float(state.sum()) == 2.0 * param.numel()


@pytest.mark.skipif(_thp_mode() == "never", reason="transparent huge pages are off on this machine")
def test_large_state_lands_on_huge_pages():
    before = _anon_huge_kib()
    state = zeros_state_like(torch.empty(4 * HUGE_MIN_BYTES // 4))
    state.fill_(1.0)  # first touch
    assert _anon_huge_kib() - before >= HUGE_MIN_BYTES // 1024  # at least a quarter on 2 MiB pages
    del state


def test_optimizer_state_round_trips_through_torch():
    params = [torch.nn.Parameter(torch.randn(HUGE_MIN_BYTES // 4 + 11)), torch.nn.Parameter(torch.randn(7))]
    ref = [torch.nn.Parameter(p.detach().clone()) for p in params]
    ours, theirs = CPUAdam(params, lr=1e-2), torch.optim.Adam(ref, lr=1e-2)
    for _ in range(2):
        for p, q in zip(params, ref):
            g = torch.randn_like(p)
            p.grad, q.grad = g, g.clone()
        ours.step()
        theirs.step()
    loaded = torch.optim.Adam(ref, lr=1e-2)
    loaded.load_state_dict(ours.state_dict())
    for p, q in zip(params, ref):
        a, b = ours.state[p], loaded.state[q]
        torch.testing.assert_close(a["exp_avg"], theirs.state[q]["exp_avg"])
        assert torch.equal(a["exp_avg"], b["exp_avg"]) and torch.equal(a["exp_avg_sq"], b["exp_avg_sq"])
