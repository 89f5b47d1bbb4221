"""PEFT's LoRA on the engine, against plain PEFT training with torch.optim.AdamW (the oracle): the same
tiny Llama with LoRA adapters on q_proj and v_proj, fp32, the same data and seeds. At stage 2 (optimizer on
cpu) and stage 3 (params and optimizer on nvme, or cpu) the losses agree at every step, only the adapters
are in the optimizer state, the frozen base is unchanged (and at stage 3 partitioned and offloaded, never
held whole), and ``save_adapter`` writes files that ``PeftModel.from_pretrained`` loads onto a fresh base
with the trained model's logits. At stage 3 a frozen unit is released after its module's backward (gradient
checkpointing too), a checkpoint holds the frozen base from the shards and restores it, and two ranks under
torchrun train, save the adapters and a checkpoint that consolidates. A frozen param of a model built under
init_context gets the model's init; PEFT adapters over such a model are refused."""
from __future__ import annotations

import contextlib
import json
import os

import pytest
import torch

pytest.importorskip("transformers", reason="transformers is not installed (pip install .[hf])")
pytest.importorskip("peft", reason="peft is not installed (pip install .[hf])")

from peft import LoraConfig, PeftModel, get_peft_model  # noqa: E402

from offload import ConfigError, init_context, initialize  # noqa: E402
from offload.checkpoint.weights import consolidate  # noqa: E402
from offload.integrations.peft import save_adapter  # noqa: E402
from tests.offload import hf_models as hf  # noqa: E402

STEPS = 5
LR = 1e-2
WEIGHT_DECAY = 0.01

pytestmark = [pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated"),
              pytest.mark.filterwarnings("ignore:`gradient_checkpointing_enable` is deprecated")]


def lora_model(base_seed: int = 0) -> torch.nn.Module:
    """The tiny Llama with LoRA (r=4) on q_proj and v_proj, no dropout; the adapters drawn after seeding 5.
    Every adapter's element count is a multiple of 64, so the layout pads none of them."""
    base = hf.build("llama", base_seed)
    torch.manual_seed(5)
    return get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0))


def config(stage: int, device: str, workdir: str) -> dict:
    """AdamW, clipping 1.0; stage 3 partitions every param (no persistence threshold: the adapters are
    partitioned too, so a save must gather them)."""
    cfg = hf.engine_config(stage, device, workdir)
    cfg["optimizer"]["params"] = {"lr": LR, "weight_decay": WEIGHT_DECAY}
    if stage == 3:
        cfg["zero_optimization"]["stage3_param_persistence_threshold"] = 0
    return cfg


def peft_losses(model: torch.nn.Module, data: list[torch.Tensor]) -> list[float]:
    """Plain PEFT training: torch.optim.AdamW over the trainable (adapter) params, the same clipping."""
    trainable = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(trainable, lr=LR, weight_decay=WEIGHT_DECAY)
    losses = []
    for ids in data:
        loss = model(input_ids=ids, labels=ids).loss
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(trainable, 1.0)
        opt.step()
        losses.append(loss.item())
    return losses


def adapters(model: torch.nn.Module) -> dict[str, tuple[int, ...]]:
    return {n: tuple(p.shape) for n, p in model.named_parameters() if p.requires_grad}


def frozen_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}


def gathered(engine):
    return engine.stage3.coordinator.gathered() if engine.stage3 is not None else contextlib.nullcontext()


def assert_only_adapters_in_the_optimizer(engine, model_adapters: dict[str, tuple[int, ...]]) -> None:
    """The optimizer's params, the layout it steps over and the state the engine allocated: the adapters'."""
    numel = sum(torch.Size(s).numel() for s in model_adapters.values())
    names = {s.name for s in engine.layout.slots}
    assert names == set(model_adapters)
    assert sum(len(g["params"]) for g in engine.optimizer.param_groups) == len(model_adapters)
    assert sum(s.numel for s in engine.layout.slots) == numel
    assert engine.layout.partition_numel == numel  # (no padding: see lora_model)
    assert sum(sg.numel for sg in engine.adam.storage.layout.sub_groups) == numel
    assert sum(engine.offload_stats().state_bytes_by_tier.values()) == 12 * numel  # fp32 master + 2 moments


