"""Saving back as Hugging Face reads it: engine.save_16bit_model(dir) and `offload consolidate --format
safetensors` write sharded safetensors + index + config.json that transformers' own from_pretrained loads,
giving the engine's logits on a fixed batch; a file stays under the size cap; stage 3 saves one unit at a time."""
from __future__ import annotations

import json
import os

import pytest
import torch

pytest.importorskip("transformers", reason="transformers is not installed (pip install .[hf])")
pytest.importorskip("safetensors", reason="safetensors is not installed (pip install .[hf])")

from safetensors import safe_open  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402

from offload import initialize  # noqa: E402
from offload.cli import main  # noqa: E402
from tests.offload import hf_models as hf  # noqa: E402

CAP = 24 * 1024  # bytes per file: the tiny models take several files


def _files(where) -> list[str]:
    return sorted(f for f in os.listdir(where) if f.endswith(".safetensors"))


def _engine_logits(engine, ids) -> torch.Tensor:
    engine.module.eval()
    with torch.no_grad():
        out = engine(input_ids=ids).logits.detach().clone()
    engine.module.train()
    return out


def _assert_loads_with_logits(where, logits, ids) -> None:
    index = json.loads((where / "model.safetensors.index.json").read_text())
    assert sorted(set(index["weight_map"].values())) == _files(where) and len(_files(where)) > 1
    for name in _files(where):
        assert os.path.getsize(where / name) <= CAP + 4096  # the cap, plus the file's JSON header
    loaded = AutoModelForCausalLM.from_pretrained(where).eval()
    with torch.no_grad():
        torch.testing.assert_close(loaded(input_ids=ids).logits, logits, rtol=0, atol=0)


def test_each_shard_holds_as_many_tensors_as_fit_under_the_cap(tmp_path):
    """ShardedWriter starts a new file only when the next tensor would take this one over the cap: with
    tensors of 400, 400, 200, 600, 400, 400, 100 bytes under a 1000-byte cap, the files hold 1000, 1000 and
    500 bytes, each tensor read back (safetensors) equal to the one written, under the index's names."""
    from offload.hf.safetensors_out import ShardedWriter

    torch.manual_seed(0)
    tensors = {f"t{i}": torch.randn(nbytes // 4) for i, nbytes in enumerate((400, 400, 200, 600, 400, 400, 100))}
    writer = ShardedWriter(str(tmp_path), max_shard_size_bytes=1000)
    for name, t in tensors.items():
        writer.add(name, t)
    names = writer.close()
    assert names == _files(tmp_path) == [f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)]
    held = []
    for name in names:
        with safe_open(str(tmp_path / name), "pt") as f:
            held.append(sorted(f.keys()))
            for key in f.keys():
                assert torch.equal(f.get_tensor(key), tensors[key]), key
    assert held == [["t0", "t1", "t2"], ["t3", "t4"], ["t5", "t6"]]
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert index["metadata"]["total_size"] == 2500
    assert index["weight_map"] == {key: names[i] for i, keys in enumerate(held) for key in keys}


@pytest.mark.parametrize("stage,device,built", [(3, "cpu", "init_context"), (3, "nvme", "init_context"),
                                                (3, "nvme", "plain"), (2, "cpu", "plain"), (1, "nvme", "plain"),
                                                (0, "cpu", "plain")])
@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_save_16bit_model_loads_with_from_pretrained(tmp_path, kind, stage, device, built):
    """Trained 3 steps, saved, loaded by transformers alone: the same logits, the tied head tied again.
    (No unit is kept gathered between uses, so what the save gathers shows.)"""
    config = hf.engine_config(stage, device, str(tmp_path),
                              **({"stage3_max_reuse_distance": 0} if stage == 3 else {}))
    net = hf.build(kind) if built == "plain" else hf.build_meta(kind, config)
    engine, _, _, _ = initialize(model=net, config=config)
    ids = hf.batches(1, seed=9)[0]
    try:
        hf.engine_losses(engine, hf.batches(3))
        if stage == 3:
            coordinator = engine.stage3.coordinator
            held = sum(f.untyped_storage().nbytes() for f in coordinator._full)  # persistent units (and kept ones)
            coordinator.peak_live_bytes = 0
        assert engine.save_16bit_model(str(tmp_path / "out"), max_shard_size_bytes=CAP)
        if stage == 3:  # one unit gathered at a time beyond what was held
            largest = 4 * max(b.numel for b in engine.stage3.layout.buckets)
            assert held + largest < 4 * sum(b.numel for b in engine.stage3.layout.buckets)
            assert coordinator.peak_live_bytes <= held + largest
        logits = _engine_logits(engine, ids)
    finally:
        engine.close()
    assert json.loads((tmp_path / "out" / "config.json").read_text())["model_type"] == kind
    _assert_loads_with_logits(tmp_path / "out", logits, ids)
    if kind == "gpt2":
        loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "out")
        assert loaded.lm_head.weight is loaded.transformer.wte.weight


