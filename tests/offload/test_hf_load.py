"""offload.load_pretrained: safetensors written by transformers' own save_pretrained (one file, or sharded with
its index) read into stage 3's shards (cpu, nvme) or a plain model, cast to the compute dtype, ties kept,
missing and unexpected keys reported; the loaded model trains as torch does from the same weights."""
from __future__ import annotations

import json
import os

import pytest
import torch

pytest.importorskip("transformers", reason="transformers is not installed (pip install .[hf])")
safetensors_torch = pytest.importorskip("safetensors.torch", reason="safetensors is not installed (pip install .[hf])")

from offload import ConfigError, initialize, load_pretrained  # noqa: E402
from tests.offload import hf_models as hf  # noqa: E402


def _saved(kind: str, where, sharded: bool) -> torch.nn.Module:
    """The model built with seed 5, saved by transformers' save_pretrained (Mixtral: its experts one tensor each,
    which load_pretrained converts into the model's fused experts as transformers does)."""
    src = hf.build(kind, seed=5)
    src.save_pretrained(where, max_shard_size="20KB" if sharded else "1GB")
    assert (where / "model.safetensors.index.json").exists() == sharded
    return src


def _gathered_state(engine, net) -> dict[str, torch.Tensor]:
    with engine.stage3.coordinator.gathered():
        return {k: v.detach().clone() for k, v in net.state_dict().items()}


@pytest.mark.parametrize("device", ["cpu", "nvme"])
@pytest.mark.parametrize("sharded", [False, True])
@pytest.mark.parametrize("kind", ["gpt2", "llama", "mixtral"])
def test_loads_into_stage3_shards_and_trains_as_torch(tmp_path, kind, sharded, device):
    src = _saved(kind, tmp_path / "ckpt", sharded)
    config = hf.engine_config(3, device, str(tmp_path))
    net = hf.build_meta(kind, config)
    report = load_pretrained(net, tmp_path / "ckpt")
    assert report.missing_keys == () and report.unexpected_keys == ()
    engine, _, _, _ = initialize(model=net, config=config)
    try:
        got = _gathered_state(engine, net)
        for key, value in src.state_dict().items():
            assert torch.equal(got[key], value), key
        if kind == "gpt2":
            assert net.lm_head.weight is net.transformer.wte.weight
        data = hf.batches(4)
        losses = hf.engine_losses(engine, data)
    finally:
        engine.close()
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(hf.torch_losses(src, data)), rtol=1e-5, atol=0)


def test_two_rank_pieces_cover_each_tensor(tmp_path):
    """Each rank reads only its piece of every unit: the two ranks' shards put together are the checkpoint."""
    from offload.hf.names import Source
    from offload.hf.load import SafetensorsCheckpoint, PendingLoad, load_into_shards
    from offload.zero.layout import FlatLayout

    src = _saved("llama", tmp_path / "ckpt", True)
    ckpt = SafetensorsCheckpoint(tmp_path / "ckpt")
    named = list(src.named_parameters())
    flats = []
    for rank in (0, 1):
        layout = FlatLayout([(n, tuple(p.shape), 0) for n, p in named], world_size=2, rank=rank,
                            bucket_numel=3000, sub_group_numel=4096)
        parts = {b.index: torch.full((b.shard_numel,), float("nan")) for b in layout.buckets}

        class Shards:
            def acquire(self, u):
                return parts[u]

            def release(self, u, *, dirty):
                assert dirty

        sources = {n: Source(tuple(p.shape), ((n, p.numel()),)) for n, p in named}
        load_into_shards(PendingLoad(ckpt, sources, {}), layout, Shards())
        flats.append((layout, parts))
    layout = flats[0][0]
    for b in layout.buckets:
        whole = torch.cat([flats[0][1][b.index], flats[1][1][b.index]])
        for i in b.slots:
            slot = layout.slots[i]
            got = whole[slot.offset - b.start:slot.offset - b.start + slot.numel].view(slot.shape)
            assert torch.equal(got, src.get_parameter(slot.name).detach()), slot.name


def test_bf16_engine_gets_the_weights_cast(tmp_path):
    src = _saved("llama", tmp_path / "ckpt", True)
    config = {**hf.engine_config(3, "cpu", str(tmp_path)), "bf16": {"enabled": True}}
    net = hf.build_meta("llama", config)
    load_pretrained(net, tmp_path / "ckpt")
    engine, _, _, _ = initialize(model=net, config=config)
    try:
        got = _gathered_state(engine, net)
    finally:
        engine.close()
    for name, p in src.named_parameters():
        assert got[name].dtype == torch.bfloat16
        assert torch.equal(got[name], p.detach().to(torch.bfloat16)), name


