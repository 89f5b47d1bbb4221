"""tools/bench/step_gpu.py (the step bench's GPU rows): its arithmetic against independent counts, and
the whole bench run on the CPU with a tiny GPT (the smoke the GPU run builds on); on a GPU, a small
real run whose wait share comes from the profiler."""
from __future__ import annotations

import random
import re
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(REPO / "tools" / "bench"))

import step_gpu  # noqa: E402
from step_gpu_plan import (  # noqa: E402
    CONTENDERS, busy_seconds, fits, gpu_busy_seconds, largest_layers, model_flops_per_step,
)

from offload.models.gpt import GPT, GPTConfig  # noqa: E402

NAMES = [c.name for c in CONTENDERS]
DEFAULT = step_gpu.DEFAULT  # every row but DeepSpeed's (test_step_deepspeed runs those)
GIB = 1 << 30


@pytest.mark.parametrize("vocab,dim,layers,heads,seq", [(50304, 2048, 18, 16, 1024), (1000, 256, 3, 4, 128)])
def test_model_flops_match_torchs_flop_counter(vocab, dim, layers, heads, seq):
    from torch.utils.flop_counter import FlopCounterMode

    with torch.device("meta"):  # the shapes alone: torch counts every matmul and attention's products
        model = GPT(GPTConfig(vocab_size=vocab, block_size=seq, n_layer=layers, n_head=heads, n_embd=dim))
        idx = torch.zeros(2, seq, dtype=torch.long)
    counter = FlopCounterMode(display=False)
    with counter:
        model(idx, idx).backward()
    ours = model_flops_per_step(params=model.num_parameters(), n_layer=layers, n_embd=dim, seq=seq, tokens=2 * seq)
    # ours also counts biases, norms and the position table as 6 FLOPs per element and token: a few per cent at most
    assert counter.get_total_flops() <= ours <= 1.05 * counter.get_total_flops()


def test_busy_seconds_is_the_length_of_the_union():
    rng = random.Random(3)
    for _ in range(50):
        spans = [(a, a + rng.randint(0, 30)) for a in (rng.randint(0, 200) for _ in range(rng.randint(0, 12)))]
        covered = {t for s, e in spans for t in range(s, e)}  # unit cells: the union counted by hand
        assert busy_seconds(spans) == len(covered)


def test_largest_layers_is_where_fitting_stops():
    dims = dict(n_embd=1024, n_head=8, vocab=32000, seq=512, batch=2)
    mem = dict(device_bytes=16 * GIB, host_bytes=32 * GIB, nvme_bytes=8 * GIB)
    s3 = [c for c in CONTENDERS if c.name == "s3-param-cpu"]
    n = largest_layers(s3, **dims, **mem, most=256)
    assert 1 < n < 256
    assert fits(s3[0], n_layer=n, **dims, **mem)[0]
    ok, why = fits(s3[0], n_layer=n + 1, **dims, **mem)
    assert not ok and "host" in why
    with torch.device("meta"):
        params = [GPT(GPTConfig(vocab_size=32000, block_size=512, n_layer=k, n_head=8, n_embd=1024)).num_parameters()
                  for k in (n, n + 1)]
    # fp32 master, moments and gradient accumulators (16 B) and bf16 shards (2 B) per param, all in host memory
    assert 18 * params[0] <= 0.85 * 32 * GIB < 18 * params[1] * 1.02


def test_what_does_not_fit_says_where():
    dims = dict(n_embd=1024, n_head=8, vocab=32000, seq=512, batch=2, n_layer=24)
    ok, why = fits(CONTENDERS[0], **dims, device_bytes=1 * GIB, host_bytes=64 * GIB, nvme_bytes=64 * GIB)
    assert not ok and why.startswith("device") and "host" not in why
    assert largest_layers(CONTENDERS[:1], **{k: v for k, v in dims.items() if k != "n_layer"},
                          device_bytes=1 << 20, host_bytes=1 << 20, nvme_bytes=1 << 20) == 0