def test_bf16_engine_saves_bf16(tmp_path):
    """A bf16 engine writes bf16 tensors, each the engine's gathered weight bit for bit."""
    config = {**hf.engine_config(3, "cpu", str(tmp_path)), "bf16": {"enabled": True}}
    net = hf.build("llama")
    engine, _, _, _ = initialize(model=net, config=config)
    try:
        hf.engine_losses(engine, hf.batches(2))
        engine.save_16bit_model(str(tmp_path / "out"), max_shard_size_bytes=CAP // 2)
        with engine.stage3.coordinator.gathered():
            want = {k: v.detach().clone() for k, v in net.state_dict().items()}
    finally:
        engine.close()
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "out", dtype=torch.bfloat16)
    got = loaded.state_dict()
    assert got.keys() == want.keys()
    for key, value in want.items():
        assert got[key].dtype == value.dtype and torch.equal(got[key], value), key
    assert any(v.dtype == torch.bfloat16 for v in got.values())


@pytest.mark.parametrize("kind", ["gpt2", "llama", "mixtral"])
def test_consolidate_safetensors_from_the_save_dir(tmp_path, kind):
    """`offload consolidate SAVE_DIR OUT --format safetensors` follows `latest` and writes the fp32 masters:
    from_pretrained gives the engine's fp32 logits. The names are those save_pretrained writes (Mixtral's
    experts one tensor each), and config.json names the class, as save_pretrained's does."""
    config = hf.engine_config(3, "nvme", str(tmp_path))
    engine, _, _, _ = initialize(model=hf.build(kind), config=config)
    ids = hf.batches(1, seed=9)[0]
    try:
        hf.engine_losses(engine, hf.batches(3))
        engine.save_checkpoint(str(tmp_path / "ckpt"))
        logits = _engine_logits(engine, ids)
    finally:
        engine.close()
    assert main(["consolidate", str(tmp_path / "ckpt"), str(tmp_path / "hf"), "--format", "safetensors",
                 "--max-shard-size-bytes", str(CAP)]) == 0
    _assert_loads_with_logits(tmp_path / "hf", logits, ids)
    hf.build(kind).save_pretrained(tmp_path / "ref", max_shard_size="1GB")
    want = json.loads((tmp_path / "ref" / "config.json").read_text())["architectures"]
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["architectures"] == want
    index = json.loads((tmp_path / "hf" / "model.safetensors.index.json").read_text())
    with safe_open(str(tmp_path / "ref" / "model.safetensors"), "pt") as f:
        assert set(index["weight_map"]) == set(f.keys())


def test_estimate_reads_an_hf_config(tmp_path, capsys):
    """`offload estimate --hf-config DIR/config.json` counts the parameters of the model that config builds
    (the plain build's, ties counted once); a path that is no config.json is named."""
    src = hf.build("llama")
    src.config.save_pretrained(tmp_path)
    assert main(["estimate", "--hf-config", str(tmp_path / "config.json"), "--no-baseline", "--stage", "3"]) == 0
    assert capsys.readouterr().out.splitlines()[0].startswith(f"{sum(p.numel() for p in src.parameters()):,} parameters")
    assert main(["estimate", "--hf-config", str(tmp_path), "--json", "--no-baseline", "--stage", "3"]) == 0
    assert len(json.loads(capsys.readouterr().out)) == 9
    assert main(["estimate", "--hf-config", str(tmp_path / "nope.json")]) == 2
    assert "--hf-config takes a config.json" in capsys.readouterr().err
