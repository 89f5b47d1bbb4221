"""``offload.load_pretrained(model, path)``: a local safetensors checkpoint into the model, tensor by tensor.

    with offload.init_context(config):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(path))
    report = offload.load_pretrained(model, path)   # checks the names now; reads at initialize
    engine, *_ = offload.initialize(model=model, config=config)

``path`` is a directory with ``model.safetensors.index.json`` (sharded) or ``model.safetensors``, one
``.safetensors`` file, or a list of them (the files ``from_pretrained`` resolved). A model built under ``init_context`` has no memory yet: the call checks the names
and shapes and returns the report, and ``initialize`` (stage 3) reads each parameter's piece of this
rank's shards straight into the shards after the model's init ran ([Note: streaming reads]); a model with
real parameters is filled at once. Missing keys keep the model's init; tied names are satisfied by any
name of the tensor, as transformers reports them. Values are cast to the parameter's dtype. A transformers
model's checkpoint names are converted as transformers converts them (Mixtral's per-expert tensors into
its fused experts: [Note: converted names] in ``offload.hf.names``).

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
from typing import Any, Iterator

import torch

from csrc import ConfigError
from offload.hf.names import Source, checkpoint_sources

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

    def __init__(self, path: str | os.PathLike | list) -> None:
        self.files = _files(path)
        self.entries: dict[str, _Entry] = {}
        for file in self.files:
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

    def read_source(self, source: Source, start: int = 0, stop: int | None = None) -> Iterator[tuple[int, torch.Tensor]]:
        """Elements ``[start, stop)`` of the tensor ``source`` describes, flattened: ``(offset from start, values)``
        for each checkpoint tensor they lie in, read one at a time."""
        stop = _numel(source.shape) if stop is None else stop
        at = 0
        for key, numel in source.pieces:
            a, z = max(start, at), min(stop, at + numel)
            if a < z:
                yield a - start, self.read(key, a - at, z - at)
            at += numel


def _files(path: str | os.PathLike | list) -> list[str]:
    if isinstance(path, (list, tuple)):
        files = [os.fspath(f) for f in path]
        bad = [f for f in files if not f.endswith(".safetensors") or not os.path.isfile(f)]
        if bad or not files:
            raise ConfigError(f"load_pretrained reads .safetensors files; not one: {bad[0] if bad else 'an empty list'}")
        return files
    path = os.fspath(path)
    if os.path.isdir(path):
        if os.path.isfile(os.path.join(path, INDEX)):
            with open(os.path.join(path, INDEX)) as f:
                weight_map = json.load(f).get("weight_map")
            if not isinstance(weight_map, dict):
                raise ConfigError(f"{os.path.join(path, INDEX)} has no \"weight_map\" object")
            return sorted({os.path.join(path, v) for v in weight_map.values()})
        if os.path.isfile(os.path.join(path, SINGLE)):
            return [os.path.join(path, SINGLE)]
        raise ConfigError(f"{path} holds neither {INDEX} nor {SINGLE}")
    if os.path.isfile(path):
        return [path]
    raise ConfigError(f"no safetensors checkpoint at {path}")


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
    """A load that ``initialize`` finishes: where each parameter's and buffer's values are in the checkpoint."""

    checkpoint: SafetensorsCheckpoint
    params: dict[str, Source]
    """Canonical parameter name (``model.named_parameters()``) -> its source in the checkpoint."""
    buffers: dict[str, Source]


# Meta models -> the load initialize finishes (a side table: nothing is set on the model).
_PENDING: "weakref.WeakKeyDictionary[torch.nn.Module, PendingLoad]" = weakref.WeakKeyDictionary()


def pending_load_of(model: torch.nn.Module) -> PendingLoad | None:
    return _PENDING.get(model)


def load_pretrained(model: torch.nn.Module, path: str | os.PathLike | list, *,
                    conversions: list | None = None) -> LoadReport:
    """Load the safetensors checkpoint at ``path`` into ``model`` (see the module docstring). ``conversions``:
    transformers' weight transforms for the model (from_pretrained passes its own), else the model's default."""
    from offload.zero.params import is_partitioned

    if any(is_partitioned(p) for p in model.parameters()):
        raise ConfigError("load_pretrained: the model's parameters are partitioned already (stage 3); call it on "
                          "the model built under offload.init_context, before offload.initialize")
    ckpt = SafetensorsCheckpoint(path)
    state = model.state_dict(keep_vars=True)
    sources = checkpoint_sources(model, {k: e.shape for k, e in ckpt.entries.items()}, state, conversions)
    names_of: dict[int, list[str]] = {}
    for key, value in state.items():
        names_of.setdefault(id(value), []).append(key)
    param_ids = {id(p) for p in model.parameters()}
    canonical = {id(p): n for n, p in model.named_parameters()}
    params: dict[str, Source] = {}
    buffers: dict[str, Source] = {}
    missing: list[str] = []
    for tid, keys in names_of.items():
        found = next((k for k in keys if k in sources), None)
        if found is None:
            missing.extend(keys)
            continue
        value, source = state[keys[0]], sources[found]
        if tuple(value.shape) != source.shape:
            raise ConfigError(f"{found}: the checkpoint's shape is {list(source.shape)}"
                              f"{'' if source.keys == (found,) else ' (from ' + ', '.join(source.keys[:4]) + ')'}, "
                              f"the model's {list(value.shape)}")
        if tid in param_ids:
            params[canonical[tid]] = source
        else:
            buffers[keys[0]] = source
    used = {k for table in (params, buffers) for src in table.values() for k in src.keys}
    report = LoadReport(tuple(sorted(missing)), tuple(sorted(k for k in ckpt.entries if k not in used)),
                        tuple(sorted({**params, **buffers})))
    where = path if not isinstance(path, (list, tuple)) else os.path.dirname(os.fspath(path[0]))
    if report.missing_keys:
        logger.warning("load_pretrained: %d key(s) missing from %s (they keep the model's init): %s",
                       len(report.missing_keys), where, ", ".join(report.missing_keys[:10]))
    if report.unexpected_keys:
        logger.warning("load_pretrained: %d unexpected key(s) in %s: %s", len(report.unexpected_keys), where,
                       ", ".join(report.unexpected_keys[:10]))
    pending = PendingLoad(ckpt, params, buffers)
    tensors = list(model.parameters()) + list(model.buffers())
    if any(t.is_meta for t in tensors):
        _PENDING[model] = pending
        return report
    with torch.no_grad():
        for kind, table in (("param", params), ("buffer", buffers)):
            for name, source in table.items():
                _fill(model.get_parameter(name) if kind == "param" else model.get_buffer(name), ckpt, source)
    return report


def _fill(tensor: torch.Tensor, ckpt: SafetensorsCheckpoint, source: Source) -> None:
    flat = tensor.view(-1)
    for at, piece in ckpt.read_source(source):
        flat[at:at + piece.numel()].copy_(piece)


def load_buffers(model: torch.nn.Module, pending: PendingLoad) -> None:
    """The buffers of a pending load (real once ``replace_meta_params`` ran)."""
    with torch.no_grad():
        for name, source in pending.buffers.items():
            _fill(model.get_buffer(name), pending.checkpoint, source)


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
            source = pending.params.get(slot.name)
            first, last = slot.offset - b.start, slot.offset - b.start + slot.numel
            a, z = max(first, lo), min(last, hi)
            if source is not None and a < z:
                pieces.append((source, a - first, z - first, a - lo))
        if not pieces:
            continue
        shard = shards.acquire(b.index)
        try:
            for source, start, stop, at in pieces:
                for offset, piece in pending.checkpoint.read_source(source, start, stop):
                    largest = max(largest, piece.numel() * piece.element_size())
                    shard[at + offset:at + offset + piece.numel()].copy_(piece)
                    del piece
        finally:
            shards.release(b.index, dirty=True)
    return largest
