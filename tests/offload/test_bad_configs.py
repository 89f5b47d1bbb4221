"""Bad configs fail in ``initialize`` before anything is allocated.

Each case is a valid config with one value made invalid; ``initialize`` must raise a
``ConfigError`` (also a ``ValueError``) whose message names the key and the value, before
it touches the model (no param moved into the flat buffer, nothing cast), opens a tier or
creates a swap directory or file (``nvme_path`` is the test's empty directory, and stays
empty).
"""
from __future__ import annotations

import os

import pytest
import torch

import offload.builder as init_module
from csrc import ConfigError
from tests.offload.harness import engine_config, make_model, param_groups


def _stage(cfg, value):
    cfg["zero_optimization"]["stage"] = value


def _offload(**kw):
    def change(cfg, nvme):
        cfg["zero_optimization"]["offload_optimizer"] = {k: (v(nvme) if callable(v) else v) for k, v in kw.items()}
    return change


CASES = {
    "stage 4": (lambda cfg, nvme: _stage(cfg, 4), ["zero_optimization.stage", "4"]),
    "stage -1": (lambda cfg, nvme: _stage(cfg, -1), ["zero_optimization.stage", "-1"]),
    "offload_param without stage 3": (lambda cfg, nvme: cfg["zero_optimization"].update(
        offload_param={"device": "cpu"}), ["zero_optimization.offload_param"]),
    "negative train_batch_size": (lambda cfg, nvme: cfg.update(train_batch_size=-8), ["train_batch_size", "-8"]),
    "zero micro batch": (lambda cfg, nvme: cfg.update(train_micro_batch_size_per_gpu=0),
                         ["train_micro_batch_size_per_gpu", "0"]),
    "batch sizes disagree": (lambda cfg, nvme: cfg.update(train_batch_size=12),
                             ["train_batch_size=12", "train_micro_batch_size_per_gpu=8"]),
    "unknown optimizer type": (lambda cfg, nvme: cfg["optimizer"].update(type="Lamb"), ["optimizer.type", "Lamb"]),
    "negative lr": (lambda cfg, nvme: cfg["optimizer"]["params"].update(lr=-1.0), ["lr", "-1.0"]),
    "nvme without nvme_path": (_offload(device="nvme"), ["zero_optimization.offload_optimizer.nvme_path", "None"]),
    "nvme_path missing": (_offload(device="nvme", nvme_path=lambda d: str(d / "missing")),
                          ["zero_optimization.offload_optimizer.nvme_path", "missing", "no such directory"]),
    "nvme_path a file": (_offload(device="nvme", nvme_path=lambda d: str(d / "a_file")),
                         ["zero_optimization.offload_optimizer.nvme_path", "a_file", "not a directory"]),
    "unknown offload device": (_offload(device="gpu"), ["device", "gpu"]),
    "unknown huge_pages": (lambda cfg, nvme: cfg.update(offload={"huge_pages": "always"}),
                           ["offload.huge_pages", "always", '"auto" or "off"']),
    "unknown key": (lambda cfg, nvme: cfg["zero_optimization"].update(stage_size=3),
                    ["zero_optimization.stage_size"]),
    "negative gradient_clipping": (lambda cfg, nvme: cfg.update(gradient_clipping=-1.0),
                                   ["gradient_clipping", "-1.0"]),
    "fp16 and bf16": (lambda cfg, nvme: cfg.update(fp16={"enabled": True}, bf16={"enabled": True}),
                      ["fp16", "bf16"]),
}


@pytest.fixture
def forbid_allocation(monkeypatch):
    """Any tier or state storage made during the test fails it."""
    def refuse(*args, **kwargs):
        raise AssertionError("initialize allocated before rejecting the config")
    monkeypatch.setattr(init_module, "open_tier", refuse)
    monkeypatch.setattr(init_module, "StateStorage", refuse)


@pytest.mark.parametrize("case", list(CASES))
def test_bad_config_fails_before_allocating(case, tmp_path, forbid_allocation):
    change, words = CASES[case]
    nvme = tmp_path / "nvme"
    nvme.mkdir()
    (nvme / "a_file").write_bytes(b"")
    cfg = engine_config(stage=2, device="nvme", nvme_path=nvme)
    change(cfg, nvme)
    model = make_model()
    before = {n: (p.data_ptr(), p.dtype) for n, p in model.named_parameters()}

    with pytest.raises(ConfigError) as info:
        init_module.initialize(model=model, config=cfg, model_parameters=param_groups(model))
    message = str(info.value)
    for word in words:
        assert word in message, f"{word!r} not in {message!r}"
    assert isinstance(info.value, ValueError)
    assert {n: (p.data_ptr(), p.dtype) for n, p in model.named_parameters()} == before
    assert sorted(os.listdir(nvme)) == ["a_file"], "a swap directory or file was created"


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into any directory: nothing to refuse")
def test_unwritable_nvme_path(tmp_path, forbid_allocation):
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o500)
    cfg = engine_config(stage=1, device="nvme", nvme_path=locked)
    with pytest.raises(ConfigError, match="nvme_path.*locked.*not writable"):
        init_module.initialize(model=make_model(), config=cfg)
    assert not os.listdir(locked)


def test_a_good_config_gets_past_the_guards(tmp_path):
    """The same config unchanged initializes (so the cases above fail for their one change)."""
    cfg = engine_config(stage=2, device="nvme", nvme_path=tmp_path)
    model = make_model()
    engine, optimizer, _, _ = init_module.initialize(model=model, config=cfg, model_parameters=param_groups(model))
    try:
        assert len(os.listdir(tmp_path)) == 1, "one swap directory while the engine lives"
        assert torch.equal(model.fc1.weight.detach(), make_model().fc1.weight.detach())
    finally:
        engine.close()
    assert not os.listdir(tmp_path), "close() removes the swap directory"
