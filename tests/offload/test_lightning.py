"""``pl.Trainer(strategy=OffloadStrategy(config))`` (offload.integrations.lightning) against plain Lightning.

The oracle is the same tiny LightningModule, data and seed under Lightning's default strategy with
configure_optimizers' torch AdamW and per-step LR schedule, in fp32, gradients clipped at the same norm.
Under the engine the loss of every micro-batch is within 1e-4 relative of the oracle's, and so are the LR
each step used and the gradient norm of each optimizer step: at stage 2 with the optimizer states in host
memory, at stage 3 with the module built in configure_model (under init_context) and its params and
optimizer states on NVMe, with accumulate_grad_batches=2 over epochs whose last window is short, and on two
CPU ranks against plain DDP. A fit stopped by max_steps and resumed (ckpt_path=) from the checkpoint
ModelCheckpoint had the engine write takes the same steps as the fit never stopped. A config's own optimizer
and scheduler are used as such; settings the engine cannot take are refused by name.
"""
from __future__ import annotations

import math
import os
import subprocess
import sys
import warnings

import pytest
import torch

pytest.importorskip("lightning", reason="lightning is not installed (pip install .[lightning])")

import lightning.pytorch as pl  # noqa: E402
from lightning.pytorch.callbacks import ModelCheckpoint  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

from csrc import ConfigError  # noqa: E402
from offload.integrations.lightning import OffloadStrategy  # noqa: E402
from tests import child_pythonpath  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
WORKER = os.path.join(ROOT, "tests", "offload", "lightning_worker.py")

IN, HIDDEN, BATCH = 8, 16, 4
LR, CLIP = 2e-2, 0.5
RTOL = 1e-4


class Regressor(pl.LightningModule):
    """An MLP built in configure_model; it records each micro-batch's loss and the LR it trained with."""

    def __init__(self) -> None:
        super().__init__()
        self.net: torch.nn.Module | None = None
        self.losses: list[float] = []
        self.lrs: list[float] = []
        self.built_on_meta = False

    def configure_model(self) -> None:
        if self.net is None:
            self.net = torch.nn.Sequential(torch.nn.Linear(IN, HIDDEN), torch.nn.Tanh(), torch.nn.Linear(HIDDEN, 1))
            self.built_on_meta = all(p.is_meta for p in self.net.parameters())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = torch.nn.functional.mse_loss(self(x), y)
        self.losses.append(loss.item())
        self.lrs.append(self.trainer.optimizers[0].param_groups[0]["lr"])
        return loss

    def configure_optimizers(self):
        optimizer = torch.optim.AdamW(self.parameters(), lr=LR, weight_decay=0.01)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 / (1.0 + 0.5 * step))
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


class GradNorms(pl.Callback):
    """The gradient norm of each optimizer step, before clipping: from the params' grads under plain Lightning,
    from the engine (``get_global_grad_norm``) under OffloadStrategy."""

    def __init__(self) -> None:
        self.norms: list[float] = []
        self._steps = 0

    def on_before_optimizer_step(self, trainer, module, optimizer) -> None:
        if not isinstance(trainer.strategy, OffloadStrategy):
            grads = [p.grad.norm() for p in module.parameters() if p.grad is not None]
            self.norms.append(torch.linalg.vector_norm(torch.stack(grads)).item())

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx) -> None:
        if isinstance(trainer.strategy, OffloadStrategy) and trainer.global_step > self._steps:
            self.norms.append(trainer.strategy.engine.get_global_grad_norm())
        self._steps = trainer.global_step


def _loader(batches: int) -> DataLoader:
    g = torch.Generator().manual_seed(7)
    x = torch.randn(batches * BATCH, IN, generator=g)
    y = torch.sin(x.sum(dim=1, keepdim=True)) + 0.1 * torch.randn(batches * BATCH, 1, generator=g)
    return DataLoader(TensorDataset(x, y), batch_size=BATCH, shuffle=False)


