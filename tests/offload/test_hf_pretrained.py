"""from_pretrained inside offload.init_context (stage 3): transformers' own from_pretrained of a local directory
written by save_pretrained (one file or sharded; Mixtral's per-expert tensors) builds the model on the meta
device, and the engine reads the checkpoint into its shards (cpu, nvme). The oracle is transformers' plain
from_pretrained of the same directory: the same weights and logits, the same missing and unexpected keys, and
training from it as torch.optim.AdamW does. Saving back writes the names save_pretrained writes."""
from __future__ import annotations

import os

import pytest
import torch

pytest.importorskip("transformers", reason="transformers is not installed (pip install .[hf])")
safetensors_torch = pytest.importorskip("safetensors.torch", reason="safetensors is not installed (pip install .[hf])")

from transformers import AutoModelForCausalLM, PreTrainedModel  # noqa: E402

from offload import ConfigError, init_context, initialize  # noqa: E402
from tests.offload import hf_models as hf  # noqa: E402


def _save(kind: str, where, sharded: bool) -> None:
    hf.build(kind, seed=5).save_pretrained(where, max_shard_size="20KB" if sharded else "1GB")
    assert (where / "model.safetensors.index.json").exists() == sharded


def _gathered(engine, net) -> dict[str, torch.Tensor]:
    with engine.stage3.coordinator.gathered():
        return {k: v.detach().clone() for k, v in net.state_dict().items()}


def _initialized_state(net, config) -> dict[str, torch.Tensor]:
    """The state dict of ``net`` after initialize (built in the context), the engine closed."""
    engine, _, _, _ = initialize(model=net, config=config)
    try:
        return _gathered(engine, net)
    finally:
        engine.close()


def _logits(model, ids) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=ids).logits


@pytest.mark.parametrize("kind,device,sharded", [("gpt2", "cpu", False), ("gpt2", "nvme", True),
                                                 ("llama", "cpu", True), ("llama", "nvme", False),
                                                 ("mixtral", "cpu", True), ("mixtral", "nvme", False)])
def test_from_pretrained_in_context_is_plain_from_pretrained(tmp_path, kind, device, sharded):
    """Never held whole (every parameter on the meta device until initialize); then every tensor of the state dict
    (tied head, rotary buffers, fused experts) equals plain from_pretrained's, the logits are its logits, and 4
    steps give the losses torch gives from plain from_pretrained's model."""
    _save(kind, tmp_path / "ckpt", sharded)
    plain = AutoModelForCausalLM.from_pretrained(tmp_path / "ckpt")
    ids = hf.batches(1, seed=9)[0]
    config = hf.engine_config(3, device, str(tmp_path))
    with init_context(config):
        net = AutoModelForCausalLM.from_pretrained(tmp_path / "ckpt")
    assert type(net) is type(plain) and all(p.is_meta for p in net.parameters())
    engine, _, _, _ = initialize(model=net, config=config)
    try:
        got = _gathered(engine, net)
        assert got.keys() == plain.state_dict().keys()
        for key, value in plain.state_dict().items():
            assert torch.equal(got[key], value), key
        if kind == "gpt2":
            assert net.lm_head.weight is net.transformer.wte.weight
        torch.testing.assert_close(_logits(engine, ids), _logits(plain, ids), rtol=0, atol=0)
        net.train()
        data = hf.batches(4)
        losses = hf.engine_losses(engine, data)
    finally:
        engine.close()
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(hf.torch_losses(plain.train(), data)), rtol=1e-5,
                               atol=0)


def test_model_class_from_pretrained_and_from_config_agree(tmp_path):
    """LlamaForCausalLM.from_pretrained in the context and from_config + load_pretrained give the same shards."""
    from transformers import AutoConfig

    from offload import load_pretrained

    _save("llama", tmp_path / "ckpt", True)
    config = hf.engine_config(3, "cpu", str(tmp_path))
    with init_context(config):
        a = hf.LlamaForCausalLM.from_pretrained(tmp_path / "ckpt")
        b = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(tmp_path / "ckpt"))
    load_pretrained(b, tmp_path / "ckpt")
    got = [_initialized_state(m, config) for m in (a, b)]
    assert got[0].keys() == got[1].keys()
    for key in got[0]:
        assert torch.equal(got[0][key], got[1][key]), key


