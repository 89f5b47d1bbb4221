"""The rows of the GPU step bench (step_gpu.py): plain torch, our engine and DeepSpeed's on one model, and the
engine's config for a contender."""
from __future__ import annotations

import copy
import time

import torch

from step_common import LR, WEIGHT_DECAY
from step_deepspeed import DeepSpeedRow, ds_config
from step_gpu_plan import Contender

from offload.builder import initialize
from offload.models.gpt import GPT, GPTConfig

__all__ = ["EngineRow", "TorchRow", "build", "engine_config", "sync_device"]


def engine_config(c: Contender, *, batch: int, accum: int, nvme_path: str, params: int = 0) -> dict:
    """The engine's config for ``c``; ``params``: the model's count, which ``c.live_share`` takes a share of."""
    def where(device: str, buffers: int) -> dict:
        return {"device": device, **({"nvme_path": nvme_path, "buffer_count": buffers} if device == "nvme" else {})}

    zero = {"stage": c.stage, "offload_optimizer": where(c.optimizer, 4), "sub_group_size": 100_000_000,
            "reduce_bucket_size": 50_000_000}
    if c.stage == 3:
        zero["offload_param"] = where(c.param, 5)
    if c.ratio is not None:  # [Note: GPU-resident share] in offload.zero.device_share
        zero["offload_optimizer"]["ratio"] = c.ratio
    if c.live_share is not None:  # DeepSpeed's keys, its meaning: elements gathered at once, and kept for reuse
        zero["stage3_max_live_parameters"] = zero["stage3_max_reuse_distance"] = int(c.live_share * params)
    config = {"train_micro_batch_size_per_gpu": batch, "gradient_accumulation_steps": accum,
              "steps_per_print": 10 ** 9, "bf16": {"enabled": True},
              "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": WEIGHT_DECAY}},
              "zero_optimization": zero}
    if c.delayed:
        config["offload"] = {"delayed_update": True, "delayed_update_warmup_steps": 1}
    if c.overlap is not None:
        config.setdefault("offload", {})["overlap_step"] = c.overlap
    if c.under_forward:  # [Note: the step under the next forward] in offload.zero.step_tail
        config.setdefault("offload", {})["step_under_forward"] = True
    if c.state_dtype != "fp32":
        config.setdefault("offload", {})["state_dtype"] = c.state_dtype
    if c.grad_accum_dtype != "fp32":
        config["data_types"] = {"grad_accum_dtype": c.grad_accum_dtype}
    return config


def sync_device(device: torch.device) -> None:
    """Wait for the device's queued work (a GPU's; nothing on the CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class TorchRow:
    """Plain torch AMP: the peer every offload figure is held against."""

    def __init__(self, c: Contender, model: GPT, device: torch.device) -> None:
        self.name = c.name
        self.device = device
        self.model = model.to(device)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY, fused=True)

    def step(self, micro: list[tuple[torch.Tensor, torch.Tensor]]) -> tuple[float, float]:
        t0 = time.perf_counter()
        for x, y in micro:
            with torch.autocast(device_type=self.device.type, dtype=torch.bfloat16):
                loss = self.model(x, y)
            (loss / len(micro)).backward()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        sync_device(self.device)
        return time.perf_counter() - t0, loss.item()

    def close(self) -> None:
        self.model = self.opt = None


class EngineRow:
    def __init__(self, c: Contender, model: GPT, device: torch.device, config: dict) -> None:
        self.name = c.name
        self.device = device
        self.engine, _, _, _ = initialize(model=model, config=config)
        if self.engine.device.type != device.type:
            raise RuntimeError(f"the engine computes on {self.engine.device}, the bench asked for {device}")
        self.steps = 0
        self._since: dict[str, float] | None = None  # the engine's counters after the warm-up step

    def step(self, micro: list[tuple[torch.Tensor, torch.Tensor]]) -> tuple[float, float]:
        t0 = time.perf_counter()
        for x, y in micro:
            loss = self.engine(x, y)
            self.engine.backward(loss)
            self.engine.step()  # the optimizer step at the last micro-batch (the accumulation boundary)
        sync_device(self.device)
        dt = time.perf_counter() - t0
        if self._since is None:
            self._since = self._counters()
        else:
            self.steps += 1
        return dt, loss.item()

    def _counters(self) -> dict[str, float]:
        e, o = self.engine, self.engine.overlap
        out = {f"{k} s": v for k, v in e.wall_seconds.items() if k in ("forward", "backward")}
        out["step after backward s"] = e.step_seconds
        if o is not None:
            out.update({"stepped under backward s": o.seconds_under_backward,
                        "stepped early, after backward s": o.seconds_after_backward,
                        "of which rollback copies s": o.backup_seconds, "sub-groups stepped early": o.early_sub_groups,
                        "of which copied ahead": o.copies_ahead_used, "copies made ahead s": o.ahead_seconds,
                        "rollbacks": o.rollbacks})
        if o is not None and o.tail is not None:  # [Note: the step under the next forward] in offload.zero.step_tail
            out.update({"sub-groups stepped under forward": o.tail.sub_groups_under_forward,
                        "forward waited for them s": o.tail.wait_seconds})
        return out

    def breakdown(self) -> str:
        """Per step since the warm-up: where the engine's host-side time went ([Note: overlapped step]): the host's
        wall time in forward and backward calls (a GPU's kernels run behind them), the optimizer step after
        backward, and the overlapped step's work under backward."""
        if not self.steps or self._since is None:
            return ""
        now = self._counters()
        return ", ".join(f"{k} {(now[k] - self._since.get(k, 0.0)) / self.steps:{'.1f' if k[-1] != 's' else '.3f'}}"
                         for k in now) + f" (over {self.steps} steps)"

    def close(self) -> None:
        self.engine.close()


def build(c: Contender, gcfg: GPTConfig, device: torch.device, *, batch: int, accum: int, nvme_path: str,
          meta: bool = False, base: GPT | None = None):
    """The contender's row, its model a copy of ``base`` (built here when None). ``meta``: a stage-3 model
    is built under ``offload.init_context`` (no process holds it whole; other weights than the plain
    build's) rather than on the host and copied in."""
    with torch.device("meta"):
        params = GPT(gcfg).num_parameters()
    config = engine_config(c, batch=batch, accum=accum, nvme_path=nvme_path, params=params)
    if meta and c.stage == 3:
        from bench_capacity import GPT2Init

        from offload import init_context

        init = GPT2Init(gcfg.n_layer)
        with init_context(config, param_init_fn=init):
            model = GPT(gcfg, seed=0)
        init.names.update((id(m), name) for name, m in model.named_modules())
    else:
        model = GPT(gcfg, seed=0) if base is None else copy.deepcopy(base)  # the same weights for every contender
    if not c.engine:
        return TorchRow(c, model, device)
    if c.deepspeed:
        return DeepSpeedRow(c.name, model, device, ds_config(config, ratio=c.ratio))
    return EngineRow(c, model, device, config)