@pytest.mark.parametrize("stage,device", [(2, "cpu"), (3, "nvme"), (3, "cpu")])
def test_lora_trains_as_peft_and_saves_what_peft_loads(tmp_path, stage, device):
    data = hf.batches(STEPS)
    ref = lora_model()
    ref_losses = peft_losses(ref, data)
    net = lora_model()
    want_adapters, base_before = adapters(net), frozen_state(net)
    engine, _, _, _ = initialize(model=net, config=config(stage, device, str(tmp_path)))
    try:
        assert_only_adapters_in_the_optimizer(engine, want_adapters)
        if stage == 3:  # the frozen base is partitioned and offloaded, not held whole on the side
            frozen_numel = sum(v.numel() for v in base_before.values())
            assert engine.stage3.layout.partition_numel >= frozen_numel + engine.layout.partition_numel
            assert all(p.numel() == 0 for n, p in net.named_parameters() if not p.requires_grad)
            placed = engine.stage3.shards.bytes_by_tier()  # every shard in the tier: host memory or NVMe
            assert placed["device"] == 0 and sum(placed.values()) == 4 * engine.stage3.layout.partition_numel
        losses = hf.engine_losses(engine, data)
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-4, atol=0)
        if stage == 3:  # between steps a partitioned adapter is an empty tensor: the save must gather it
            assert all(p.numel() == 0 for p in net.parameters() if p.requires_grad)
        out = tmp_path / "adapter"
        save_adapter(engine, str(out))
        with gathered(engine):
            after = frozen_state(net)
            trained = {n: p.detach().clone() for n, p in net.named_parameters() if p.requires_grad}
        assert after.keys() == base_before.keys()
        for name, value in base_before.items():
            assert torch.equal(after[name], value), name
        ids = hf.batches(1, seed=9)[0]
        net.eval()
        with torch.no_grad():
            logits = engine(input_ids=ids).logits
    finally:
        engine.close()
    assert sorted(os.listdir(out)) == ["README.md", "adapter_config.json", "adapter_model.safetensors"]
    assert json.loads((out / "adapter_config.json").read_text())["r"] == 4
    loaded = PeftModel.from_pretrained(hf.build("llama"), str(out))
    got = {n: p.detach() for n, p in loaded.named_parameters() if "lora_" in n}
    assert got.keys() == trained.keys()
    for name, value in trained.items():
        assert torch.equal(got[name], value), name
    for name, p in ref.named_parameters():  # the oracle's adapters: what the engine trained, to fp32 rounding
        if p.requires_grad:
            torch.testing.assert_close(got[name], p.detach(), rtol=1e-3, atol=1e-5)
    loaded.eval()
    with torch.no_grad():
        torch.testing.assert_close(loaded(input_ids=ids).logits, logits, rtol=1e-6, atol=1e-6)


def test_stage3_frozen_units_are_released_in_backward(tmp_path):
    """A frozen unit gathered again for its module's backward is released once that backward is past
    ([Note: frozen units in backward]): the most gathered at once stays well under the frozen base. (No unit
    is kept gathered for its reuse: stage3_max_reuse_distance 0.)"""
    cfg = config(3, "cpu", str(tmp_path))
    cfg["zero_optimization"]["stage3_max_reuse_distance"] = 0
    engine, _, _, _ = initialize(model=lora_model(), config=cfg)
    try:
        hf.engine_losses(engine, hf.batches(2))
        stage3 = engine.stage3
        plan = stage3.coordinator.plan
        frozen = sum(b.numel for b in stage3.layout.buckets[plan.trainable_units:])
        largest = max(b.numel for b in stage3.layout.buckets)
        peak = stage3.coordinator.stats().peak_live_numel
        assert plan.trainable_units == 8 and len(stage3.layout.buckets) > plan.trainable_units
        assert peak <= 2 * largest < frozen / 2, (peak, largest, frozen)
    finally:
        engine.close()


def test_stage3_checkpoint_restores_the_frozen_base_from_its_shards(tmp_path):
    """Save after 2 steps and go on; a fresh engine over a base of other weights loads the checkpoint and
    continues with the same losses, its frozen base back to the saved one; the consolidated state dict
    loads into the plain PEFT model."""
    data = hf.batches(2 * STEPS)
    cfg = config(3, "nvme", str(tmp_path))
    net = lora_model()
    base = frozen_state(net)
    engine, _, _, _ = initialize(model=net, config=cfg)
    try:
        hf.engine_losses(engine, data[:2])
        engine.save_checkpoint(str(tmp_path / "ckpt"))
        want = hf.engine_losses(engine, data[2:])
    finally:
        engine.close()
    other = lora_model(base_seed=1)
    head = "base_model.model.lm_head.weight"
    assert not torch.equal(frozen_state(other)[head], base[head])
    engine, _, _, _ = initialize(model=other, config=cfg)
    try:
        engine.load_checkpoint(str(tmp_path / "ckpt"))
        with engine.stage3.coordinator.gathered():
            restored = frozen_state(other)
        for name, value in base.items():
            assert torch.equal(restored[name], value), name
        got = hf.engine_losses(engine, data[2:])
    finally:
        engine.close()
    assert got == want
    state = consolidate(str(tmp_path / "ckpt"), str(tmp_path / "fp32.pt"))
    plain = lora_model(base_seed=1)
    plain.load_state_dict(state, strict=True)
    for name, value in base.items():
        assert torch.equal(plain.get_parameter(name), value), name


def test_frozen_params_of_a_model_built_under_init_context_get_its_init(tmp_path):
    """A frozen embedding on a model built under init_context is partitioned and replayed as the rest: the
    weights equal the plain build's and training equals torch's with the same embedding frozen."""
    data = hf.batches(3)
    ref = hf.build("llama")
    ref.model.embed_tokens.requires_grad_(False)
    want = {n: p.detach().clone() for n, p in ref.named_parameters()}
    ref_losses = hf.torch_losses(ref, data)
    cfg = hf.engine_config(3, "nvme", str(tmp_path))
    net = hf.build_meta("llama", cfg)
    net.model.embed_tokens.requires_grad_(False)
    engine, _, _, _ = initialize(model=net, config=cfg)
    try:
        with engine.stage3.coordinator.gathered():
            for name, value in net.named_parameters():
                assert torch.equal(value, want[name]), name
        losses = hf.engine_losses(engine, data)
    finally:
        engine.close()
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-5, atol=0)


