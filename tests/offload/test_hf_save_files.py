"""What a Hugging Face save writes beside the weights, and what it says (issue 41): save_16bit_model and
`offload consolidate --format safetensors` write the files transformers' save_pretrained writes (a model
that generates: its generation_config.json too, the same text), and the command reports what it wrote once."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

pytest.importorskip("safetensors", reason="safetensors is not installed (pip install .[hf])")

from offload import initialize  # noqa: E402
from offload.cli import main  # noqa: E402
from tests import child_pythonpath  # noqa: E402
from tests.offload import ckpt_worker  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _gpt2(generates: bool) -> torch.nn.Module:
    """The tiny GPT-2 with its LM head (it generates, its generation config changed from the one its config
    gives), or the bare GPT2Model (it does not)."""
    transformers = pytest.importorskip("transformers", reason="transformers is not installed (pip install .[hf])")
    from tests.offload import hf_models as hf

    torch.manual_seed(0)
    if not generates:
        return transformers.GPT2Model(hf.gpt2_config())
    model = transformers.GPT2LMHeadModel(hf.gpt2_config())
    model.generation_config.max_new_tokens = 5
    model.generation_config.pad_token_id = 0
    return model


@pytest.mark.parametrize("generates", [True, False])
def test_the_files_save_pretrained_writes(tmp_path, generates):
    """save_16bit_model(dir), and `offload consolidate` of a checkpoint, write the files save_pretrained writes
    for the same model: model.safetensors and config.json, and where the model generates generation_config.json,
    the same text as save_pretrained's."""
    _gpt2(generates).save_pretrained(tmp_path / "ref")
    from tests.offload import hf_models as hf

    engine, _, _, _ = initialize(model=_gpt2(generates), config=hf.engine_config(0, "cpu", str(tmp_path)))
    try:
        engine.save_16bit_model(str(tmp_path / "out"))
        engine.save_checkpoint(str(tmp_path / "ckpt"))
    finally:
        engine.close()
    assert main(["consolidate", str(tmp_path / "ckpt"), str(tmp_path / "hf"), "--format", "safetensors"]) == 0
    want = sorted(os.listdir(tmp_path / "ref"))
    assert ("generation_config.json" in want) == generates
    for where in ("out", "hf"):
        assert sorted(os.listdir(tmp_path / where)) == want, where
        if generates:
            text = (tmp_path / where / "generation_config.json").read_text()
            assert text == (tmp_path / "ref" / "generation_config.json").read_text(), where
            assert '"max_new_tokens": 5' in text


@pytest.mark.parametrize("fmt", ["safetensors", "pt"])
def test_consolidate_reports_once(tmp_path, fmt):
    """`offload consolidate CKPT OUT --format safetensors` said what it wrote twice: its own line on stdout and
    the safetensors writer's INFO log on stderr. One line says it now, in either format."""
    net = ckpt_worker.model()
    engine, _, _, _ = initialize(model=net, config=ckpt_worker.config("cpu", str(tmp_path), 0))
    try:
        x, y = ckpt_worker.batches(1)[0]
        engine.backward(torch.nn.functional.mse_loss(engine(x), y))
        engine.step()
        engine.save_checkpoint(str(tmp_path / "ckpt"))
    finally:
        engine.close()
    out = tmp_path / ("hf" if fmt == "safetensors" else "out.pt")
    proc = subprocess.run([sys.executable, "-m", "offload.cli", "consolidate", str(tmp_path / "ckpt"), str(out),
                           "--format", fmt], env=dict(os.environ, PYTHONPATH=child_pythonpath(ROOT)),
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    said = [line for line in (proc.stdout + proc.stderr).splitlines() if line.strip()]
    assert len(said) == 1 and said[0].startswith(f"wrote {out}: "), said
