"""The size threshold and the split of copies between one-by-one and batched, on the CPU."""
from __future__ import annotations

import pytest
import torch

from csrc import ConfigError
from offload.gpu.select import (
    DEFAULT_BATCH_BELOW_BYTES, TransferPolicy, crossover_bytes, fuse_cast, measure_batch_threshold, split_by_size,
)

KIB = 1024


def _pair(nbytes: int, dtype=torch.float32, dst_dtype=None):
    n = nbytes // torch.tensor([], dtype=dtype).element_size()
    return torch.empty(n, dtype=dst_dtype or dtype), torch.empty(n, dtype=dtype)


def test_split_by_size_and_dtype():
    pairs = [_pair(4 * KIB), _pair(1 << 20), _pair(64 * KIB), _pair(8 * KIB, torch.bfloat16, torch.float32),
             _pair(8 * KIB, torch.bfloat16, torch.float32), _pair(2 * KIB, torch.float16), _pair(256 * KIB)]
    split = split_by_size(pairs, TransferPolicy(batch_below_bytes=256 * KIB))
    # at or above the threshold: alone; the lone fp16 pair too (below min_batch)
    assert split.singles == [1, 5, 6]
    assert sorted(map(sorted, split.batches)) == [[0, 2], [3, 4]]
    # a pair's size is its larger side: bf16 -> fp32 of 8 KiB source is a 16 KiB destination
    split = split_by_size(pairs[3:5], TransferPolicy(batch_below_bytes=16 * KIB))
    assert split.singles == [0, 1] and split.batches == []


def test_threshold_zero_batches_nothing_and_non_contiguous_goes_alone():
    pairs = [_pair(4 * KIB), _pair(4 * KIB)]
    assert split_by_size(pairs, TransferPolicy(batch_below_bytes=0)).singles == [0, 1]
    t = torch.empty(32, 32)
    pairs = [(t.t(), torch.empty(32, 32)), _pair(4 * KIB), _pair(4 * KIB)]
    split = split_by_size(pairs, TransferPolicy())
    assert split.singles == [0] and split.batches == [[1, 2]]


@pytest.mark.parametrize("kwargs", [{"batch_below_bytes": -1}, {"batch_below_bytes": 1.5},
                                    {"batch_below_bytes": True}, {"min_batch": 0}])
def test_policy_rejects_bad_values(kwargs):
    with pytest.raises(ConfigError):
        TransferPolicy(**kwargs)


def test_crossover_from_timings():
    sizes = [4 * KIB, 16 * KIB, 64 * KIB, 256 * KIB, 1024 * KIB]
    # the batch wins up to 64 KiB, per-tensor copies from 256 KiB on
    assert crossover_bytes(sizes, [9, 8, 5, 2, 1], [1, 2, 4, 3, 2]) == 256 * KIB
    # a noisy win of the batch at the top moves the threshold past it: larger sizes stay batched
    assert crossover_bytes(sizes, [9, 8, 1, 2, 3], [1, 2, 4, 3, 2]) == 1024 * KIB + 1
    assert crossover_bytes(sizes, [1, 1, 1, 1, 1], [2, 2, 2, 2, 2]) == 0  # never batch
    assert crossover_bytes(sizes, [1, 1, 1, 1, 1], [1, 1, 1, 1, 1]) == 0  # ties go to the plain copy
    with pytest.raises(ConfigError):
        crossover_bytes(sizes, [1], [1])
    with pytest.raises(ConfigError):
        crossover_bytes(sizes[::-1], [1] * 5, [1] * 5)


def test_fuse_cast_only_when_the_link_carries_no_more_bytes():
    assert fuse_cast(torch.float32, torch.bfloat16)  # device fp32, host bf16: half the bytes
    assert fuse_cast(torch.bfloat16, torch.bfloat16)
    assert not fuse_cast(torch.bfloat16, torch.float32)  # ship bf16, widen on the host


def test_default_and_measuring_without_a_gpu():
    assert TransferPolicy().batch_below_bytes == DEFAULT_BATCH_BELOW_BYTES
    with pytest.raises(ConfigError, match="CUDA"):
        measure_batch_threshold(torch.device("cpu"))


@pytest.mark.cuda
def test_measured_threshold_is_one_of_the_probe_sizes_or_an_end():
    from offload.gpu.select import PROBE_SIZES_BYTES

    threshold = measure_batch_threshold(torch.device("cuda"))
    assert threshold in (0, PROBE_SIZES_BYTES[-1] + 1) + PROBE_SIZES_BYTES


def test_startup_policy_measures_on_a_gpu_and_falls_back_on_failure(caplog):
    from offload.gpu.select import startup_policy

    assert startup_policy(torch.device("cpu")) == TransferPolicy()
    assert startup_policy(torch.device("cuda"), measure=lambda d: 12345).batch_below_bytes == 12345

    def refuses(device):
        raise RuntimeError("Pointer argument cannot be accessed from Triton")

    policy = startup_policy(torch.device("cuda"), measure=refuses)
    assert policy.batch_below_bytes == 0
    assert "copying every tensor by itself" in caplog.text
