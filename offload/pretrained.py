"""``offload.load_pretrained(model, path)``: a local safetensors checkpoint into the model, tensor by tensor.

    with offload.init_context(config):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(path))
    report = offload.load_pretrained(model, path)   # checks the names now; reads at initialize
    engine, *_ = offload.initialize(model=model, config=config)

``path`` is a directory with ``model.safetensors.index.json`` (sharded) or ``model.safetensors``, or one
``.safetensors`` file. A model built under ``init_context`` has no memory yet: the call checks the names
and shapes and returns the report, and ``initialize`` (stage 3) reads each parameter's piece of this
rank's shards straight into the shards after the model's init ran ([Note: streaming reads]); a model with
real parameters is filled at once. Missing keys keep the model's init; tied names are satisfied by any
name of the tensor, as transformers reports them. Values are cast to the parameter's dtype.

[Note: streaming reads] A safetensors file is an 8-byte little-endian header length, a JSON header
(name -> dtype, shape, byte offsets) and the raw row-major bytes. ``safetensors.safe_open`` maps the
file, and every page it touches counts in the process's resident set until the file is closed, so
reading a 5 GB shard file through it holds up to 5 GB. Its Python API gives no byte offsets, so the
header's JSON is read here, and each piece is read with one positioned read (``os.preadv``) into the
tensor that receives it: the most a load holds beyond the partitions is one rank's piece of one tensor.
"""
from __future__ import annotations

import dataclasses
import json
import logging
import os
import struct
import weakref
from typing import Any

import torch

from csrc import ConfigError

logger = logging.getLogger(__name__)

__all__ = ["LoadReport", "SafetensorsCheckpoint", "load_pretrained", "pending_load_of"]

_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
           "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
           "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2}
INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"


@dataclasses.dataclass(frozen=True)
class LoadReport:
    """What ``load_pretrained`` found, as transformers reports it."""

    missing_keys: tuple[str, ...]
    """State-dict names of the model that the checkpoint has under none of the tensor's names."""
    unexpected_keys: tuple[str, ...]
    """Names in the checkpoint that the model does not have."""
    loaded_keys: tuple[str, ...]
    """Names of the model read from the checkpoint (one per tensor: ties are one)."""


@dataclasses.dataclass(frozen=True)
class _Entry:
    file: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    start: int
    """Byte offset of the tensor's first element in ``file``."""


class SafetensorsCheckpoint:
    """The tensors of a local safetensors checkpoint (headers only; data read on demand)."""

    def __init__(self, path: str | os.PathLike) -> None:
        path = os.fspath(path)
        if os.path.isdir(path):
            if os.path.isfile(os.path.join(path, INDEX)):
                with open(os.path.join(path, INDEX)) as f:
                    weight_map = json.load(f).get("weight_map")
                if not isinstance(weight_map, dict):
                    raise ConfigError(f"{os.path.join(path, INDEX)} has no \"weight_map\" object")
                files = sorted({os.path.join(path, v) for v in weight_map.values()})
            elif os.path.isfile(os.path.join(path, SINGLE)):
                files = [os.path.join(path, SINGLE)]
            else:
                raise ConfigError(f"{path} holds neither {INDEX} nor {SINGLE}")
        elif os.path.isfile(path):
            files = [path]
        else:
            raise ConfigError(f"no safetensors checkpoint at {path}")
        self.entries: dict[str, _Entry] = {}
        for file in files:
            self.entries.update(_header(file))

    def read(self, name: str, start: int = 0, stop: int | None = None) -> torch.Tensor:
        """Elements ``[start, stop)`` of tensor ``name`` flattened, in the file's dtype (one positioned read)."""
        e = self.entries[name]
        numel = _numel(e.shape)
        stop = numel if stop is None else stop
        if not 0 <= start <= stop <= numel:
            raise ValueError(f"elements [{start}, {stop}) are outside {name} ({numel} elements)")
        item = torch.empty(0, dtype=e.dtype).element_size()
        out = torch.empty((stop - start) * item, dtype=torch.uint8)
        with open(e.file, "rb", buffering=0) as f:
            got = os.preadv(f.fileno(), [out.numpy()], e.start + start * item)
        if got != out.numel():
            raise ConfigError(f"{e.file} is short: {name} needs {out.numel()} bytes at {e.start + start * item}, "
                              f"read {got}")
        return out.view(e.dtype)


def _numel(shape) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def _header(file: str) -> dict[str, _Entry]:
    with open(file, "rb") as f:
        raw = f.read(8)
        if len(raw) != 8:
            raise ConfigError(f"{file} is not a safetensors file (shorter than its header length)")
        (length,) = struct.unpack("<Q", raw)
        try:
            header = json.loads(f.read(length))
        except ValueError as exc:
            raise ConfigError(f"{file} is not a safetensors file: its header is not JSON ({exc})") from None
    out = {}
    for name, spec in header.items():
        if name == "__metadata__":
            continue
        if spec["dtype"] not in _DTYPES:
            raise ConfigError(f"{file}: {name} has dtype {spec['dtype']}, which load_pretrained does not read")
        out[name] = _Entry(file, _DTYPES[spec["dtype"]], tuple(spec["shape"]), 8 + length + spec["data_offsets"][0])
    return out