def test_missing_and_unexpected_keys_as_plain_from_pretrained(tmp_path):
    """A file without the final norm and with an extra tensor: output_loading_info has the keys plain
    from_pretrained reports; the norm keeps the model's init."""
    state = {k: v.detach().clone() for k, v in hf.build("llama", seed=5).state_dict().items()
             if k != "model.norm.weight"}
    state["extra.weight"] = torch.ones(3)
    hf.llama_config().save_pretrained(tmp_path)
    safetensors_torch.save_file(state, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    _, want = AutoModelForCausalLM.from_pretrained(tmp_path, output_loading_info=True)
    config = hf.engine_config(3, "cpu", str(tmp_path))
    with init_context(config):
        net, info = AutoModelForCausalLM.from_pretrained(tmp_path, output_loading_info=True)
    assert set(info["missing_keys"]) == set(want["missing_keys"]) == {"model.norm.weight"}
    assert set(info["unexpected_keys"]) == set(want["unexpected_keys"]) == {"extra.weight"}
    got = _initialized_state(net, config)
    for key, value in state.items():
        if key != "extra.weight":
            assert torch.equal(got[key], value), key


def test_what_it_cannot_read_is_refused_and_transformers_is_left_as_it_was(tmp_path):
    """A .bin checkpoint, state_dict= and device_map are refused by name; outside the context from_pretrained
    is transformers' own again (it loads the .bin)."""
    src = hf.build("gpt2", seed=5)
    hf.gpt2_config().save_pretrained(tmp_path)
    torch.save(src.state_dict(), tmp_path / "pytorch_model.bin")
    config = hf.engine_config(3, "cpu", str(tmp_path))
    with pytest.raises(ConfigError, match=r"pytorch_model.bin is not a .safetensors file"):
        with init_context(config):
            AutoModelForCausalLM.from_pretrained(tmp_path)
    with pytest.raises(ConfigError, match=r"device_map= places the weights itself"):
        with init_context(config):
            AutoModelForCausalLM.from_pretrained(tmp_path, device_map="cpu")
    with pytest.raises(ConfigError, match=r"state_dict= is not read"):
        with init_context(config):
            hf.GPT2LMHeadModel.from_pretrained(None, config=hf.gpt2_config(), state_dict=src.state_dict())
    assert "from_pretrained" not in vars(PreTrainedModel) or \
        vars(PreTrainedModel)["from_pretrained"].__func__.__module__ == "transformers.modeling_utils"
    plain = AutoModelForCausalLM.from_pretrained(tmp_path)
    assert torch.equal(plain.transformer.wte.weight, src.transformer.wte.weight)


@pytest.mark.parametrize("device", ["cpu", "nvme"])
def test_mixtral_saved_back_under_save_pretrained_names(tmp_path, device):
    """Mixtral loaded from per-expert tensors (as its save_pretrained writes them), trained 2 steps, saved by
    save_16bit_model: the files hold exactly the names save_pretrained writes for the trained model, from_pretrained
    of them gives the engine's logits, and from_pretrained of them inside init_context gives the same shards."""
    from safetensors import safe_open

    _save("mixtral", tmp_path / "ckpt", True)
    (tmp_path / "nv").mkdir()
    config = hf.engine_config(3, device, str(tmp_path / "nv"))
    with init_context(config):
        net = AutoModelForCausalLM.from_pretrained(tmp_path / "ckpt")
    engine, _, _, _ = initialize(model=net, config=config)
    ids = hf.batches(1, seed=9)[0]
    try:
        net.train()
        hf.engine_losses(engine, hf.batches(2))
        engine.save_16bit_model(str(tmp_path / "out"), max_shard_size_bytes=24 * 1024)
        trained = _gathered(engine, net)
        logits = _logits(engine, ids)
    finally:
        engine.close()
    written = set()
    for name in os.listdir(tmp_path / "out"):
        if name.endswith(".safetensors"):
            with safe_open(str(tmp_path / "out" / name), "pt") as f:
                written |= set(f.keys())
    reference = hf.build("mixtral")
    reference.load_state_dict(trained)
    reference.save_pretrained(tmp_path / "ref")
    with safe_open(str(tmp_path / "ref" / "model.safetensors"), "pt") as f:
        assert written == set(f.keys())
    assert "model.layers.0.block_sparse_moe.experts.3.w3.weight" in written
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "out")
    torch.testing.assert_close(_logits(loaded, ids), logits, rtol=0, atol=0)
    with init_context(config):
        again = AutoModelForCausalLM.from_pretrained(tmp_path / "out")
    back = _initialized_state(again, config)
    for key, value in trained.items():
        assert torch.equal(back[key], value), key


def test_key_mapping_renames_and_unstreamable_conversions_are_refused(tmp_path):
    """from_pretrained(key_mapping=...) inside the context renames the checkpoint's keys as plain from_pretrained
    does (the same weights); a conversion whose result is not its sources laid end to end (a transpose) is
    refused by name rather than read whole."""
    from transformers.core_model_loading import Transpose, WeightConverter

    from offload import load_pretrained

    src = hf.build("llama", seed=5)
    state = {k.replace("self_attn", "attn"): v.detach().clone() for k, v in src.state_dict().items()}
    hf.llama_config().save_pretrained(tmp_path)
    safetensors_torch.save_file(state, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    mapping = {r"\.attn\.": ".self_attn."}
    plain = AutoModelForCausalLM.from_pretrained(tmp_path, key_mapping=mapping)
    config = hf.engine_config(3, "cpu", str(tmp_path))
    with init_context(config):
        net = AutoModelForCausalLM.from_pretrained(tmp_path, key_mapping=mapping)
    got = _initialized_state(net, config)
    for key, value in plain.state_dict().items():
        assert torch.equal(got[key], value), key
        assert torch.equal(value, src.state_dict()[key]), key
    with init_context(config):
        net = AutoModelForCausalLM.from_config(hf.llama_config())
    transpose = WeightConverter(source_patterns=r"\.attn\.o_proj\.weight", target_patterns=".self_attn.o_proj.weight",
                                operations=[Transpose(0, 1)])
    with pytest.raises(ConfigError, match=r"cannot read model.layers.0.self_attn.o_proj.weight piece by piece: "
                                          r".*\['Transpose'\]"):
        load_pretrained(net, tmp_path, conversions=[transpose])
