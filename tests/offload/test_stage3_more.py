"""Stage 3 beyond the basics: gradients held per unit (never a full-size buffer), tight NVMe windows
with shards of mixed sizes, gradient accumulation, and the offload_param settings that have no effect."""
from __future__ import annotations

import logging
import os
import subprocess
import sys

import pytest
import torch

from offload import init_context, initialize
from offload.models.gpt import GPT, GPTConfig
from tests import child_pythonpath
from tests.offload import stage3_worker as w

VOCAB, SEQ = 40, 12


def _gpt() -> GPT:
    return GPT(GPTConfig(vocab_size=VOCAB, block_size=SEQ, n_layer=2, n_head=2, n_embd=32), seed=3)


def _data(n: int, batch: int = 4):
    g = torch.Generator().manual_seed(5)
    return [torch.randint(0, VOCAB, (batch, SEQ + 1), generator=g) for _ in range(n)]


def _config(opt: str, param: str, path: str, **zero) -> dict:
    config = w.config(opt, param, path, **zero)
    config["train_batch_size"] = 4
    return config


def _torch_losses(net, data, *, micro: int = 1):
    opt = torch.optim.AdamW(net.parameters(), lr=3e-3, weight_decay=0.01)
    losses = []
    for ids in data:
        opt.zero_grad()
        for chunk in ids.chunk(micro):
            loss = net(chunk[:, :-1], chunk[:, 1:])
            (loss / micro).backward()
            losses.append(loss.item())
        torch.nn.utils.clip_grad_norm_(net.parameters(), 1.0)
        opt.step()
    return losses


def _engine_losses(engine, data, *, micro: int = 1):
    losses = []
    for ids in data:
        for chunk in ids.chunk(micro):
            loss = engine(chunk[:, :-1], chunk[:, 1:])
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
    return losses


def test_tight_nvme_windows_with_mixed_shards_match_torch(tmp_path):
    """offload_param nvme with buffer_count 1 (three shards in host memory) and one optimizer sub-group
    spanning every unit: the shards (of five sizes) come and go through a pool of per-shard segments, the
    first fetch of a step is not crowded out by its prefetches, and Adam writes each shard before the next
    is asked for. 12 steps match torch.optim.AdamW to 1e-5, and the shards went through NVMe."""
    data = _data(12)
    ref = _torch_losses(_gpt(), data)
    config = _config("nvme", "nvme", str(tmp_path), sub_group_size=10 ** 6)
    config["zero_optimization"]["offload_param"]["buffer_count"] = 1
    engine, _, _, _ = initialize(model=_gpt(), config=config)
    try:
        sizes = {b.shard_numel for b in engine.stage3.layout.buckets}
        assert len(sizes) >= 4 and len(engine.layout.sub_groups) == 1
        torch.testing.assert_close(torch.tensor(_engine_losses(engine, data)), torch.tensor(ref), rtol=1e-5, atol=0)
        assert engine.stage3.param_tier.store.stats().bytes_read_total > 0
    finally:
        engine.close()


def test_gradients_are_held_per_unit_never_whole(tmp_path):
    """After backward no parameter holds a gradient, and the unit gradient buffers held nothing: one
    rank on the CPU lands each unit from its params' gradients ([Note: gradients landed from the
    params]; ranks that reduce-scatter still fill one buffer per unit)."""
    net = _gpt()
    engine, _, _, _ = initialize(model=net, config=_config("cpu", "cpu", str(tmp_path)))
    try:
        ids = _data(1)[0]
        loss = engine(ids[:, :-1], ids[:, 1:])
        engine.backward(loss)
        assert all(p.grad is None for p in net.parameters())
        assert engine.reducer.peak_buffer_bytes == 0 and not engine.reducer._held
        engine.step()
    finally:
        engine.close()


@pytest.mark.parametrize("param_device", ["cpu", "nvme"])
def test_gradient_accumulation_matches_torch(tmp_path, param_device):
    """Two micro-batches per step: the unit gradients of both are summed in the fp32 accumulators, as
    torch sums .grad; 6 steps to 1e-5."""
    data = _data(6)
    ref = _torch_losses(_gpt(), data, micro=2)
    config = _config("cpu", param_device, str(tmp_path))
    config["gradient_accumulation_steps"] = 2
    engine, _, _, _ = initialize(model=_gpt(), config=config)
    try:
        torch.testing.assert_close(torch.tensor(_engine_losses(engine, data, micro=2)), torch.tensor(ref),
                                   rtol=1e-5, atol=0)
    finally:
        engine.close()