@dataclasses.dataclass(frozen=True)
class PendingLoad:
    """A load that ``initialize`` finishes: which checkpoint name fills each parameter and buffer."""

    checkpoint: SafetensorsCheckpoint
    params: dict[str, str]
    """Canonical parameter name (``model.named_parameters()``) -> checkpoint name."""
    buffers: dict[str, str]


# Meta models -> the load initialize finishes (a side table: nothing is set on the model).
_PENDING: "weakref.WeakKeyDictionary[torch.nn.Module, PendingLoad]" = weakref.WeakKeyDictionary()


def pending_load_of(model: torch.nn.Module) -> PendingLoad | None:
    return _PENDING.get(model)


def load_pretrained(model: torch.nn.Module, path: str | os.PathLike) -> LoadReport:
    """Load the safetensors checkpoint at ``path`` into ``model`` (see the module docstring)."""
    ckpt = SafetensorsCheckpoint(path)
    state = model.state_dict(keep_vars=True)
    names_of: dict[int, list[str]] = {}
    for key, value in state.items():
        names_of.setdefault(id(value), []).append(key)
    param_ids = {id(p) for p in model.parameters()}
    canonical = {id(p): n for n, p in model.named_parameters()}
    params: dict[str, str] = {}
    buffers: dict[str, str] = {}
    missing: list[str] = []
    for tid, keys in names_of.items():
        found = next((k for k in keys if k in ckpt.entries), None)
        if found is None:
            missing.extend(keys)
            continue
        value = state[keys[0]]
        if tuple(value.shape) != ckpt.entries[found].shape:
            raise ConfigError(f"{found}: the checkpoint's shape is {list(ckpt.entries[found].shape)}, the model's "
                              f"{list(value.shape)}")
        if tid in param_ids:
            params[canonical[tid]] = found
        else:
            buffers[keys[0]] = found
    expected = set(state)
    report = LoadReport(tuple(sorted(missing)), tuple(sorted(k for k in ckpt.entries if k not in expected)),
                        tuple(sorted({**params, **buffers})))
    if report.missing_keys:
        logger.warning("load_pretrained: %d key(s) missing from %s (they keep the model's init): %s",
                       len(report.missing_keys), path, ", ".join(report.missing_keys[:10]))
    if report.unexpected_keys:
        logger.warning("load_pretrained: %d unexpected key(s) in %s: %s", len(report.unexpected_keys), path,
                       ", ".join(report.unexpected_keys[:10]))
    pending = PendingLoad(ckpt, params, buffers)
    tensors = list(model.parameters()) + list(model.buffers())
    if any(t.is_meta for t in tensors):
        _PENDING[model] = pending
        return report
    if any(t.untyped_storage().nbytes() == 0 and t.numel() > 0 for t in tensors):
        raise ConfigError("load_pretrained: the model's parameters are partitioned already (stage 3); call it on "
                          "the model built under offload.init_context, before offload.initialize")
    with torch.no_grad():
        for kind, table in (("param", params), ("buffer", buffers)):
            for name, key in table.items():
                t = model.get_parameter(name) if kind == "param" else model.get_buffer(name)
                t.copy_(ckpt.read(key).view(t.shape))
    return report


def load_buffers(model: torch.nn.Module, pending: PendingLoad) -> None:
    """The buffers of a pending load (real once ``replace_meta_params`` ran)."""
    with torch.no_grad():
        for name, key in pending.buffers.items():
            buf = model.get_buffer(name)
            buf.copy_(pending.checkpoint.read(key).view(buf.shape))


def load_into_shards(pending: PendingLoad, layout: Any, shards: Any) -> int:
    """Each parameter's piece of this rank's shards, read from the checkpoint ([Note: streaming reads]).
    Returns the most bytes one read held."""
    largest = 0
    rank = layout.rank
    for b in layout.buckets:
        lo, hi = b.shard_start(rank) - b.start, b.shard_start(rank) - b.start + b.shard_numel
        pieces = []
        for i in b.slots:
            slot = layout.slots[i]
            key = pending.params.get(slot.name)
            first, last = slot.offset - b.start, slot.offset - b.start + slot.numel
            a, z = max(first, lo), min(last, hi)
            if key is not None and a < z:
                pieces.append((key, a - first, z - first, a - lo))
        if not pieces:
            continue
        shard = shards.acquire(b.index)
        try:
            for key, start, stop, at in pieces:
                piece = pending.checkpoint.read(key, start, stop)
                largest = max(largest, piece.numel() * piece.element_size())
                shard[at:at + stop - start].copy_(piece)
                del piece
        finally:
            shards.release(b.index, dirty=True)
    return largest
