"""``OffloadAccelerator`` (offload.integrations.accelerate): a custom Accelerate loop on the engine.

The oracle is the same loop on plain Accelerate (torch's AdamW, fp32, no offload) with the same model,
data, seed and LR schedule: the loss of every micro-batch within 1e-4 relative, at stage 2 with the
optimizer in host memory and at stage 3 with params and optimizer on NVMe; accumulation over two
micro-batches through ``accumulate()`` (a short last cycle at each epoch's end too); the norm
``clip_grad_norm_`` returns (before clipping); ``save_state``/``load_state`` resuming to the same params
as a run not interrupted; ``unwrap_model``/``get_state_dict`` giving the trained weights."""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("accelerate", reason="accelerate is not installed (the .[hf] extra)")

from accelerate import Accelerator  # noqa: E402
from accelerate.state import AcceleratorState, GradientState  # noqa: E402

from safetensors.torch import load_file  # noqa: E402

from offload.integrations.accelerate import OffloadAccelerator  # noqa: E402

LR = 1e-2
SAMPLES, BATCH = 36, 4  # 9 micro-batches an epoch: with 2 to a step, the last cycle is short
IN, HIDDEN, OUT = 12, 32, 3


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(IN, HIDDEN), torch.nn.Tanh(), torch.nn.Linear(HIDDEN, HIDDEN),
                               torch.nn.Tanh(), torch.nn.Linear(HIDDEN, OUT))


def _loader() -> torch.utils.data.DataLoader:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(SAMPLES, IN, generator=g)
    y = torch.sin(x[:, :OUT] * 2) + 0.1 * torch.randn(SAMPLES, OUT, generator=g)
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=BATCH, shuffle=False)


def _config(stage: int, nvme_path=None, *, clip: float | None = None) -> dict:
    def where(device):
        return {"device": device, **({"nvme_path": str(nvme_path), "buffer_count": 2} if device == "nvme" else {})}

    zero = {"stage": stage, "offload_optimizer": where("cpu" if stage < 3 else "nvme"), "sub_group_size": 512,
            "reduce_bucket_size": 700}
    if stage == 3:
        zero.update(offload_param=where("nvme"), stage3_param_persistence_threshold=0)
    config = {"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
              "train_batch_size": "auto", "steps_per_print": 1000, "zero_optimization": zero}
    if clip is not None:
        config["gradient_clipping"] = clip
    return config


@pytest.fixture(autouse=True)
def fresh_accelerate_state():
    """Accelerate keeps its state in process-wide singletons: each accelerator here starts from none."""
    yield
    AcceleratorState._reset_state(True)
    GradientState._reset_state()


def _accelerator(config: dict | None, gas: int):
    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    if config is None:
        return Accelerator(gradient_accumulation_steps=gas)
    return OffloadAccelerator(offload_config=config, gradient_accumulation_steps=gas)


def _setup(config: dict | None, gas: int, model: torch.nn.Module | None = None):
    acc = _accelerator(config, gas)
    net = model if model is not None else _model()
    opt = torch.optim.AdamW(net.parameters(), lr=LR, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 0.8 ** step)  # a changing lr: the scheduler matters
    model, opt, loader, sched = acc.prepare(net, opt, _loader(), sched)
    return acc, net, model, opt, loader, sched


def _epochs(acc, model, opt, loader, sched, epochs: int, clip: float | None = None):
    """Accelerate's documented loop; the loss of every micro-batch and the norm of every step."""
    losses, norms = [], []
    for _ in range(epochs):
        for x, y in loader:
            with acc.accumulate(model):
                loss = torch.nn.functional.mse_loss(model(x), y)
                acc.backward(loss)
                if clip is not None and acc.sync_gradients:
                    norms.append(float(acc.clip_grad_norm_(model.parameters(), clip)))
                opt.step()
                sched.step()
                opt.zero_grad()
            losses.append(loss.item())
    return losses, norms


def _run(config: dict | None, *, gas: int = 1, epochs: int = 1, clip: float | None = None, save_to=None):
    acc, net, model, opt, loader, sched = _setup(config, gas)
    try:
        losses, norms = _epochs(acc, model, opt, loader, sched, epochs, clip)
        assert acc.unwrap_model(model) is net
        state = {k: v.float() for k, v in acc.get_state_dict(model).items()}
        if save_to is not None:
            acc.save_model(model, save_to)
        return losses, norms, state, sched.get_last_lr()
    finally:
        if config is not None:
            acc.free_memory()


def _assert_same_run(got, want):
    torch.testing.assert_close(torch.tensor(got[0]), torch.tensor(want[0]), rtol=1e-4, atol=0)
    torch.testing.assert_close(torch.tensor(got[1]), torch.tensor(want[1]), rtol=1e-4, atol=0)
    assert got[2].keys() == want[2].keys()
    for name, p in want[2].items():
        torch.testing.assert_close(got[2][name], p, rtol=1e-4, atol=1e-5, msg=name)
    assert got[3] == pytest.approx(want[3], rel=1e-6)