def _rows(text: str) -> dict[str, list[str]]:
    rows = {}
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if cells and cells[0] in NAMES:
            rows[cells[0]] = cells
    return rows


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is here: --device cpu refuses it")
def test_the_whole_bench_runs_on_the_cpu_with_a_tiny_model(tmp_path):
    out = tmp_path / "step_gpu.md"
    assert step_gpu.main(["--device", "cpu", "--tiny", "--rounds", "1", "--steps-per-round", "2",
                          "--nvme-path", str(tmp_path), "--out", str(out)]) == 0
    text = out.read_text()
    rows = _rows(text)
    assert list(rows) == DEFAULT and not any(n.startswith("ds-") for n in DEFAULT)
    tokens = 2 * 2 * 32
    for name, cells in rows.items():
        step = float(cells[1].split()[0])
        assert step > 0 and cells[4] == "n/a"  # no GPU: no wait share
        rate = float(cells[2].replace(",", ""))  # tokens/s from the unrounded step time (printed to 1 ms)
        assert tokens / (step + 0.0005) - 1 <= rate <= tokens / max(step - 0.0005, 1e-9) + 1
        assert cells[5] and cells[6]  # both rate ratios filled
        # one step of the same batches from the same weights: every loss near plain torch's (bf16)
        assert float(cells[7]) == pytest.approx(float(rows["torch"][7]), rel=0.03)
    assert "Bar: opt-cpu at" in text
    # where each engine row's host time went, per step after the warm-up (the overlap's share on a GPU)
    for name in DEFAULT[1:]:
        line = re.search(rf"- {name}, per step: forward s ([0-9.]+), backward s ([0-9.]+), step after backward s "
                         rf"([0-9.]+)(?:, [^(\n]*)? \(over 2 steps\)", text)  # the warm-up step is not counted
        # (then, for the overlapped rows, what ran under backward and under the next forward)
        assert line, (name, text)
        slowest = float(rows[name][1].split("-")[-1].rstrip(")"))
        assert 0 < sum(float(x) for x in line.groups()) <= 2 * slowest + 0.002  # a mean over a step not timed too


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is here: --device cpu refuses it")
def test_largest_runs_one_contender_at_a_time(tmp_path, capsys):
    assert step_gpu.main(["--device", "cpu", "--tiny", "--largest", "--max-layers", "3", "--rounds", "1",
                          "--steps-per-round", "2", "--contenders", "s3-param-cpu", "opt-cpu",
                          "--nvme-path", str(tmp_path)]) == 0
    text = capsys.readouterr().out
    assert "--largest: 3 layers" in text and "sequential" in text
    assert list(_rows(text)) == ["s3-param-cpu", "opt-cpu"]


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is here: --device cpu refuses it")
def test_a_spent_budget_reports_what_was_measured(tmp_path, capsys):
    """Interleaved: the first round always runs, the budget stops the rest; one at a time: a contender
    is not started with under a minute left, and is listed as not measured."""
    common = ["--device", "cpu", "--tiny", "--steps-per-round", "2", "--nvme-path", str(tmp_path)]
    assert step_gpu.main(common + ["--rounds", "3", "--contenders", "torch", "opt-cpu", "--budget-seconds", "0"]) == 0
    text = capsys.readouterr().out
    assert "ended the run after 1 of 3 rounds" in text and list(_rows(text)) == ["torch", "opt-cpu"]
    assert step_gpu.main(common + ["--sequential", "--contenders", "torch", "--budget-seconds", "30"]) == 0
    text = capsys.readouterr().out
    assert not _rows(text) and "torch (not measured: out of time)" in text


@pytest.mark.cuda
def test_a_small_gpu_run_measures_the_wait_share(tmp_path):
    out = tmp_path / "step_gpu.md"
    assert step_gpu.main(["--contenders", "torch", "none", "opt-cpu", "--layers", "2", "--dim", "256", "--heads", "4",
                          "--vocab", "4096", "--seq", "256", "--batch", "2", "--accum", "2", "--rounds", "2",
                          "--steps-per-round", "2", "--nvme-path", str(tmp_path), "--out", str(out)]) == 0
    rows = _rows(out.read_text())
    for name in ("torch", "none", "opt-cpu"):
        wait = rows[name][4]
        assert wait.endswith("%") and 0.0 <= float(wait[:-1]) <= 100.0, rows[name]


class _Span:
    def __init__(self, start, end):
        self.start, self.end = start, end


class _Event:
    def __init__(self, name, start_us, end_us, device, annotation=False):
        from torch.autograd import DeviceType

        self.name, self.time_range = name, _Span(start_us, end_us)
        self.device_type = DeviceType.CUDA if device == "cuda" else DeviceType.CPU
        self.is_user_annotation = annotation


class _Profile:
    def __init__(self, events):
        self._events = events

    def events(self):
        return self._events