def test_init_context_gpt_with_a_tied_head(tmp_path):
    """The demo's GPT built under init_context (its tied head placed with the embedding) trains like the one
    built the plain way with the same param_init_fn."""
    def init(module):
        if isinstance(module, (torch.nn.Linear, torch.nn.Embedding)):
            torch.nn.init.normal_(module.weight, 0.0, 0.02)
            if getattr(module, "bias", None) is not None:
                torch.nn.init.zeros_(module.bias)
        elif isinstance(module, torch.nn.LayerNorm):
            torch.nn.init.ones_(module.weight)
            torch.nn.init.zeros_(module.bias)

    config = _config("nvme", "nvme", str(tmp_path))
    torch.manual_seed(7)
    with init_context(config, param_init_fn=init):
        meta = _gpt()
    torch.manual_seed(7)
    plain = _gpt()
    for module in plain.modules():
        if module is not plain.head:  # the head is the embedding: the engine keeps the embedding's values
            init(module)
    data = _data(4)
    ref = _torch_losses(plain, data)
    torch.manual_seed(7)  # initialize draws the values now, in the order the plain build did
    engine, _, _, _ = initialize(model=meta, config=config)
    try:
        torch.testing.assert_close(torch.tensor(_engine_losses(engine, data)), torch.tensor(ref), rtol=1e-5, atol=0)
    finally:
        engine.close()


@pytest.mark.parametrize("param_device", ["cpu", "nvme"])
def test_offload_param_settings_without_effect_are_said_once(tmp_path, caplog, param_device):
    with caplog.at_level(logging.INFO, logger="offload.builder"):
        engine, _, _, _ = initialize(model=_gpt(), config=_config("cpu", param_device, str(tmp_path)))
        engine.close()
    said = [r.getMessage() for r in caplog.records if "no effect" in r.getMessage()]
    assert sum("offload_param.buffer_size" in m for m in said) == 1
    assert sum("max_in_cpu" in m for m in said) == 1


@pytest.mark.parametrize("param_device", ["cpu", "nvme"])
def test_consolidate_a_stage3_checkpoint_with_a_tied_head(tmp_path, param_device):
    """Stage 3 (params on cpu or NVMe), a GPT whose head is its token embedding: `offload consolidate` of a
    checkpoint gives a plain state dict with every key of the model's (the head too), equal to the trained
    weights gathered from the engine (fp32: exactly), that a plainly built GPT loads strictly."""
    from offload.cli import main

    net = _gpt()
    engine, _, _, _ = initialize(model=net, config=_config("nvme", param_device, str(tmp_path)))
    try:
        _engine_losses(engine, _data(3))
        ckpt = engine.save_checkpoint(str(tmp_path / "ckpt"))
        with engine.stage3.coordinator.gathered():
            expected = {k: v.detach().clone() for k, v in net.state_dict().items()}
    finally:
        engine.close()
    out = tmp_path / "plain.pt"
    assert main(["consolidate", ckpt, str(out)]) == 0
    got = torch.load(out)
    assert list(got) == list(expected) and "head.weight" in got
    for key, value in expected.items():
        assert torch.equal(got[key], value), key
    plain = _gpt()
    plain.load_state_dict(got, strict=True)
    assert torch.equal(plain.head.weight, plain.tok_emb.weight)


@pytest.mark.parametrize("param_device", ["cpu", "nvme"])
def test_param_shards_go_through_the_daemon(tmp_path, monkeypatch, param_device):
    """With a daemon, the param shards are a session of their own ("<job>.params") beside the optimizer's:
    their NVMe -> host leg is the daemon's. Training matches the embedded store bit for bit, the shards'
    bytes moved through the daemon (nvme), and both sessions are gone after close."""
    from tests.daemon.conftest import STORE, start_daemon

    if STORE != "swap":
        pytest.skip("needs the real swap layer in the daemon")
    data = _data(6)
    config = _config("nvme", param_device, str(tmp_path))
    embedded, _, _, _ = initialize(model=_gpt(), config=config)
    try:
        ref = _engine_losses(embedded, data)
        assert not embedded.stage3.param_tier.daemon
    finally:
        embedded.close()
    daemon = start_daemon(pool={"capacity_bytes": 64 << 20, "segment_bytes": 4 << 20},
                          sessions={"default_quota_bytes": 8 << 20})
    try:
        monkeypatch.setenv("OFFLOAD_DAEMON_SOCKET", daemon.socket_path)
        config["offload"] = {"job_id": "s3-job"}
        engine, _, _, _ = initialize(model=_gpt(), config=config)
        try:
            assert engine.stage3.param_tier.daemon
            assert sorted(s["job_id"] for s in daemon.status()["sessions"]) == ["s3-job", "s3-job.params"]
            assert _engine_losses(engine, data) == ref
            if param_device == "nvme":
                io = engine.stage3.param_tier.store.stats()
                assert io.bytes_written_total > 0 and io.bytes_read_total > 0
        finally:
            engine.close()
        assert daemon.status()["sessions"] == []
    finally:
        daemon.stop()


