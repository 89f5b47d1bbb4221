"""A Hugging Face checkpoint written by a bench itself, tensor by tensor (no download): the model built on
the meta device for its names and shapes, each tensor drawn, cast to the config's dtype and handed to the
engine's sharded safetensors writer, which holds at most one file. So a bench never holds the model whole,
at any size the disk takes."""
from __future__ import annotations

import os
import time
from typing import Any

import torch

__all__ = ["write_config_only", "write_random_checkpoint"]


def write_random_checkpoint(config: Any, directory: str, *, max_shard_size_bytes: int, seed: int = 0) -> dict:
    """``config`` (a ``transformers.PretrainedConfig``) saved under ``directory`` as sharded safetensors
    with its config.json: weights N(0, 0.02), vectors (norms) 1, in bf16. Returns the parameter count,
    the seconds it took and the most bytes the writer held at once."""
    from transformers import AutoModelForCausalLM

    from offload.hf.safetensors_out import ShardedWriter, model_config_json, write_config

    t0 = time.perf_counter()
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    os.makedirs(directory, exist_ok=True)
    writer = ShardedWriter(directory, max_shard_size_bytes=max_shard_size_bytes)
    g = torch.Generator().manual_seed(seed)
    for name, p in model.named_parameters():
        if p.dim() == 1:
            value = torch.ones(p.shape, dtype=torch.bfloat16)
        else:
            value = (torch.randn(p.shape, generator=g) * 0.02).to(torch.bfloat16)
        writer.add(name, value)
        del value
    writer.close()
    write_config(directory, model_config_json(model))
    return {"params": sum(p.numel() for p in model.parameters()), "seconds": time.perf_counter() - t0,
            "writer_peak_bytes": writer.peak_held_bytes}


def write_config_only(config: Any, directory: str) -> None:
    """``config``'s config.json alone under ``directory`` (a model built from it, no weights)."""
    from transformers import AutoModelForCausalLM

    from offload.hf.safetensors_out import model_config_json, write_config

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    os.makedirs(directory, exist_ok=True)
    write_config(directory, model_config_json(model))