@pytest.mark.parametrize("stage", [2, 3], ids=["stage2-optimizer-cpu", "stage3-params-optimizer-nvme"])
def test_a_loop_trains_as_plain_accelerate(stage, tmp_path):
    want = _run(None, epochs=1)
    got = _run(_config(stage, tmp_path), epochs=1, save_to=tmp_path / "saved")
    _assert_same_run(got, want)
    assert got[3] == pytest.approx([LR * 0.8 ** 9])  # the script's scheduler drove the engine's lr
    saved = load_file(tmp_path / "saved" / "model.safetensors")  # save_model: get_state_dict's weights
    assert saved.keys() == got[2].keys() and all(torch.equal(saved[k], v) for k, v in got[2].items())


def test_a_scheduler_prepared_after_its_optimizer_drives_the_engine():
    def run(config):
        acc = _accelerator(config, 1)
        net = _model()
        model, opt, loader = acc.prepare(net, torch.optim.AdamW(net.parameters(), lr=LR, weight_decay=0.01),
                                         _loader())
        sched = acc.prepare(torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5))  # over the wrapper
        try:
            return _epochs(acc, model, opt, loader, sched, 1)[0], sched.get_last_lr()
        finally:
            if config is not None:
                acc.free_memory()

    want, got = run(None), run(_config(2))
    torch.testing.assert_close(torch.tensor(got[0]), torch.tensor(want[0]), rtol=1e-4, atol=0)
    assert got[1] == want[1] == [LR * 0.5 ** 4]


def test_accumulate_matches_plain_accelerate_short_last_cycle_too(tmp_path):
    want = _run(None, gas=2, epochs=2)
    got = _run(_config(2), gas=2, epochs=2)
    _assert_same_run(got, want)
    assert got[3] == pytest.approx([LR * 0.8 ** 10])  # 5 steps an epoch: 4 of two micro-batches, 1 of one


def test_clip_grad_norm_returns_the_norm_before_clipping(tmp_path):
    clip = 0.05  # below every step's norm: each step is clipped
    want = _run(None, gas=2, clip=clip)
    got = _run(_config(2, clip=clip), gas=2, clip=clip)
    assert min(want[1]) > clip
    _assert_same_run(got, want)


def test_clip_grad_norm_with_another_max_norm_says_what_to_set(tmp_path):
    acc, _, model, opt, loader, sched = _setup(_config(2, clip=1.0), 1)
    try:
        x, y = next(iter(loader))
        acc.backward(torch.nn.functional.mse_loss(model(x), y))
        assert float(acc.clip_grad_norm_(model.parameters(), 1.0)) > 0
        with pytest.raises(ValueError, match='"gradient_clipping": 0.5'):
            acc.clip_grad_norm_(model.parameters(), 0.5)
    finally:
        acc.free_memory()


@pytest.mark.parametrize("stage", [2, 3], ids=["stage2-optimizer-cpu", "stage3-params-optimizer-nvme"])
def test_save_state_load_state_resumes_to_the_same_params(stage, tmp_path):
    """Two epochs straight against one epoch, save_state, a new process's accelerator and model (other initial
    weights), load_state, one epoch: the same losses, params and lr."""
    want = _run(_config(stage, tmp_path), gas=2, epochs=2)
    acc, _, model, opt, loader, sched = _setup(_config(stage, tmp_path), 2)
    try:
        first, _ = _epochs(acc, model, opt, loader, sched, 1)
        acc.save_state(tmp_path / "ckpt")
    finally:
        acc.free_memory()
    torch.manual_seed(7)
    other = torch.nn.Sequential(torch.nn.Linear(IN, HIDDEN), torch.nn.Tanh(), torch.nn.Linear(HIDDEN, HIDDEN),
                                torch.nn.Tanh(), torch.nn.Linear(HIDDEN, OUT))
    acc, _, model, opt, loader, sched = _setup(_config(stage, tmp_path), 2, model=other)
    try:
        acc.load_state(tmp_path / "ckpt")
        second, _ = _epochs(acc, model, opt, loader, sched, 1)
        state = {k: v.float() for k, v in acc.get_state_dict(model).items()}
        assert sched.get_last_lr() == pytest.approx(want[3], rel=1e-12)
    finally:
        acc.free_memory()
    assert first + second == want[0]
    for name, p in want[2].items():
        assert torch.equal(state[name], p), name


def test_the_accumulation_steps_must_agree(tmp_path):
    config = _config(2)
    config.update(gradient_accumulation_steps=4, train_micro_batch_size_per_gpu=BATCH)
    del config["train_batch_size"]
    acc = _accelerator(config, 2)
    net = _model()
    with pytest.raises(ValueError, match='"gradient_accumulation_steps": 2'):
        acc.prepare(net, torch.optim.AdamW(net.parameters(), lr=LR))


def test_mixed_precision_is_the_configs():
    AcceleratorState._reset_state(True)
    with pytest.raises(ValueError, match="bf16"):
        OffloadAccelerator(offload_config=_config(2), mixed_precision="bf16")


def test_a_skipped_step_is_reported_and_leaves_the_lr():
    acc, _, model, opt, loader, sched = _setup(_config(2), 1)
    try:
        x, y = next(iter(loader))
        acc.backward(torch.nn.functional.mse_loss(model(x), y) * float("inf"))  # a gradient not finite: skipped
        assert opt.step_was_skipped and acc.optimizer_step_was_skipped
        assert sched.get_last_lr() == [LR]
        acc.backward(torch.nn.functional.mse_loss(model(x), y))
        assert not opt.step_was_skipped
        assert sched.get_last_lr() == pytest.approx([LR * 0.8])
    finally:
        acc.free_memory()