@pytest.mark.parametrize("stage,gather", [(3, False), (3, True), (2, False)])
def test_save_16bit_model(tmp_path, stage, gather):
    """DeepSpeed's save_16bit_model: stage 3 writes nothing and says False unless
    stage3_gather_16bit_weights_on_model_save; then (and always with stage 2) the file is the module's
    state dict in the compute dtype (bf16 here), the tied head still one tensor with the embedding, and a
    plain GPT cast to bf16 loads it strictly."""
    net = _gpt()
    config = _config("cpu", "cpu" if stage == 3 else "none", str(tmp_path), stage=stage,
                     stage3_gather_16bit_weights_on_model_save=gather)
    config["bf16"] = {"enabled": True}
    engine, _, _, _ = initialize(model=net, config=config)
    try:
        _engine_losses(engine, _data(2))
        saved = engine.save_16bit_model(str(tmp_path / "out"), "model.bin")
        assert saved == (stage != 3 or gather)
        assert (tmp_path / "out" / "model.bin").exists() == saved
        if not saved:
            return
        ctx = engine.stage3.coordinator.gathered() if stage == 3 else torch.no_grad()
        with ctx:
            expected = {k: v.detach().clone() for k, v in net.state_dict().items()}
    finally:
        engine.close()
    got = torch.load(tmp_path / "out" / "model.bin")
    assert list(got) == list(expected)
    for key, value in expected.items():
        assert got[key].dtype == torch.bfloat16 or not value.is_floating_point()
        assert torch.equal(got[key], value), key
    assert got["head.weight"].data_ptr() == got["tok_emb.weight"].data_ptr()
    plain = _gpt().to(torch.bfloat16)
    plain.load_state_dict(got, strict=True)


ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_READ_OUTSIDE_FORWARD = """
import sys, torch
from offload import initialize
from tests.offload import stage3_worker as w
net = w.model()
engine, _, _, _ = initialize(model=net, config=w.config(sys.argv[1], sys.argv[2], sys.argv[3]))
ids, targets = w.batches(1)[0]

def read_all(when):
    total = sum(float(p.detach().clone().float().sum()) for p in net.parameters())
    torch.save(net.state_dict(), sys.argv[3] + "/sd.pt")
    print(when, "numel", sum(p.numel() for p in net.parameters()), "sum", total, flush=True)

read_all("initialized")
loss = engine(ids, targets)
engine.backward(loss)
read_all("backward")
engine.step()
read_all("step")
with torch.no_grad():
    engine.eval()(ids, targets)
read_all("eval")
with torch.no_grad():
    loss = engine.module(ids, targets)  # a direct call of the module: its hooks put the params back
print("direct", float(loss), flush=True)
with engine.stage3.coordinator.gathered():
    print("gathered numel", sum(p.numel() for p in net.parameters()), flush=True)
read_all("gathered after")
engine.close()
read_all("closed")
"""


@pytest.mark.parametrize("opt_device,param_device", [("cpu", "cpu"), ("none", "none"), ("nvme", "nvme")])
def test_released_params_read_outside_forward_are_empty_not_a_crash(tmp_path, opt_device, param_device):
    """[Note: parked params]: a script reading the model between steps (its state_dict, a clone, a sum) got a
    segmentation fault from a view of a released unit buffer; now each released param is an empty tensor there
    (as DeepSpeed leaves them), and the module still runs, called through the engine or directly."""
    proc = subprocess.run([sys.executable, "-c", _READ_OUTSIDE_FORWARD, opt_device, param_device, str(tmp_path)],
                          env=dict(os.environ, PYTHONPATH=child_pythonpath(ROOT)), capture_output=True, text=True,
                          timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]  # -11 before: SIGSEGV
    lines = dict(line.split(" numel ") for line in proc.stdout.splitlines() if " numel " in line)
    full = sum(p.numel() for p in w.model().parameters())
    assert int(lines["gathered"]) == full
    for when in ("initialized", "backward", "step", "gathered after", "closed"):
        assert int(lines[when].split()[0]) < full // 4, (when, lines[when])  # the big units parked, empty
    assert "eval" in lines and "direct" in proc.stdout  # (after eval the units reused soon stay gathered)
