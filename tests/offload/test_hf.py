"""Hugging Face models under the engine, against plain torch: GPT-2 (Conv1D, tied head) and Llama (RMSNorm,
rotary buffers, GQA) and Mixtral (experts) built under init_context get the weights of the plain build with the same seed without
being held whole, and train as torch.optim.AdamW does at stages 0 to 3 with cpu and nvme offload, built
plainly or under init_context, with gradient checkpointing at stage 3."""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers", reason="transformers is not installed (pip install .[hf])")

from offload import ConfigError, init_context, initialize  # noqa: E402
from tests.offload import hf_models as hf  # noqa: E402

STEPS = 8


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_init_context_gives_the_plain_build_weights_never_held_whole(tmp_path, kind):
    """Every tensor of the state dict (tied head and rotary buffers included) equals the plain build's with
    the same seed, and materializing held less than the whole model."""
    config = hf.engine_config(3, "nvme", str(tmp_path))
    ref = hf.build(kind)
    net = hf.build_meta(kind, config)
    assert all(p.is_meta for p in net.parameters())
    engine, _, _, _ = initialize(model=net, config=config)
    try:
        with engine.stage3.coordinator.gathered():
            got = {k: v.detach().clone() for k, v in net.state_dict().items()}
        want = ref.state_dict()
        assert got.keys() == want.keys()
        for key, value in want.items():
            assert torch.equal(got[key], value), key
        total = 4 * sum(p.numel() for p in ref.parameters())  # (net's released params are empty here)
        assert 0 < engine.stage3.materialize_peak_bytes < total
    finally:
        engine.close()


def test_init_context_follows_the_seed():
    """A different seed gives different weights (the replay draws, it does not copy a fixed tensor)."""
    config = hf.engine_config(3, "cpu", "")
    nets = []
    for seed in (0, 1):
        torch.manual_seed(seed)
        with init_context(config):
            nets.append(hf.GPT2LMHeadModel(hf.gpt2_config()))
    engines = [initialize(model=n, config=config)[0] for n in nets]
    try:
        with engines[0].stage3.coordinator.gathered(), engines[1].stage3.coordinator.gathered():
            assert not torch.equal(nets[0].transformer.wte.weight, nets[1].transformer.wte.weight)
    finally:
        for e in engines:
            e.close()


@pytest.mark.parametrize("built", ["plain", "init_context"])
@pytest.mark.parametrize("device", ["cpu", "nvme"])
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
@pytest.mark.parametrize("kind", ["gpt2", "llama", "mixtral"])
def test_trains_as_torch(tmp_path, kind, stage, device, built):
    """fp32 losses over 8 steps equal torch.optim.AdamW's (clipping on) to 1e-5 relative. Mixtral: 4 experts,
    top-1 routing, so experts see few or no tokens in a step."""
    if built == "init_context" and stage != 3:
        pytest.skip("init_context is stage 3's")
    data = hf.batches(STEPS)
    ref_losses = hf.torch_losses(hf.build(kind), data)
    config = hf.engine_config(stage, device, str(tmp_path))
    net = hf.build(kind) if built == "plain" else hf.build_meta(kind, config)
    engine, _, _, _ = initialize(model=net, config=config)
    try:
        losses = hf.engine_losses(engine, data)
    finally:
        engine.close()
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-5, atol=0)