def test_adapters_over_a_base_built_under_init_context_are_refused(tmp_path):
    cfg = config(3, "cpu", str(tmp_path))
    with init_context(cfg):
        base = hf.LlamaForCausalLM(hf.llama_config())
    net = get_peft_model(base, LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    with pytest.raises(ConfigError, match="PEFT model over a base built under offload.init_context"):
        initialize(model=net, config=cfg)


@pytest.mark.parametrize("reentrant", [False, True])
def test_lora_with_gradient_checkpointing_at_stage3(tmp_path, reentrant):
    """HF gradient checkpointing (PEFT's enable_input_require_grads for the reentrant kind): the recomputed
    forward gathers the frozen units again, and they are released after their module's backward."""
    def prepared(model):
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
        model.enable_input_require_grads()
        return model.train()

    data = hf.batches(3)
    ref_losses = peft_losses(prepared(lora_model()), data)
    cfg = config(3, "nvme", str(tmp_path))
    cfg["zero_optimization"]["stage3_max_reuse_distance"] = 0
    engine, _, _, _ = initialize(model=prepared(lora_model()), config=cfg)
    try:
        losses = hf.engine_losses(engine, data)
        stage3 = engine.stage3
        frozen = sum(b.numel for b in stage3.layout.buckets[stage3.coordinator.plan.trainable_units:])
        assert stage3.coordinator.stats().peak_live_numel < frozen / 2
    finally:
        engine.close()
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-4, atol=0)


def test_two_ranks_train_save_the_adapters_and_a_checkpoint(tmp_path):
    """Two ranks under torchrun (gloo), stage 3 on NVMe, every param partitioned (the frozen base in halves):
    the mean of the ranks' losses is plain PEFT's on the full batch; the ranks' params agree; the adapters
    save_adapter wrote load onto a fresh base as rank 0's; the checkpoint consolidates, in one process, to the
    trained model's state dict (the frozen base put together from both ranks' shards)."""
    import subprocess
    import sys

    from tests import child_pythonpath

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    data = hf.batches(3)
    ref = lora_model()
    ref_losses = peft_losses(ref, data)
    env = dict(os.environ, PYTHONPATH=child_pythonpath(root), OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--standalone",
                           os.path.join(root, "tests", "offload", "peft_worker.py"), str(tmp_path), "3"],
                          env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    r0, r1 = torch.load(tmp_path / "rank0.pt"), torch.load(tmp_path / "rank1.pt")
    mean = (torch.tensor(r0["losses"]) + torch.tensor(r1["losses"])) / 2
    torch.testing.assert_close(mean, torch.tensor(ref_losses), rtol=1e-4, atol=0)
    for name, value in r0["params"].items():
        assert torch.equal(value, r1["params"][name]), name
    loaded = PeftModel.from_pretrained(hf.build("llama"), str(tmp_path / "adapter"))
    for name, p in loaded.named_parameters():
        assert torch.equal(p.detach(), r0["params"][name]), name
    state = consolidate(str(tmp_path / "ckpt"), str(tmp_path / "fp32.pt"))
    plain = lora_model(base_seed=1)
    plain.load_state_dict(state, strict=True)
    for name, p in plain.named_parameters():
        assert torch.equal(p.detach(), r0["params"][name]), name  # fp32: the masters are the params


@pytest.mark.parametrize("variant", ["modules_to_save", "dora"])
def test_lora_variants_at_stage3(tmp_path, variant):
    """LoRA with a trained copy of the head (modules_to_save) or DoRA (whose layer reads its base layer's
    weight in its own forward: registered as an external parameter by initialize), stage 3 on NVMe: losses
    as plain PEFT's; the saved adapters (the head's copy, the magnitudes) load as trained."""
    options = {"modules_to_save": ["lm_head"]} if variant == "modules_to_save" else {"use_dora": True}

    def model():
        base = hf.build("llama")
        torch.manual_seed(5)
        return get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                                               lora_dropout=0.0, **options))

    data = hf.batches(3)
    ref_losses = peft_losses(model(), data)
    net = model()
    engine, _, _, _ = initialize(model=net, config=config(3, "nvme", str(tmp_path)))
    try:
        losses = hf.engine_losses(engine, data)
        save_adapter(engine, str(tmp_path / "adapter"))
        with engine.stage3.coordinator.gathered():
            trained = {n: p.detach().clone() for n, p in net.named_parameters() if p.requires_grad}
    finally:
        engine.close()
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-4, atol=0)
    loaded = dict(PeftModel.from_pretrained(hf.build("llama"), str(tmp_path / "adapter")).named_parameters())
    assert len(trained) > 8
    for name, value in trained.items():
        assert torch.equal(loaded[name], value), name