def _fit(strategy=None, *, batches: int = 4, max_steps: int = 8, accumulate: int = 1, ckpt_path=None,
         checkpoints=None, devices: int = 1, **trainer_kw) -> dict:
    """One fit; returns the losses, LRs, grad norms and final params (and closes the engine). ``checkpoints``:
    a directory where Lightning's ModelCheckpoint saves every 4 steps (at the last batch of an epoch of 4)."""
    torch.set_num_threads(1)
    pl.seed_everything(0, verbose=False)
    module, callbacks = Regressor(), [GradNorms()]
    if checkpoints is not None:
        callbacks.append(ModelCheckpoint(dirpath=checkpoints, save_top_k=-1, every_n_train_steps=4))
    trainer = pl.Trainer(strategy=strategy or "auto", accelerator="cpu", devices=devices, max_steps=max_steps,
                         max_epochs=-1, accumulate_grad_batches=accumulate, gradient_clip_val=CLIP,
                         enable_progress_bar=False, logger=False, enable_checkpointing=checkpoints is not None,
                         enable_model_summary=False, num_sanity_val_steps=0, callbacks=callbacks,
                         use_distributed_sampler=devices > 1,  # one device: the loader's order (DDP's shuffles)
                         **trainer_kw)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", ".*does not have many workers.*")
        trainer.fit(module, train_dataloaders=_loader(batches), ckpt_path=ckpt_path)
    engine = getattr(trainer.strategy, "engine", None)
    facts = {"global_step": trainer.global_step, "built_on_meta": module.built_on_meta}
    try:
        if engine is not None:
            facts["optimizer_device"] = engine.offload_stats().optimizer_device
        if engine is not None and engine.stage3 is not None:
            facts["parked"] = all(p.numel() == 0 for p in module.net.parameters())
            facts["param_io"] = engine.stage3.param_tier.store.stats()
        gathered = engine.stage3.coordinator.gathered() if engine is not None and engine.stage3 is not None \
            else torch.no_grad()
        with gathered:
            params = {n: p.detach().clone() for n, p in module.net.named_parameters()}
    finally:
        if engine is not None:
            engine.close()
    return {"losses": module.losses, "lrs": module.lrs, "norms": callbacks[0].norms, "params": params, **facts}


