"""The Lightning strategy's config (``offload.integrations.lightning``): the DeepSpeed-style dict it is given or
builds from its arguments, and the Trainer's settings put into it (accumulation, clipping, precision), each a
ConfigError where the two disagree."""
from __future__ import annotations

import copy
import json
import os
from typing import Any, Mapping

from lightning.pytorch.utilities import GradClipAlgorithmType

from csrc import ConfigError

__all__ = ["PRECISIONS", "default_config", "load_config", "precision_of", "put_accumulation", "put_clipping",
           "put_precision", "stage_of"]

PRECISIONS = {"32-true": None, "bf16-mixed": "bf16", "bf16-true": "bf16", "16-mixed": "fp16", "16-true": "fp16"}
"""Lightning's precision names and the config section each turns on."""


def load_config(config: Any) -> dict[str, Any]:
    if isinstance(config, (str, os.PathLike)):
        with open(config, encoding="utf-8") as f:
            return json.load(f)
    if isinstance(config, Mapping):
        return copy.deepcopy(dict(config))
    raise ConfigError(f"OffloadStrategy(config=...): a DeepSpeed-style config dict or a JSON path, not "
                      f"{type(config).__name__}")


def stage_of(config: Mapping[str, Any]) -> int:
    return int((config.get("zero_optimization") or {}).get("stage", 0))


def precision_of(config: Mapping[str, Any]) -> str:
    if (config.get("fp16") or {}).get("enabled"):
        return "16-mixed"
    if (config.get("bf16") or {}).get("enabled"):
        return "bf16-mixed"
    return "32-true"


def default_config(stage: int | None, optimizer: str | None, params: str | None, nvme_path: str | None) -> dict:
    if stage is None:
        raise ConfigError("OffloadStrategy needs config= (the DeepSpeed-style dict or JSON path) or zero_stage=")

    def where(device: str | None) -> dict[str, Any]:
        return {"device": device or "none", **({"nvme_path": nvme_path} if device == "nvme" else {})}

    zero = {"stage": stage, "offload_optimizer": where(optimizer)}
    if params is not None:
        zero["offload_param"] = where(params)
    return {"zero_optimization": zero}


def put_accumulation(cfg: dict[str, Any], batches: int) -> None:
    given = cfg.get("gradient_accumulation_steps", batches)
    if given != batches:
        raise ConfigError(f"the config's gradient_accumulation_steps is {given} and Trainer(accumulate_grad_batches="
                          f"{batches}): leave it out of the config, the Trainer's is used")
    cfg["gradient_accumulation_steps"] = batches


def put_clipping(cfg: dict[str, Any], value: float | None, algorithm: Any) -> None:
    if not value:
        return
    if algorithm == GradClipAlgorithmType.VALUE:
        raise ConfigError("Trainer(gradient_clip_algorithm='value'): the engine clips by the global norm only "
                          "(gradient_clip_algorithm='norm', or the config's gradient_clipping)")
    given = cfg.get("gradient_clipping")
    if given and float(given) != float(value):
        raise ConfigError(f"the config's gradient_clipping is {given} and Trainer(gradient_clip_val={value}): "
                          "give one of them")
    cfg["gradient_clipping"] = float(value)


def put_precision(cfg: dict[str, Any], precision: str) -> None:
    want, have = PRECISIONS[precision], precision_of(cfg)
    if PRECISIONS[have] == want:
        return
    if have != "32-true" or want is None:
        raise ConfigError(f"the precision plugin says {precision!r} and the config's bf16/fp16 sections {have!r}")
    cfg[want] = {**(cfg.get(want) or {}), "enabled": True}