@pytest.mark.filterwarnings("ignore:`gradient_checkpointing_enable` is deprecated")
@pytest.mark.parametrize("reentrant", [False, True])
@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_gradient_checkpointing_at_stage_3(tmp_path, kind, reentrant):
    """model.gradient_checkpointing_enable() under stage 3, params on NVMe: every layer runs forward twice a
    step (the recompute gathers its units again: v5 checkpoints a layer's forward, inside its hooks) and the losses stay torch's (run without checkpointing)."""
    data = hf.batches(STEPS)
    ref_losses = hf.torch_losses(hf.build(kind), data)
    net = hf.build(kind)
    net.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
    net.train()
    layers = net.transformer.h if kind == "gpt2" else net.model.layers
    calls = []
    layers[0].mlp.register_forward_pre_hook(lambda *_: calls.append(1))  # inside the checkpointed forward
    engine, _, _, _ = initialize(model=net, config=hf.engine_config(3, "nvme", str(tmp_path)))
    try:
        losses = hf.engine_losses(engine, data)
    finally:
        engine.close()
    assert len(calls) == 2 * STEPS
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-5, atol=0)


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_generate_at_stage_3(tmp_path, kind):
    """model.generate() on the engine's model (params on NVMe, gathered as it goes) after 3 steps: the tokens
    torch's model generates after the same 3 steps."""
    data = hf.batches(3)
    ref = hf.build(kind)
    hf.torch_losses(ref, data)
    prompt = hf.batches(1, seed=9)[0][:2, :4]
    want = ref.eval().generate(prompt, max_new_tokens=6, do_sample=False)
    net = hf.build(kind)
    engine, _, _, _ = initialize(model=net, config=hf.engine_config(3, "nvme", str(tmp_path)))
    try:
        hf.engine_losses(engine, data)
        net.eval()
        got = net.generate(prompt, max_new_tokens=6, do_sample=False)
        net.train()
        losses = hf.engine_losses(engine, hf.batches(1, seed=4))  # training goes on after generating
    finally:
        engine.close()
    assert torch.equal(got, want)
    assert len(losses) == 1


def _custom_model_classes():
    """A PreTrainedModel whose _init_weights writes through `.data` views and, with `scale`, has a parameter
    that no _init_weights sets (its value comes only from its constructor)."""
    from transformers import PretrainedConfig, PreTrainedModel

    class Config(PretrainedConfig):
        model_type = "offload-test"

        def __init__(self, scale: bool = False, **kwargs):
            self.scale = scale
            super().__init__(**kwargs)

    class Net(PreTrainedModel):
        config_class = Config

        def __init__(self, config):
            super().__init__(config)
            self.inner = torch.nn.Linear(8, 8)
            self.outer = torch.nn.Linear(8, 8)
            if config.scale:
                self.scale = torch.nn.Parameter(torch.randn(8))
            self.post_init()

        def _init_weights(self, module):
            if isinstance(module, torch.nn.Linear):
                module.weight.data.normal_(0.0, 0.5)  # old-style: through .data
                module.bias.data[:4].fill_(1.0)  # a view of a view
                module.bias.data[4:].zero_()

        def forward(self, x):
            return self.outer(self.inner(x))

    return Config, Net


def test_init_replay_follows_views_and_names_what_it_cannot_set():
    Config, Net = _custom_model_classes()
    config = hf.engine_config(3, "cpu", "")
    torch.manual_seed(3)
    ref = Net(Config())
    torch.manual_seed(3)
    with init_context(config):
        net = Net(Config())
    engine, _, _, _ = initialize(model=net, config=config)
    try:
        with engine.stage3.coordinator.gathered():
            for key, value in ref.state_dict().items():
                assert torch.equal(net.state_dict()[key], value), key
    finally:
        engine.close()
    with init_context(config):
        odd = Net(Config(scale=True))
    with pytest.raises(ConfigError, match=r"stage 3 cannot initialize scale: the model's _init_weights does not"):
        initialize(model=odd, config=config)


@pytest.mark.parametrize("device", ["cpu", "nvme"])
@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_bf16_trains_as_the_mixed_precision_oracle(tmp_path, kind, device):
    """bf16 at stage 3 under init_context: every step's loss within 2^-5 relative of plain torch's bf16 compute
    with fp32 AdamW masters ([Note: low-precision tolerance] in tests/offload/test_precision.py)."""
    data = hf.batches(STEPS)
    ref_losses = hf.torch_mixed_losses(hf.build(kind), data, torch.bfloat16)
    config = {**hf.engine_config(3, device, str(tmp_path)), "bf16": {"enabled": True}}
    net = hf.build_meta(kind, config)
    engine, _, _, _ = initialize(model=net, config=config)
    try:
        losses = hf.engine_losses(engine, data)
    finally:
        engine.close()
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=2.0 ** -5, atol=0)
