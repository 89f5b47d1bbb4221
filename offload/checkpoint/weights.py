"""A checkpoint (``offload.checkpoint.dcp``) read back into plain weights, in one process whatever world size
saved it: the fp32 masters of the trainable params, the module's entries for the rest (``offload consolidate``)."""
from __future__ import annotations

import pickle

import torch
import torch.distributed.checkpoint as dcp

from csrc import ConfigError
from offload.checkpoint.dcp import checkpoint_path, quiet_single_process
from offload.hf.names import model_for_names, original_format
from offload.hf.safetensors_out import DEFAULT_MAX_SHARD_SIZE_BYTES, ShardedWriter, write_config

__all__ = ["consolidate", "consolidate_safetensors"]


class _Saved:
    """What ``consolidate`` reads: the fp32 weights of a checkpoint, key by key."""

    def __init__(self, checkpoint: str) -> None:
        self.path = checkpoint_path(checkpoint)
        try:
            self.metadata = dcp.FileSystemReader(self.path).read_metadata()
        except FileNotFoundError:
            raise ConfigError(f"{checkpoint} is not a checkpoint (no DCP metadata there, nor a 'latest' file "
                              "naming one)") from None
        holder = {"engine": b""}
        with quiet_single_process():
            dcp.load(holder, storage_reader=dcp.FileSystemReader(self.path), no_dist=True)
        self.meta = pickle.loads(holder["engine"])
        self.shapes = dict(self.meta["params"])
        self.frozen_shapes = self.meta.get("frozen_shapes", {})  # stage 3's frozen params: 1-D entries
        self.aliases = self.meta.get("aliases", {})  # tied params: one optimizer entry, every name gets its master

    def entry(self, key: str) -> tuple[str, torch.Tensor]:
        """(the checkpoint entry holding ``key``'s fp32 value, an empty tensor to load it into)."""
        name = self.aliases.get(key, key)
        if name in self.shapes:
            numel = 1
            for d in self.shapes[name]:
                numel *= d
            return f"optim.{name}.master", torch.empty(numel, dtype=torch.float32)
        md = self.metadata.state_dict_metadata[f"module.{key}"]
        return f"module.{key}", torch.empty(md.size, dtype=md.properties.dtype)

    def load(self, keys: list[str]) -> dict[str, torch.Tensor]:
        """The values of ``keys`` (module state-dict names), shaped as the module has them."""
        state = dict(self.entry(k) for k in keys)
        with quiet_single_process():
            dcp.load(state, storage_reader=dcp.FileSystemReader(self.path), no_dist=True)
        out = {}
        for key in keys:
            entry = self.entry(key)[0]
            name = self.aliases.get(key, key)
            shape = self.shapes.get(name, self.frozen_shapes.get(key))
            out[key] = state[entry].view(shape) if shape is not None else state[entry]
        return out


def consolidate(checkpoint: str, out_path: str) -> dict[str, torch.Tensor]:
    """Write the fp32 weights of a checkpoint as a plain state dict that ``model.load_state_dict`` accepts.

    Trainable params come from the fp32 masters; buffers and frozen params from the module entries.
    Runs in one process, whatever world size saved it. ``checkpoint`` may be the save directory (its
    ``latest`` is followed)."""
    saved = _Saved(checkpoint)
    out = saved.load(list(saved.meta["module_keys"]))
    torch.save(out, out_path)
    return out


def consolidate_safetensors(checkpoint: str, out_dir: str, *,
                            max_shard_size_bytes: int = DEFAULT_MAX_SHARD_SIZE_BYTES) -> list[str]:
    """Write the fp32 weights of a checkpoint as sharded safetensors + index (+ the model's ``config.json``
    when the engine's model had one, and its ``generation_config.json`` when it generates): a directory
    ``from_pretrained`` loads, under the names ``save_pretrained`` writes when transformers can build that
    config on the meta device. Reads one output file's worth at a time. Tied names are written once (the
    first). Returns the files written."""
    saved = _Saved(checkpoint)
    writer = ShardedWriter(out_dir, max_shard_size_bytes=max_shard_size_bytes)
    names_model = model_for_names(saved.meta.get("model_config"))  # [Note: converted names]

    def add(values: dict[str, torch.Tensor]) -> None:
        for k, v in values.items():
            for name, tensor in original_format(names_model, k, v) if names_model is not None else [(k, v)]:
                writer.add(name, tensor)

    group: list[str] = []
    group_bytes = 0
    for key in saved.meta["module_keys"]:
        if key in saved.aliases:
            continue
        tensor = saved.entry(key)[1]
        nbytes = tensor.numel() * tensor.element_size()
        if group and group_bytes + nbytes > max_shard_size_bytes:
            add(saved.load(group))
            group, group_bytes = [], 0
        group.append(key)
        group_bytes += nbytes
    if group:
        add(saved.load(group))
    names = writer.close()
    write_config(out_dir, saved.meta.get("model_config"), saved.meta.get("generation_config"))
    return names
