"""The [hf] extra is optional: with transformers and safetensors unimportable, the engine imports, builds a
model under init_context and trains it, and saving safetensors says which package is missing."""
from __future__ import annotations

import os
import subprocess
import sys

from tests import child_pythonpath

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = """
import sys
sys.modules["transformers"] = None  # unimportable, as when the extra is not installed
sys.modules["safetensors"] = None
import torch, offload
cfg = {"train_batch_size": 1, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}, "zero_optimization": {"stage": 3}}
with offload.init_context(cfg):
    model = torch.nn.Linear(4, 4)
engine, _, _, _ = offload.initialize(model=model, config=cfg)
loss = engine(torch.ones(1, 4)).sum()
engine.backward(loss)
engine.step()
try:
    engine.save_16bit_model(sys.argv[1])
except offload.ConfigError as exc:
    print("refused:", exc)
engine.close()
"""


def test_the_core_runs_without_the_hf_extra(tmp_path):
    env = dict(os.environ, PYTHONPATH=child_pythonpath(ROOT), OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, "-c", SCRIPT, str(tmp_path / "out")], env=env, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "refused: writing safetensors needs the safetensors package: pip install .[hf]" in proc.stdout