def test_missing_and_unexpected_keys_are_reported(tmp_path):
    """A file without the final norm and with an extra tensor: both reported; the norm keeps the model's init
    (the plain build's with the same seed), every other tensor is the file's."""
    src = hf.build("llama", seed=5)
    state = {k: v.detach().clone() for k, v in src.state_dict().items() if k != "model.norm.weight"}
    state["extra.weight"] = torch.ones(3)
    safetensors_torch.save_file(state, str(tmp_path / "model.safetensors"))
    config = hf.engine_config(3, "cpu", str(tmp_path))
    net = hf.build_meta("llama", config)
    report = load_pretrained(net, tmp_path)
    assert report.missing_keys == ("model.norm.weight",)
    assert report.unexpected_keys == ("extra.weight",)
    engine, _, _, _ = initialize(model=net, config=config)
    try:
        got = _gathered_state(engine, net)
    finally:
        engine.close()
    plain = hf.build("llama", seed=0)
    assert torch.equal(got["model.norm.weight"], plain.model.norm.weight.detach())
    for key, value in state.items():
        if key != "extra.weight":
            assert torch.equal(got[key], value), key


def test_plain_model_loads_at_once(tmp_path):
    src = _saved("gpt2", tmp_path, False)
    net = hf.build("gpt2", seed=0)
    load_pretrained(net, tmp_path / "model.safetensors")
    for key, value in src.state_dict().items():
        assert torch.equal(net.state_dict()[key], value), key


def test_a_tied_tensor_held_under_its_later_name_loads(tmp_path):
    """GPT-2's embedding and head are one tensor; a file holding it only as lm_head.weight (not
    transformer.wte.weight, the model's first name for it) fills it, as transformers' from_pretrained does."""
    from transformers import AutoModelForCausalLM

    src = _saved("gpt2", tmp_path, False)
    state = {k: v.detach().clone() for k, v in src.state_dict().items() if k != "transformer.wte.weight"}
    safetensors_torch.save_file(state, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    net = hf.build("gpt2", seed=0)
    report = load_pretrained(net, tmp_path)
    assert report.missing_keys == () and report.unexpected_keys == ()
    assert torch.equal(net.transformer.wte.weight, state["lm_head.weight"])
    want = AutoModelForCausalLM.from_pretrained(tmp_path).state_dict()
    for key, value in net.state_dict().items():
        assert torch.equal(value, want[key]), key


def test_bad_checkpoints_are_named(tmp_path):
    with pytest.raises(ConfigError, match="neither model.safetensors.index.json nor model.safetensors"):
        load_pretrained(hf.build("gpt2"), tmp_path)
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}}))
    with pytest.raises(ConfigError, match="no \"weight_map\""):
        load_pretrained(hf.build("gpt2"), tmp_path)
    other = hf.build("llama")
    state = {k: v.detach().clone() for k, v in other.state_dict().items()}
    state["model.norm.weight"] = torch.ones(7)
    safetensors_torch.save_file(state, str(tmp_path / "x.safetensors"))
    with pytest.raises(ConfigError, match=r"model.norm.weight: the checkpoint's shape is \[7\], the model's \[32\]"):
        load_pretrained(other, tmp_path / "x.safetensors")
    (tmp_path / "y.safetensors").write_bytes(b"\x04")
    with pytest.raises(ConfigError, match="not a safetensors file"):
        load_pretrained(other, tmp_path / "y.safetensors")


def test_a_partitioned_model_is_refused(tmp_path):
    src = _saved("gpt2", tmp_path, False)
    net = hf.build("gpt2")
    engine, _, _, _ = initialize(model=net, config=hf.engine_config(3, "cpu", str(tmp_path)))
    try:
        with pytest.raises(ConfigError, match="before offload.initialize"):
            load_pretrained(net, tmp_path)
    finally:
        engine.close()
    del src


@pytest.mark.parametrize("kind,device,stage,build", [
    ("gpt2", "cpu", 3, "from_config"), ("llama", "nvme", 3, "from_config"), ("mixtral", "cpu", 3, "from_config"),
    ("llama", "cpu", 3, "from_pretrained"), ("mixtral", "nvme", 3, "from_pretrained"),
    ("gpt2", "cpu", 0, "from_pretrained"), ("llama", "nvme", 1, "from_pretrained"), ("mixtral", "cpu", 1, "from_pretrained")])
