"""[Note: external parameters]: a module whose forward reads a parameter another module owns
trains under stage 3 like plain torch once it registers it, built plainly or on the meta device."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from csrc import ConfigError
from offload import init_context, initialize, register_external_parameter, unregister_external_parameter
from offload.zero.external import external_parameters
from tests.offload import stage3_worker as w

VOCAB, DIM, SEQ = 48, 32, 10


class TiedLM(torch.nn.Module):
    """Embedding, one MLP block, and logits from the embedding's weight read in the parent's forward."""

    def __init__(self, register: bool = True) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(VOCAB, DIM)
        self.up = torch.nn.Linear(DIM, 4 * DIM)
        self.down = torch.nn.Linear(4 * DIM, DIM)
        if register:
            register_external_parameter(self, self.emb.weight)

    def forward(self, ids: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        h = self.emb(ids)
        h = h + self.down(F.gelu(self.up(h)))
        logits = h @ self.emb.weight.t()
        return F.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1))


def _data(n: int):
    g = torch.Generator().manual_seed(11)
    return [torch.randint(0, VOCAB, (4, SEQ + 1), generator=g) for _ in range(n)]


def _config(param_device: str, path: str) -> dict:
    config = w.config("cpu", param_device, path)
    config["train_batch_size"] = 4
    return config


def _torch_losses(net, data):
    opt = torch.optim.AdamW(net.parameters(), lr=3e-3, weight_decay=0.01)
    losses = []
    for ids in data:
        opt.zero_grad()
        loss = net(ids[:, :-1], ids[:, 1:])
        loss.backward()
        torch.nn.utils.clip_grad_norm_(net.parameters(), 1.0)
        opt.step()
        losses.append(loss.item())
    return losses


def _engine_losses(engine, data):
    losses = []
    for ids in data:
        loss = engine(ids[:, :-1], ids[:, 1:])
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize("param_device", ["cpu", "nvme"])
@pytest.mark.parametrize("meta", [False, True])
def test_registered_external_parameter_trains_like_torch(tmp_path, param_device, meta):
    data = _data(5)
    torch.manual_seed(3)
    ref = _torch_losses(TiedLM(), data)
    config = _config(param_device, str(tmp_path))
    torch.manual_seed(3)
    if meta:
        with init_context(config):
            net = TiedLM()
        torch.manual_seed(3)  # initialize draws the values in the order the plain build did
    else:
        net = TiedLM()
    engine, _, _, _ = initialize(model=net, config=config)
    try:
        torch.testing.assert_close(torch.tensor(_engine_losses(engine, data)), torch.tensor(ref), rtol=1e-5, atol=0)
        with engine.stage3.coordinator.gathered():
            assert external_parameters(net)[0] is net.emb.weight  # followed through the meta build
    finally:
        engine.close()


def test_unregistered_external_read_names_the_fix(tmp_path):
    """Without the registration the parent's read of the released weight fails, with an error that
    names register_external_parameter: nothing trains on garbage."""
    torch.manual_seed(3)
    engine, _, _, _ = initialize(model=TiedLM(register=False), config=_config("cpu", str(tmp_path)))
    try:
        ids = _data(1)[0]
        with pytest.raises(ConfigError, match="register_external_parameter"):
            engine(ids[:, :-1], ids[:, 1:])
    finally:
        engine.close()


def test_register_and_unregister_errors():
    net = TiedLM(register=False)
    register_external_parameter(net, net.emb.weight)
    register_external_parameter(net, net.emb.weight)  # twice is once
    assert external_parameters(net) == (net.emb.weight,)
    unregister_external_parameter(net, net.emb.weight)
    assert external_parameters(net) == ()
    with pytest.raises(ConfigError, match="not registered"):
        unregister_external_parameter(net, net.emb.weight)
    with pytest.raises(ConfigError, match="torch.nn.Parameter"):
        register_external_parameter(net, torch.zeros(3))
    with pytest.raises(ConfigError, match="torch.nn.Module"):
        register_external_parameter("net", net.emb.weight)


class StockAttention(torch.nn.Module):
    """torch's MultiheadAttention reads its out_proj's weight in its own forward, unregistered."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(VOCAB, DIM)
        self.attn = torch.nn.MultiheadAttention(DIM, 4, batch_first=True)

    def forward(self, ids: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        h = self.emb(ids)
        h = self.attn(h, h, h, need_weights=False)[0]
        return F.cross_entropy((h @ self.emb.weight.t()).reshape(-1, VOCAB), targets.reshape(-1))


@pytest.mark.parametrize("net, reader, param, owner", [
    (StockAttention, "'attn' (MultiheadAttention)", "'attn.out_proj.weight'", "'attn.out_proj'"),
    (lambda: TiedLM(register=False), "'the model' (TiedLM)", "'emb.weight'", "'emb'"),
])
def test_unregistered_read_names_the_parameter_and_the_reader(tmp_path, net, reader, param, owner):
    torch.manual_seed(3)
    engine, _, _, _ = initialize(model=net(), config=_config("cpu", str(tmp_path)))
    try:
        ids = _data(1)[0]
        with pytest.raises(ConfigError) as raised:
            engine(ids[:, :-1], ids[:, 1:])
        text = str(raised.value)
        assert f"the forward of {reader} read parameter {param}, which module {owner} owns" in text, text
    finally:
        engine.close()


def test_stage3_logs_partitioned_and_whole_counts(tmp_path, caplog):
    """One line per build with the params partitioned and kept whole (counted here from their sizes);
    a warning when the default threshold (100000 elements) leaves a small model whole."""
    caplog.set_level("INFO", logger="offload.zero.stage3")
    for threshold in (100, None):
        caplog.clear()
        config = _config("cpu", str(tmp_path))
        if threshold is None:
            del config["zero_optimization"]["stage3_param_persistence_threshold"]
        net = TiedLM()
        sizes = {n: p.numel() for n, p in net.named_parameters()}
        big = [n for n, size in sizes.items() if size >= (threshold or 100_000)]
        units = len({n.rpartition(".")[0] for n in big})
        expected = f"{len(big)} param(s) partitioned in {units} unit(s), {len(sizes) - len(big)} kept whole"
        engine, _, _, _ = initialize(model=net, config=config)
        engine.close()
        lines = [r for r in caplog.records if "stage 3:" in r.getMessage()]
        assert len(lines) == 1 and expected in lines[0].getMessage(), [r.getMessage() for r in lines]
        assert (lines[0].levelname == "WARNING") == (not big)
