"""Writing a model as Hugging Face lays it out: sharded safetensors plus their index, ``config.json``, and
``generation_config.json`` for a model that generates, as ``save_pretrained`` writes them.

``ShardedWriter`` takes tensors one at a time, holds at most one output file's worth, and writes a file
(``safetensors.torch.save_file``) each time the next tensor would take it over ``max_shard_size_bytes``.
``close()`` names the files ``model-0000i-of-0000N.safetensors`` with ``model.safetensors.index.json``
(``metadata.total_size``, ``weight_map``), or ``model.safetensors`` alone when there is one file: what
``from_pretrained`` and ``offload.load_pretrained`` read. One name per tensor: a tied tensor is written
under its first name, as transformers saves it (``from_pretrained`` ties the rest again). The writer
logs the files at DEBUG: its callers report what they wrote, once.
"""
from __future__ import annotations

import json
import logging
import os
from typing import Any

import torch

from csrc import ConfigError

logger = logging.getLogger(__name__)

__all__ = ["DEFAULT_MAX_SHARD_SIZE_BYTES", "ShardedWriter", "generation_config_json", "model_config_json",
           "write_config"]

DEFAULT_MAX_SHARD_SIZE_BYTES = 5 * 1024 ** 3  # transformers' default cap per file
INDEX = "model.safetensors.index.json"


def _save_file():
    try:
        from safetensors.torch import save_file
    except ImportError:
        raise ConfigError("writing safetensors needs the safetensors package: pip install .[hf]") from None
    return save_file


class ShardedWriter:
    """Sharded safetensors into ``save_dir`` (see the module docstring)."""

    def __init__(self, save_dir: str, *, max_shard_size_bytes: int = DEFAULT_MAX_SHARD_SIZE_BYTES) -> None:
        if not isinstance(max_shard_size_bytes, int) or max_shard_size_bytes <= 0:
            raise ConfigError(f"max_shard_size_bytes must be a positive integer, got {max_shard_size_bytes!r}")
        self.save_file = _save_file()
        self.save_dir = save_dir
        self.max_shard_size_bytes = max_shard_size_bytes
        os.makedirs(save_dir, exist_ok=True)
        self._held: dict[str, torch.Tensor] = {}
        self._held_bytes = 0
        self._files: list[list[str]] = []
        self.total_bytes = 0
        self.peak_held_bytes = 0

    def add(self, name: str, tensor: torch.Tensor) -> None:
        """Take a CPU copy of ``tensor`` (the caller may free or reuse it at once)."""
        nbytes = tensor.numel() * tensor.element_size()
        if self._held and self._held_bytes + nbytes > self.max_shard_size_bytes:
            self._flush()
        self._held[name] = tensor.detach().to("cpu", copy=True).contiguous()
        self._held_bytes += nbytes
        self.total_bytes += nbytes
        self.peak_held_bytes = max(self.peak_held_bytes, self._held_bytes)

    def _flush(self) -> None:
        self.save_file(self._held, os.path.join(self.save_dir, f".part{len(self._files)}.safetensors"),
                       metadata={"format": "pt"})
        self._files.append(list(self._held))
        self._held = {}
        self._held_bytes = 0

    def close(self) -> list[str]:
        """Write the last file and the index; returns the files' names."""
        if self._held or not self._files:
            self._flush()
        n = len(self._files)
        names = [INDEX.replace(".index.json", "") if n == 1 else f"model-{i + 1:05d}-of-{n:05d}.safetensors"
                 for i in range(n)]
        for i, name in enumerate(names):
            os.replace(os.path.join(self.save_dir, f".part{i}.safetensors"), os.path.join(self.save_dir, name))
        if n > 1:
            weight_map = {key: names[i] for i, keys in enumerate(self._files) for key in keys}
            with open(os.path.join(self.save_dir, INDEX), "w") as f:
                json.dump({"metadata": {"total_size": self.total_bytes}, "weight_map": weight_map}, f, indent=2)
        logger.debug("wrote %d safetensors file(s), %d bytes, to %s", n, self.total_bytes, self.save_dir)
        return names


def model_config_json(module: Any) -> str | None:
    """The model's ``config.json`` text when it has a Hugging Face config, else None."""
    config = getattr(module, "config", None)
    to_json = getattr(config, "to_json_string", None)
    if not callable(to_json):
        return None
    text = to_json()
    fields = json.loads(text)
    if not fields.get("architectures"):  # as save_pretrained records the class (from_config leaves it unset)
        fields["architectures"] = [type(module).__name__]
        text = json.dumps(fields, indent=2, sort_keys=True) + "\n"
    return text


def generation_config_json(module: Any) -> str | None:
    """The model's ``generation_config.json`` text where ``save_pretrained`` writes one (a model that
    ``can_generate()``), as it writes it (``GenerationConfig.save_pretrained``: what differs from the
    defaults, less ``compile_config``); else None."""
    can_generate = getattr(module, "can_generate", None)
    config = getattr(module, "generation_config", None)
    if config is None or not callable(can_generate) or not can_generate():
        return None
    return config.to_json_string(use_diff=True, keys_to_pop=["compile_config"])


def write_config(save_dir: str, config_json: str | None, generation_json: str | None = None) -> None:
    """``config.json`` and ``generation_config.json`` in ``save_dir``, each where its text is given."""
    for name, text in (("config.json", config_json), ("generation_config.json", generation_json)):
        if text is not None:
            with open(os.path.join(save_dir, name), "w", encoding="utf-8") as f:
                f.write(text)
