"""tools/bench/step_hf.py (Llama-shaped HF models at the sizes people offload): its arithmetic against
independent counts (the model's own parameters, torch's FLOP counter, the estimate's verdicts), and the
whole bench run on the CPU at a tiny size, ours against DeepSpeed from .venv/ds-site where the set-up put
it, through both the estimate's pick and stage 3 under init_context."""
from __future__ import annotations

import dataclasses
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(REPO / "tools" / "bench"))

import step_hf  # noqa: E402
from step_hf_plan import CHOICES, SHAPES, _row, _scaled, choose, deepspeed_choice, hf_config, model_flops_per_token, \
    params_of  # noqa: E402

from offload.plan.fit import Machine, verdict  # noqa: E402

GIB = 1 << 30
DS_SITE = Path(os.environ.get("OFFLOAD_DS_SITE", REPO / ".venv" / "ds-site"))
H200_NODE = Machine(host_bytes=120 * GIB, nvme_bytes=60 * GIB, gpu=True, gpu_bytes=141 * 10 ** 9)
"""The lent H200 machine as its sessions saw it: 141 GB GPU, ~120 GiB of its 125 available, ~60 GiB free disk."""


@pytest.mark.parametrize("name", list(SHAPES))
def test_parameter_counts_are_the_models_own(name):
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(hf_config(SHAPES[name], seq=128))
    total, embed = params_of(SHAPES[name])
    assert total == sum(p.numel() for p in model.parameters())
    assert embed == model.get_input_embeddings().weight.numel()


def test_model_flops_match_torchs_flop_counter():
    from torch.utils.flop_counter import FlopCounterMode
    from transformers import AutoModelForCausalLM

    shape = dataclasses.replace(SHAPES["tiny"], layers=3, hidden=256, intermediate=704, vocab=1000)
    seq = 128
    model = AutoModelForCausalLM.from_config(hf_config(shape, seq=seq), attn_implementation="eager")
    ids = torch.randint(0, shape.vocab, (2, seq))
    counter = FlopCounterMode(display=False)
    with counter:
        model(input_ids=ids, labels=ids).loss.backward()
    ours = model_flops_per_token(shape, seq=seq) * 2 * seq
    # torch counts every matmul (eager attention's two products over the whole square, as ours does); ours adds
    # norms and the rotary nothing: within a few per cent
    assert 0.97 * counter.get_total_flops() <= ours <= 1.03 * counter.get_total_flops()


@pytest.mark.parametrize("name", ["8b", "14b", "30b"])
def test_the_pick_is_the_first_row_the_estimate_fits(name):
    shape = SHAPES[name]
    choice, tried = choose(shape, micro_batch=2, seq=4096, machine=H200_NODE)
    room = _scaled(H200_NODE, 0.85)
    fits = [verdict(_row(c, shape, micro_batch=2, seq=4096, machine=room, nvme_path="/tmp"), room).fits
            for c in CHOICES]
    assert choice == (CHOICES[fits.index(True)] if any(fits) else None)
    assert len(tried) == (fits.index(True) + 1 if any(fits) else len(CHOICES))
    if name != "30b":  # the sizes of issue 39's rows fit this node; its 30B does not yet (the note says why)
        assert choice is not None
    else:
        assert choice is None and all("host +" in t or "NVMe +" in t for t in tried)


def test_deepspeed_gets_the_largest_ratio_its_host_share_fits():
    total, _ = params_of(SHAPES["8b"])
    zero, why = deepspeed_choice(SHAPES["8b"], micro_batch=2, seq=4096, machine=H200_NODE)
    host = 0.85 * H200_NODE.host_bytes
    assert 18 * total > host and zero["stage"] == 3  # ZeRO-2's 18 B/param do not fit this host at 8B
    ratio = zero["offload_optimizer"]["ratio"]
    assert 18 * total * ratio <= host < 18 * total * (ratio + 0.1)
    assert f"ratio {ratio}" in why
    small = deepspeed_choice(SHAPES["tiny"], micro_batch=2, seq=64, machine=H200_NODE)[0]
    assert small == {"stage": 2, "offload_optimizer": {"device": "cpu"}}
    assert deepspeed_choice(SHAPES["30b"], micro_batch=2, seq=4096, machine=H200_NODE)[0] is None