def test_two_ranks_load_train_generate_and_save(tmp_path, kind, device, stage, build):
    """Two ranks under torchrun (gloo): at stage 3 built under init_context (from_config + load_pretrained, or
    from_pretrained inside the context), at stages 0 and 1 by plain from_pretrained, from sharded safetensors (as
    save_pretrained writes them: Mixtral's experts one tensor each); 4 steps on halves of the global batch
    (Mixtral: experts on 2 ranks), greedy generate, save_16bit_model. The mean of
    the ranks' losses is torch's full-batch loss; the params are torch's and agree across ranks; the
    tokens are torch's; from_pretrained of the saved directory holds the params."""
    import os
    import subprocess
    import sys

    from transformers import AutoModelForCausalLM
    from tests import child_pythonpath

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    src = _saved(kind, tmp_path / "ckpt", True)
    data = hf.batches(4)
    ref_losses = hf.torch_losses(src, data)
    want_tokens = src.eval().generate(hf.batches(1, seed=9)[0][:1, :4], max_new_tokens=5, do_sample=False)
    env = dict(os.environ, PYTHONPATH=child_pythonpath(root), OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--standalone",
                           os.path.join(root, "tests", "offload", "hf_worker.py"), kind, device, str(tmp_path), "4",
                           str(stage), build],
                          env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    r0, r1 = torch.load(tmp_path / "rank0.pt"), torch.load(tmp_path / "rank1.pt")
    mean = (torch.tensor(r0["losses"]) + torch.tensor(r1["losses"])) / 2
    torch.testing.assert_close(mean, torch.tensor(ref_losses), rtol=1e-5, atol=0)
    loaded = dict(AutoModelForCausalLM.from_pretrained(tmp_path / "out").named_parameters())
    for name, p in src.named_parameters():
        torch.testing.assert_close(r0["params"][name], p.detach(), rtol=1e-5, atol=5e-5)  # Adam scales ~0 grads up to lr
        assert torch.equal(r0["params"][name], r1["params"][name])
        assert torch.equal(loaded[name], r0["params"][name]), name
    assert torch.equal(r0["tokens"], want_tokens) and torch.equal(r1["tokens"], want_tokens)


@pytest.mark.skipif(not os.path.exists("/proc/self/clear_refs"), reason="needs Linux's /proc/self/clear_refs")
@pytest.mark.parametrize("build", ["from_config", "from_pretrained"])
def test_reading_into_the_shards_holds_about_one_tensor(tmp_path, build):
    """A ~30M-parameter Llama in one ~120 MB safetensors file read into stage 3's shards (params and optimizer
    on NVMe) in a fresh process (the model built under init_context by AutoModelForCausalLM.from_config +
    load_pretrained, or by from_pretrained itself): the peak resident set (VmHWM, reset as the read starts) grows
    by less than two of the largest tensor (16 MiB each): one piece read, plus allocator slack. Measured on a
    shared machine: from_config 0.1 to 10.3 MiB over 4 runs; from_pretrained 0.1 to 19.4 MiB over 6 runs, 2 of
    them above one tensor (not traced; a piece placed on a fragmented heap once glibc has raised its mmap
    threshold would do it). Holding the file would add its 119 MiB."""
    import subprocess
    import sys

    from transformers import LlamaConfig, LlamaForCausalLM
    from tests import child_pythonpath

    model_config = LlamaConfig(num_hidden_layers=8, hidden_size=512, intermediate_size=1376, num_attention_heads=4,
                               num_key_value_heads=2, vocab_size=8000, max_position_embeddings=32,
                               tie_word_embeddings=False)
    torch.manual_seed(0)
    LlamaForCausalLM(model_config).save_pretrained(tmp_path / "ckpt")
    file_bytes = os.path.getsize(tmp_path / "ckpt" / "model.safetensors")
    largest = 4 * 8000 * 512
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = dict(os.environ, PYTHONPATH=child_pythonpath(root), OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, os.path.join(root, "tests", "offload", "hf_load_worker.py"),
                           str(tmp_path / "ckpt"), str(tmp_path), build], env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    (growth,) = json.loads(proc.stdout.strip().splitlines()[-1])["growth"]
    print(f"read into the shards: +{growth / 2**20:.1f} MiB peak; largest tensor {largest >> 20} MiB, "
          f"file {file_bytes >> 20} MiB")
    assert file_bytes > 6 * largest
    assert growth < 2 * largest, growth