def test_busy_time_counts_kernels_only():
    """Kernels (overlapping ones once) count; host-side ops, copy-engine transfers and the GPU-side
    spans of record_function ranges do not."""
    prof = _Profile([
        _Event("ampere_bf16_gemm", 0, 100, "cuda"),
        _Event("void at::native::vectorized_elementwise_kernel", 50, 150, "cuda"),  # overlaps: 150 us so far
        _Event("Memcpy HtoD (Pinned -> Device)", 200, 900, "cuda"),
        _Event("offload::h2d", 150, 1000, "cuda", annotation=True),
        _Event("aten::mm", 0, 2000, "cpu"),
        _Event("triton_segmented_copy", 1000, 1050, "cuda"),
    ])
    assert gpu_busy_seconds(prof) == pytest.approx(200e-6)
    assert gpu_busy_seconds(_Profile([_Event("aten::mm", 0, 10, "cpu")])) is None


def test_a_real_profile_without_a_gpu_has_no_busy_time():
    """The same reading of a torch.profiler profile (its events' fields exist), with no CUDA kernel in it."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        torch.randn(64, 64) @ torch.randn(64, 64)
    assert any(e.name == "aten::mm" for e in prof.events())
    assert gpu_busy_seconds(prof) is None


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is here: --device cpu refuses it")
def test_deepspeeds_rows_are_skipped_saying_why_where_it_does_not_import(tmp_path, capsys, monkeypatch):
    """This interpreter's path has no DeepSpeed (the set-up keeps it in .venv/ds-site, off it)."""
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    assert step_gpu.main(["--device", "cpu", "--tiny", "--rounds", "1", "--steps-per-round", "2", "--contenders",
                          "torch", "ds-z2-opt-cpu", "--nvme-path", str(tmp_path)]) == 0
    text = capsys.readouterr().out
    assert list(_rows(text)) == ["torch"]
    assert re.search(r"Skipped: ds-z2-opt-cpu \(deepspeed does not import: "
                     r"ModuleNotFoundError: No module named 'deepspeed'\)", text), text


def test_the_live_quarter_row_holds_the_gathered_params_to_a_quarter(tmp_path):
    """s3-param-cpu-live25: stage3_max_live_parameters and stage3_max_reuse_distance reach the engine at a
    quarter of the model's parameters (DeepSpeed's keys, DeepSpeed's meaning), with the overlapped step."""
    from step_gpu_rows import build

    gcfg = GPTConfig(vocab_size=256, block_size=32, n_layer=4, n_head=4, n_embd=64, tied_head=True)
    c = step_gpu.BY_NAME["s3-param-cpu-live25"]
    row = build(c, gcfg, torch.device("cpu"), batch=2, accum=1, nvme_path=str(tmp_path))
    try:
        params = GPT(gcfg, seed=0).num_parameters()
        config = row.engine.stage3.coordinator.config
        assert config.max_live_numel == config.max_reuse_distance_numel == params // 4
        assert row.engine.overlap is not None  # the overlapped step, which "auto" leaves off at stage 3
    finally:
        row.close()


def test_the_half_row_keeps_half_of_the_optimizer_on_the_device(tmp_path, monkeypatch):
    """opt-cpu-half: offload_optimizer.ratio 0.5 reaches the engine, which keeps the last half of the sub-groups
    (the first layers') on the model's device (sub-groups cut small here: the row's 100M would make one)."""
    import step_gpu_rows
    from step_gpu_rows import build

    made = step_gpu_rows.engine_config

    def small_sub_groups(*args, **kwargs):
        config = made(*args, **kwargs)
        config["zero_optimization"]["sub_group_size"] = 20_000
        return config

    monkeypatch.setattr(step_gpu_rows, "engine_config", small_sub_groups)
    gcfg = GPTConfig(vocab_size=256, block_size=32, n_layer=4, n_head=4, n_embd=64, tied_head=True)
    row = build(step_gpu.BY_NAME["opt-cpu-half"], gcfg, torch.device("cpu"), batch=2, accum=1,
                nvme_path=str(tmp_path))
    try:
        layout, kept = row.engine.layout, row.engine.adam.storage.on_device
        n = len(layout.sub_groups)
        assert row.engine.config.zero.offload_optimizer.ratio == 0.5 and n >= 6
        assert kept == frozenset(range(n - len(kept), n))
        assert abs(sum(layout.sub_groups[i].numel for i in kept) / layout.partition_numel - 0.5) < 2 / n
    finally:
        row.close()