def test_largest_is_where_fitting_stops():
    a = step_hf.parse(["--largest", "--micro-batch", "1", "--seq", "1024"])
    layers, tried = step_hf._largest(a, H200_NODE)
    assert 0 < layers < SHAPES["30b"].layers
    grow = dataclasses.replace
    assert choose(grow(SHAPES["30b"], layers=layers), micro_batch=1, seq=1024, machine=H200_NODE)[0] is not None
    assert choose(grow(SHAPES["30b"], layers=layers + 1), micro_batch=1, seq=1024, machine=H200_NODE)[0] is None
    assert len(tried) == len(CHOICES)


def _run(tmp_path, *args):
    env = dict(os.environ, DS_ACCELERATOR="cpu", PYTHONPATH=f"{DS_SITE}{os.pathsep}{REPO}",
               PATH=f"{DS_SITE / 'bin'}{os.pathsep}{os.environ.get('PATH', '')}")
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    out = tmp_path / "hf.md"
    r = subprocess.run([sys.executable, str(REPO / "tools" / "bench" / "step_hf.py"), "--model", "tiny", "--device",
                        "cpu", "--steps", "3", "--nvme-path", str(tmp_path), "--out", str(out), *args], env=env,
                       capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return out.read_text()


def _losses(text: str, name: str) -> list[float]:
    row = next(line for line in text.splitlines() if line.startswith(f"| {name} |"))
    return [float(x) for x in row.strip().strip("|").split("|")[-1].split()]


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is here: --device cpu refuses it")
@pytest.mark.skipif(not (DS_SITE / "deepspeed").is_dir(), reason=f"no DeepSpeed at {DS_SITE}: tools/setup.sh")
@pytest.mark.parametrize("args,ours_stage,stage", [((), 1, 2),
                                                   (("--choice", "z3-param-cpu-lean", "--ds-zero",
                                                     '{"stage": 3, "offload_optimizer": {"device": "cpu", '
                                                     '"ratio": 0.5}}'), 3, 3)])
def test_the_tiny_model_trains_on_both_engines_with_the_same_losses(tmp_path, args, ours_stage, stage):
    text = _run(tmp_path, *args)
    ours, ds = _losses(text, "ours"), _losses(text, "ds")
    assert len(ours) == len(ds) == 3
    # the same checkpoint, batches and order: bf16 losses equal to the third decimal, and they change
    assert max(abs(x - y) for x, y in zip(ours, ds)) < 5e-3 and len(set(ours)) > 1
    assert re.search(r"ours / DeepSpeed tokens/s: [0-9.]+x \(issue 39: >= 2x\)", text)
    assert f"DeepSpeed 0.19.8, ZeRO stage {stage}" in text and f'ours, z{ours_stage}-' in text
    assert f'{{"stage": {ours_stage}, ' in text
    if stage == 3:
        assert "ratio 0.5" in text and '"master_dtype": "bf16"' in text
    else:
        assert "of each memory (the disk less the checkpoint): z1-opt-cpu-half:" in text and "fits" in text


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is here: --device cpu refuses it")
def test_the_largest_is_built_from_its_config_under_init_context(tmp_path):
    """--largest writes no weights: at stage 3 the model is built from config.json under init_context."""
    text = _run(tmp_path, "--largest", "--max-layers", "3", "--choice", "z3-param-cpu-lean", "--contenders", "ours")
    assert "--largest: 3 layers at the tiny widths fit, the search's cap" in text
    assert "no checkpoint (--largest)" in text and "model: 3 layers, hidden 64" in text
    losses = _losses(text, "ours")
    assert len(losses) == 3 and all(5.0 < x < 6.0 for x in losses)  # ln(256) = 5.55: a fresh model's loss
    assert '"stage": 3' in text and '"offload_param": {"device": "cpu"}' in text