def _stage2() -> OffloadStrategy:
    return OffloadStrategy({"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}})


def _stage3_nvme(nvme_path) -> OffloadStrategy:
    nvme = {"device": "nvme", "nvme_path": str(nvme_path)}
    return OffloadStrategy({"zero_optimization": {"stage": 3, "offload_optimizer": nvme, "offload_param": nvme,
                                                  "stage3_param_persistence_threshold": 0}})


STRATEGIES = {"stage 2 cpu": lambda path: _stage2(), "stage 3 nvme": _stage3_nvme}


def _assert_same(got: dict, want: dict, *, rtol: float = RTOL) -> None:
    for key in ("losses", "lrs", "norms"):
        assert len(got[key]) == len(want[key]), key
        torch.testing.assert_close(torch.tensor(got[key]), torch.tensor(want[key]), rtol=rtol, atol=0, msg=key)
    assert got["global_step"] == want["global_step"]


@pytest.fixture(scope="module")
def plain() -> dict:
    """The oracle: 8 steps over two epochs of 4 batches."""
    return _fit()


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> dict:
    """Each strategy's 8 steps (computed once, on first use)."""
    runs: dict[str, dict] = {}

    def run(name: str) -> dict:
        if name not in runs:
            runs[name] = _fit(STRATEGIES[name](tmp_path_factory.mktemp("nvme")))
        return runs[name]

    return run


def test_stage2_optimizer_on_cpu_trains_as_plain_lightning(plain, uninterrupted):
    assert len(plain["losses"]) == 8 and len(set(plain["lrs"])) == 8  # the LR changes every step
    got = uninterrupted("stage 2 cpu")
    assert got["optimizer_device"] == "cpu" and not got["built_on_meta"]
    _assert_same(got, plain)
    for name, value in plain["params"].items():
        torch.testing.assert_close(got["params"][name], value, rtol=1e-4, atol=1e-6)


def test_stage3_params_and_optimizer_on_nvme_train_as_plain_lightning(plain, uninterrupted):
    """configure_model runs under init_context: the module is built on the meta device and materialized into
    its partitions (the same draws as the plain build: the first loss agrees too)."""
    got = uninterrupted("stage 3 nvme")
    assert got["built_on_meta"] and got["parked"] and got["optimizer_device"] == "nvme"
    assert got["param_io"].bytes_written_total > 0 and got["param_io"].bytes_read_total > 0  # the shards on NVMe
    _assert_same(got, plain)
    for name, value in plain["params"].items():
        torch.testing.assert_close(got["params"][name], value, rtol=1e-4, atol=1e-6)


def test_accumulate_grad_batches_2_matches_plain_lightning():
    """Two epochs of 5 batches: windows of 2, 2 and a short last one of 1 per epoch, 6 optimizer steps; the
    engine divides nothing again (the gradient norms would halve)."""
    want = _fit(batches=5, max_steps=6, accumulate=2)
    got = _fit(_stage2(), batches=5, max_steps=6, accumulate=2)
    assert len(want["losses"]) == 10 and len(want["norms"]) == 6
    _assert_same(got, want)


@pytest.mark.filterwarnings("ignore:The dirpath has changed")
@pytest.mark.parametrize("name", list(STRATEGIES))
def test_a_fit_stopped_and_resumed_from_its_checkpoint_ends_where_the_fit_never_stopped_does(name, uninterrupted,
                                                                                              tmp_path):
    """The fit stops at max_steps=6; Lightning's ModelCheckpoint had the engine save at step 4 (the last batch of
    the first epoch), and a new fit from that checkpoint (a new module and Trainer, ckpt_path=) runs steps 5 to 8.
    (Lightning resumes a checkpoint saved there, or at a batch's end generally, exactly; one saved at
    on_train_epoch_end or after a fit that max_steps stopped resumes into an extra batch, in plain Lightning too.)"""
    make = STRATEGIES[name]
    first = _fit(make(tmp_path), max_steps=6, checkpoints=tmp_path / "first")
    ckpt = tmp_path / "first" / "epoch=0-step=4.ckpt"
    assert (ckpt / "checkpoint").is_dir() and (ckpt / "latest").is_file()  # the engine's directory
    rest = _fit(make(tmp_path), max_steps=8, ckpt_path=ckpt, checkpoints=tmp_path / "rest")
    want = uninterrupted(name)
    resumed = {key: first[key][:4] + rest[key] for key in ("losses", "lrs", "norms")}
    _assert_same({**resumed, "global_step": rest["global_step"]}, want, rtol=1e-6)
    for param, value in want["params"].items():
        torch.testing.assert_close(rest["params"][param], value, rtol=1e-6, atol=1e-7)


def test_two_ranks_at_stage3_on_nvme_train_as_plain_ddp(tmp_path):
    """Two CPU processes started by Lightning (gloo), DistributedSampler, accumulate_grad_batches=2: each rank's
    losses, LRs and gradient norms are plain DDP's with torch's AdamW, and so are the final params."""
    launched = ("LOCAL_RANK", "NODE_RANK", "MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK")  # set by the fits
    env = {k: v for k, v in os.environ.items() if k not in launched}  # in this process: the worker's would wait
    env.update(PYTHONPATH=child_pythonpath(ROOT), OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, WORKER, "2", str(tmp_path)], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    for rank in (0, 1):
        runs = torch.load(tmp_path / f"rank{rank}.pt")
        assert len(runs["plain"]["norms"]) == 4
        _assert_same(runs["offload"], runs["plain"])
        for name, value in runs["plain"]["params"].items():
            torch.testing.assert_close(runs["offload"]["params"][name], value, rtol=1e-4, atol=1e-6)


def test_a_config_that_names_the_optimizer_hands_its_scheduler_to_lightning():
    """configure_optimizers is not called; the config's WarmupLR (log warmup over 3 steps) moves the LR once per
    optimizer step, stepped by Lightning."""
    strategy = OffloadStrategy({"optimizer": {"type": "AdamW", "params": {"lr": LR}},
                                "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 3}},
                                "zero_optimization": {"stage": 2}})
    got = _fit(strategy, max_steps=4)
    torch.testing.assert_close(torch.tensor(got["lrs"]), torch.tensor([0.0, 0.0, LR * math.log(2) / math.log(3), LR]))


def test_settings_the_engine_cannot_take_are_refused_by_name():
    with pytest.raises(ConfigError, match="clips by the global norm only"):
        _fit(_stage2(), max_steps=1, gradient_clip_algorithm="value")
    strategy = OffloadStrategy({"gradient_accumulation_steps": 4, "zero_optimization": {"stage": 2}})
    with pytest.raises(ConfigError, match=r"gradient_accumulation_steps is 4 and Trainer\(accumulate_grad_batches=2"):
        _fit(strategy, max_steps=1, accumulate=2)


def test_registered_names_build_the_strategy():
    trainer = pl.Trainer(strategy="offload_stage_3_cpu", accelerator="cpu", devices=1, logger=False,
                         enable_progress_bar=False, enable_checkpointing=False, enable_model_summary=False)
    assert isinstance(trainer.strategy, OffloadStrategy) and trainer.strategy.zero_stage_3
