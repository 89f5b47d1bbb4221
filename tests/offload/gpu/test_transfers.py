"""``Fetcher``: the split decides what each start sends through the batched kernel; every pair
arrives either way (oracle: the source read back); on a GPU, the events fence the streams."""
from __future__ import annotations

import pytest
import torch

from offload.gpu.select import TransferPolicy
from offload.gpu.transfers import Fetcher


class RecordingBatch:
    def __init__(self):
        self.calls = []

    def __call__(self, dsts, srcs, device=None):
        self.calls.append([s.numel() for s in srcs])
        for d, s in zip(dsts, srcs):
            d.copy_(s)
        return True


def _pairs(sizes, dtype=torch.float32, dst_dtype=None):
    srcs = [torch.randn(n).to(dtype) for n in sizes]
    return [(torch.empty(n, dtype=dst_dtype or dtype), s) for n, s in zip(sizes, srcs)]


def test_cpu_fetch_and_offload_copy_everything_and_batch_the_small():
    batch = RecordingBatch()
    fetcher = Fetcher(torch.device("cpu"), policy=TransferPolicy(batch_below_bytes=4096), batched=batch)
    assert not fetcher.on_gpu
    pairs = _pairs([10, 5000, 300, 7, 1024])  # 40 B, 20 KB, 1.2 KB, 28 B, 4 KiB (not below 4096)
    pending = fetcher.start_fetch(pairs)
    assert pending.event is None
    fetcher.wait_fetch(pending)
    assert batch.calls == [[10, 300, 7]]
    assert tuple(fetcher.last_counts) == (2, 1, 3)
    for d, s in pairs:
        assert torch.equal(d, s)
    back = _pairs([3, 3], torch.bfloat16, torch.float32)
    fetcher.wait_offload(fetcher.start_offload(back))
    assert batch.calls[-1] == [3, 3]
    for d, s in back:
        assert torch.equal(d, s.float())


def test_pending_keeps_its_tensors_alive():
    fetcher = Fetcher(torch.device("cpu"), batched=RecordingBatch())
    pairs = _pairs([4, 4])
    pending = fetcher.start_fetch(pairs)
    assert all(any(t is u for u in pending.tensors) for pair in pairs for t in pair)


@pytest.mark.cuda
def test_gpu_fetch_then_compute_sees_the_bytes_and_offload_returns_them():
    dev = torch.device("cuda")
    fetcher = Fetcher(dev)
    sizes = [17, 1 << 20, 4099, 3, 1 << 16]
    host = [torch.randn(n).pin_memory() for n in sizes]
    on_dev = [torch.empty(n, device=dev) for n in sizes]
    pending = fetcher.start_fetch(list(zip(on_dev, host)))
    fetcher.wait_fetch(pending)
    doubled = [t * 2 for t in on_dev]  # on the compute stream, after the fetch
    back = [torch.empty(n).pin_memory() for n in sizes]
    done = fetcher.start_offload(list(zip(back, doubled)))
    fetcher.wait_offload(done)
    for b, h in zip(back, host):
        assert torch.equal(b, h * 2)
    assert fetcher.last_counts.singles >= 1
