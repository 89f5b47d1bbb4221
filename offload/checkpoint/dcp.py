"""Checkpoints through ``torch.distributed.checkpoint`` (DCP): save, load (onto any world size); reading one back
into plain weights is ``offload.checkpoint.weights``'s.

What a checkpoint holds, one DCP entry each:
- ``module.<key>``: the module's state dict as it is (compute dtype; buffers and frozen params too; at
  stage 3 a frozen param's entry is written from this rank's shards and read back into them, chunk by
  chunk as the optimizer entries: ``_Frozen``);
- ``optim.<param>.<kind>`` for kind in master / exp_avg / exp_avg_sq: the fp32 optimizer state of
  each trainable parameter as a 1-D tensor of its numel. Each rank contributes the runs it holds
  as chunks (``_Entry``; with partitioned state, stages 1-2 over several ranks, the runs differ by
  rank); DCP then loads them onto any other partitioning, a different world size included;
- ``engine``: counters, loss scale, LR scheduler, hyperparameters, the layout's names and shapes
  (pickled, the same on every rank); ``client_state``; ``rng.rank<r>``: each rank's RNG states.

[Note: streaming state] The optimizer state is never gathered. Each optimizer entry is a
placeholder in the state dict (uninitialised memory that is never touched); the planners
resolve a write item, or commit a read item, by bringing in only the sub-groups it covers
(``_Resident``, at most a few at a time, written back if changed) and copying that run.
DCP's file writer is run with one file per rank and one thread, which resolves (and so holds) one
item at a time: a save writes a data file per rank and the ``.metadata`` file.
"""
from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import pickle
import sys
import warnings
from collections import OrderedDict
from typing import Any, Iterator

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType

from csrc import ConfigError
from offload.checkpoint.tags import LATEST, METADATA, failed_save, prune, resolve_path, write_latest
from offload.checkpoint.rng import rng_state, set_rng_state
from offload.hf.safetensors_out import generation_config_json, model_config_json

logger = logging.getLogger(__name__)

__all__ = ["checkpoint_path", "checkpoint_step", "load_checkpoint", "quiet_single_process", "resolve_path",
           "save_checkpoint"]

KINDS = ("master", "exp_avg", "exp_avg_sq")  # their places in a sub-group's state block
PROGRESS_MIN_BYTES = 256 << 20  # show a progress bar for saves and loads at least this large


@dataclasses.dataclass(frozen=True)
class _Run:
    """Elements [param_offset, param_offset + numel) of a param live at sg_offset in sub-group sg."""

    sg: int
    sg_offset: int
    param_offset: int
    numel: int


def _runs(layout) -> "OrderedDict[int, list[_Run]]":
    """Each trainable param's runs on this rank, params in order of first appearance by sub-group."""
    out: OrderedDict[int, list[_Run]] = OrderedDict()
    for sg in layout.sub_groups:
        for piece in sg.pieces:
            for slot, param_off, piece_off, n in layout.param_runs(piece):
                out.setdefault(slot.index, []).append(_Run(sg.index, piece.sub_start + piece_off, param_off, n))
    return out


class _Resident:
    """Sub-group state blocks held in host memory while a save or load walks them (LRU).

    Checkpoints hold the fp32 ``[master | exp_avg | exp_avg_sq]`` whatever ``offload.state_dtype``
    and ``offload.master_dtype`` are: a bf16 or int8 block is seen dequantized here (a bf16 master
    widened), and a load quantizes what it wrote when the block is given back (an fp32 master rounded
    to nearest into a bf16 one), so a checkpoint loads into a run of any state and master dtype."""

    def __init__(self, storage, *, write: bool) -> None:
        self.storage = storage
        self.write = write
        self.capacity = max(1, storage.window - 1)
        self._held: OrderedDict[int, tuple[torch.Tensor, torch.Tensor]] = OrderedDict()  # sg -> (block, fp32)

    def get(self, sg: int) -> torch.Tensor:
        held = self._held.get(sg)
        if held is not None:
            self._held.move_to_end(sg)
            return held[1]
        while len(self._held) >= self.capacity:
            self._give_back(*self._held.popitem(last=False))
        block = self.storage.acquire(sg)
        state = self.storage.format.unpack(self.storage.layout.sub_groups[sg], block)
        self._held[sg] = (block, state)
        return state

    def _give_back(self, sg: int, held: tuple[torch.Tensor, torch.Tensor]) -> None:
        if self.write:
            self.storage.format.pack(self.storage.layout.sub_groups[sg], held[1], held[0])
        self.storage.release(sg, dirty=self.write)

    def close(self) -> None:
        for sg in list(self._held):
            self._give_back(sg, self._held[sg])
        self._held.clear()
        self.storage.drain()


class _Entry:
    """One optimizer entry: a param's fp32 state of one kind, of which this rank holds some runs.

    It is no tensor and holds no memory: it answers DCP's checkpointable protocol (the one DTensor
    implements) with one chunk per run, so DCP plans the writes and reads of any partitioning, and
    loads onto any other, with no collective here and no ShardedTensor ([Note: streaming state])."""

    def __init__(self, runs: list, numel: int, dtype: torch.dtype = torch.float32) -> None:
        self.runs = runs  # each with a param_offset and a numel
        self.numel = numel
        self.dtype = dtype

    def size(self) -> torch.Size:
        return torch.Size([self.numel])

    def _chunk(self, run: _Run) -> ChunkStorageMetadata:
        return ChunkStorageMetadata(offsets=torch.Size([run.param_offset]), sizes=torch.Size([run.numel]))

    def __create_chunk_list__(self) -> list[ChunkStorageMetadata]:
        return [self._chunk(run) for run in self.runs]

    def __create_write_items__(self, fqn: str, _: object) -> list[WriteItem]:
        props = TensorProperties(dtype=self.dtype)
        return [WriteItem(index=MetadataIndex(fqn, torch.Size([run.param_offset])), type=WriteItemType.SHARD,
                          tensor_data=TensorWriteData(chunk=self._chunk(run), properties=props, size=self.size()))
                for run in self.runs]


class _Lazy:
    """The optimizer entries of one engine: their runs, and copies between runs and flat tensors."""

    def __init__(self, engine) -> None:
        self.layout = engine.layout
        self.storage = engine.adam.storage
        self.entries: dict[str, tuple[int, list[_Run], int]] = {}  # key -> (kind, runs, slot index)
        for index, runs in _runs(self.layout).items():
            name = self.layout.slots[index].name
            for k in range(len(KINDS)):
                self.entries[f"optim.{name}.{KINDS[k]}"] = (k, runs, index)
        self.total_bytes = sum(4 * r.numel for _, runs, _ in self.entries.values() for r in runs)

    def placeholders(self) -> dict[str, "_Entry"]:
        """The optimizer entries of the state dict: this rank's runs of each, as DCP chunks."""
        out: dict[str, _Entry] = {}
        for key, (_, runs, index) in self.entries.items():
            out[key] = _Entry(runs, self.layout.slots[index].numel)
        return out

    def overlaps(self, key: str, start: int, length: int) -> Iterator[tuple[_Run, int, int, int]]:
        """(run, offset in run, offset in [start, start+length), n) for each run overlapping the range."""
        for run in self.entries[key][1]:
            a, b = max(start, run.param_offset), min(start + length, run.param_offset + run.numel)
            if a < b:
                yield run, a - run.param_offset, a - start, b - a

    def block(self, state: torch.Tensor, sg: int, kind: int) -> torch.Tensor:
        n = self.layout.sub_groups[sg].numel
        return state[kind * n:(kind + 1) * n]


@dataclasses.dataclass(frozen=True)
class _ShardRun:
    """Elements [param_offset, param_offset + numel) of a frozen param live at shard_offset in unit's shard."""

    unit: int
    shard_offset: int
    param_offset: int
    numel: int


class _Frozen:
    """The module entries of the frozen params stage 3 partitions ([Note: frozen units] in offload.zero.units):
    each rank writes the runs its shards hold, in the compute dtype, and a load writes them back into the
    shards, one shard acquired at a time, so no process holds the frozen model whole. Empty at stages 0-2."""

    def __init__(self, engine) -> None:
        self.entries: dict[str, tuple[list[_ShardRun], int]] = {}  # "module.<key>" -> (runs, numel)
        self.shapes: dict[str, tuple[int, ...]] = {}  # "<key>" -> the param's shape (its entry is 1-D)
        stage3 = getattr(engine, "stage3", None)
        if stage3 is None:
            self.shards, self.ids = None, set()
            return
        layout, plan, params = stage3.layout, stage3.coordinator.plan, stage3.coordinator.params
        self.shards = stage3.shards
        runs: dict[int, tuple[list[_ShardRun], int]] = {}  # id(param) -> (this rank's runs, numel)
        shape_of: dict[int, tuple[int, ...]] = {}
        for b in layout.buckets[plan.trainable_units:]:
            lo, hi = b.shard_start(layout.rank), b.shard_start(layout.rank) + b.shard_numel
            for i in b.slots:
                slot = layout.slots[i]
                a, z = max(lo, slot.offset), min(hi, slot.offset + slot.numel)
                runs[id(params[i])] = ([_ShardRun(b.index, a - lo, a - slot.offset, z - a)] if a < z else [],
                                       slot.numel)  # (a parked param is empty: [Note: parked params])
                shape_of[id(params[i])] = slot.shape
        self.ids = set(runs)
        for key, value in engine.module.state_dict(keep_vars=True).items():
            if id(value) in runs:
                self.entries[f"module.{key}"] = runs[id(value)]
                self.shapes[key] = shape_of[id(value)]

    def placeholders(self) -> dict[str, _Entry]:
        return {key: _Entry(runs, numel, self.shards.dtype) for key, (runs, numel) in self.entries.items()}

    def _overlaps(self, key: str, start: int, length: int) -> Iterator[tuple[_ShardRun, int, int, int]]:
        for run in self.entries[key][0]:
            a, b = max(start, run.param_offset), min(start + length, run.param_offset + run.numel)
            if a < b:
                yield run, a - run.param_offset, a - start, b - a

    def read(self, key: str, start: int, length: int) -> torch.Tensor:
        out = torch.empty(length, dtype=self.shards.dtype)
        for run, run_off, out_off, n in self._overlaps(key, start, length):
            shard = self.shards.acquire(run.unit)
            try:
                at = run.shard_offset + run_off
                out[out_off:out_off + n].copy_(shard[at:at + n])
            finally:
                self.shards.release(run.unit, dirty=False)
        return out

    def write(self, key: str, start: int, tensor: torch.Tensor) -> None:
        for run, run_off, in_off, n in self._overlaps(key, start, tensor.numel()):
            shard = self.shards.acquire(run.unit)
            try:
                at = run.shard_offset + run_off
                shard[at:at + n].copy_(tensor.reshape(-1)[in_off:in_off + n])
            finally:
                self.shards.release(run.unit, dirty=True)


def _progress(total_bytes: int, what: str):
    """A rich progress bar for long transfers on a terminal, else None."""
    if total_bytes < PROGRESS_MIN_BYTES or not sys.stderr.isatty():
        return None
    from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TransferSpeedColumn

    progress = Progress(TextColumn(what), BarColumn(), DownloadColumn(), TransferSpeedColumn(), transient=True)
    progress.start()
    progress.add_task(what, total=total_bytes)
    return progress


class _SavePlanner(dcp.DefaultSavePlanner):
    def __init__(self, lazy: _Lazy, resident: _Resident, progress, frozen: _Frozen) -> None:
        super().__init__()
        self.lazy, self.resident, self.progress, self.frozen = lazy, resident, progress, frozen

    def resolve_data(self, write_item):
        key = write_item.index.fqn
        if key in self.frozen.entries:
            return self.frozen.read(key, write_item.tensor_data.chunk.offsets[0], write_item.tensor_data.chunk.sizes[0])
        if key not in self.lazy.entries:
            return super().resolve_data(write_item)
        kind = self.lazy.entries[key][0]
        start, length = write_item.tensor_data.chunk.offsets[0], write_item.tensor_data.chunk.sizes[0]
        out = torch.empty(length, dtype=torch.float32)
        for run, run_off, out_off, n in self.lazy.overlaps(key, start, length):
            src = self.lazy.block(self.resident.get(run.sg), run.sg, kind)
            out[out_off:out_off + n].copy_(src[run.sg_offset + run_off:run.sg_offset + run_off + n])
        if self.progress is not None:
            self.progress.advance(0, 4 * length)
        return out


class _LoadPlanner(dcp.DefaultLoadPlanner):
    def __init__(self, lazy: _Lazy, resident: _Resident, progress, frozen: _Frozen) -> None:
        super().__init__()
        self.lazy, self.resident, self.progress, self.frozen = lazy, resident, progress, frozen

    def set_up_planner(self, state_dict, metadata=None, is_coordinator=False) -> None:
        # DCP's set-up replaces every value that is not a tensor, a DTensor or plain data with None:
        # the optimizer entries (flat keys, nothing to flatten) stay out of it and come back after
        entries = {k: state_dict.pop(k) for k in list(state_dict) if isinstance(state_dict[k], _Entry)}
        super().set_up_planner(state_dict, metadata, is_coordinator)
        state_dict.update(entries)
        self.state_dict.update(entries)

    def resolve_tensor(self, read_item):
        if read_item.dest_index.fqn in self.frozen.entries:
            return torch.empty(list(read_item.lengths), dtype=self.frozen.shards.dtype)
        if read_item.dest_index.fqn not in self.lazy.entries:
            return super().resolve_tensor(read_item)
        return torch.empty(list(read_item.lengths), dtype=torch.float32)

    def commit_tensor(self, read_item, tensor) -> None:
        key = read_item.dest_index.fqn
        if key in self.frozen.entries:
            base = read_item.dest_index.offset[0] if read_item.dest_index.offset is not None else 0
            return self.frozen.write(key, base + read_item.dest_offsets[0], tensor)
        if key not in self.lazy.entries:
            return super().commit_tensor(read_item, tensor)
        kind = self.lazy.entries[key][0]
        base = read_item.dest_index.offset[0] if read_item.dest_index.offset is not None else 0
        start, length = base + read_item.dest_offsets[0], read_item.lengths[0]
        for run, run_off, in_off, n in self.lazy.overlaps(key, start, length):
            dst = self.lazy.block(self.resident.get(run.sg), run.sg, kind)
            dst[run.sg_offset + run_off:run.sg_offset + run_off + n].copy_(tensor[in_off:in_off + n])
        if self.progress is not None:
            self.progress.advance(0, 4 * length)


@contextlib.contextmanager
def quiet_single_process():
    """DCP warns that it assumes one process whenever torch.distributed is not initialized: that is meant here."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def _module_state(engine, frozen: _Frozen) -> dict[str, Any]:
    """The module's state dict; with stage 3 less its trainable params (their storage is released
    between uses, and their values are the fp32 masters the optimizer entries hold) and its partitioned
    frozen ones (``frozen``'s entries)."""
    if getattr(engine, "stage3", None) is None:
        return engine.module.state_dict()
    skip = {id(p) for g in engine.optimizer.param_groups for p in g["params"]} | frozen.ids
    return {k: v.detach() for k, v in engine.module.state_dict(keep_vars=True).items() if id(v) not in skip}


def _engine_meta(engine, frozen: _Frozen) -> dict[str, Any]:
    meta = engine.small_state()
    del meta["rng"], meta["client_state"]  # per rank, and the caller's: entries of their own
    meta.update(params=[(s.name, s.shape) for s in engine.layout.slots], frozen_shapes=dict(frozen.shapes),
                module_keys=list(engine.module.state_dict().keys()), world_size=engine.world_size,
                stage=engine.config.zero.stage, dtype=str(engine.compute_dtype), aliases=_aliases(engine),
                model_config=model_config_json(engine.module),
                generation_config=generation_config_json(engine.module))
    return meta


def _aliases(engine) -> dict[str, str]:
    """State-dict keys of a tied trainable param other than the name its optimizer state is saved under
    (a GPT's ``head.weight`` -> ``tok_emb.weight``)."""
    trainable = {id(p) for g in engine.optimizer.param_groups for p in g["params"]}
    first: dict[int, str] = {}
    out = {}
    for name, p in engine.module.named_parameters(remove_duplicate=False):
        if id(p) not in trainable:
            continue
        if id(p) in first:
            out[name] = first[id(p)]
        else:
            first[id(p)] = name
    return out


def _bytes(value: Any) -> bytes:
    return pickle.dumps(value)


def save_checkpoint(engine, save_dir: str, *, tag: str | None, client_state: dict, save_latest: bool) -> str:
    """Save to ``save_dir/tag`` (tag defaults to ``global_step<N>``); every rank calls it. Returns the path."""
    tag = tag or f"global_step{engine.global_steps}"
    path = os.path.join(save_dir, str(tag))
    lazy, frozen = _Lazy(engine), _Frozen(engine)
    state: dict[str, Any] = {f"module.{k}": v for k, v in _module_state(engine, frozen).items()}
    state.update(frozen.placeholders())
    state.update(lazy.placeholders())
    state["engine"] = _bytes(_engine_meta(engine, frozen))
    state["client_state"] = _bytes(client_state)
    state[f"rng.rank{engine.global_rank}"] = _bytes(rng_state())
    resident = _Resident(lazy.storage, write=False)
    progress = _progress(lazy.total_bytes, f"saving {path}")
    created = not os.path.exists(os.path.join(path, METADATA))  # written last, by rank 0: no race with the others
    try:
        with quiet_single_process():
            dcp.save(state, storage_writer=dcp.FileSystemWriter(path, single_file_per_rank=True, thread_count=1),
                     planner=_SavePlanner(lazy, resident, progress, frozen), no_dist=not dist.is_initialized())
    except (Exception, dcp.api.CheckpointException) as err:  # DCP's is a BaseException
        # every rank gets it: DCP gathers the ranks' write errors before it returns
        raise failed_save(path, err, created=created and engine.global_rank == 0) from err
    finally:
        resident.close()
        if progress is not None:
            progress.stop()
    engine.last_checkpoint = path
    if save_latest and engine.global_rank == 0:
        write_latest(save_dir, str(tag))
    if engine.global_rank == 0:
        prune(save_dir, engine.config.checkpoint.keep_last, str(tag))
    if dist.is_initialized():
        dist.barrier()
    logger.info("rank %d saved %s", engine.global_rank, path)
    return path


def load_checkpoint(engine, load_dir: str, *, tag: str | None, load_optimizer_states: bool,
                    load_lr_scheduler_states: bool) -> tuple[str | None, dict]:
    """Load what ``save_checkpoint`` saved, onto this engine's ranks and layout. Returns (path, client_state);
    (None, {}) when there is no checkpoint there."""
    path = resolve_path(load_dir, tag)
    if path is None:
        logger.warning("no checkpoint in %s (tag %s): nothing loaded", load_dir, tag or "from 'latest'")
        return None, {}
    metadata = dcp.FileSystemReader(path).read_metadata()
    lazy, frozen = _Lazy(engine), _Frozen(engine)
    state: dict[str, Any] = {f"module.{k}": v for k, v in _module_state(engine, frozen).items()}
    state.update(frozen.placeholders())
    for key, (_, numel) in frozen.entries.items():
        saved = metadata.state_dict_metadata.get(key)
        if saved is not None and tuple(saved.size) != (numel,):
            raise ConfigError(f"checkpoint {path} holds {key[len('module.'):]!r} as a whole tensor of shape "
                              f"{tuple(saved.size)}: it was saved at stages 0-2, and stage 3 loads a frozen parameter "
                              "only from a stage 3 checkpoint (its shards)")
    missing = [k for k in lazy.entries if k not in metadata.state_dict_metadata]
    if load_optimizer_states and missing:
        raise ConfigError(f"checkpoint {path} has no optimizer state for {missing[0]!r} "
                          f"({len(missing)} entries missing): it was saved from another model")
    if load_optimizer_states:
        state.update(lazy.placeholders())
    state["engine"] = b""
    state["client_state"] = b""
    rng_key = f"rng.rank{engine.global_rank}"
    if rng_key in metadata.state_dict_metadata:
        state[rng_key] = b""
    resident = _Resident(lazy.storage, write=True)
    progress = _progress(lazy.total_bytes if load_optimizer_states else 0, f"loading {path}")
    try:
        with quiet_single_process():
            dcp.load(state, storage_reader=dcp.FileSystemReader(path),
                     planner=_LoadPlanner(lazy, resident, progress, frozen), no_dist=not dist.is_initialized())
    finally:
        resident.close()
        if progress is not None:
            progress.stop()
    engine.restore_small_state(pickle.loads(state["engine"]), optimizer=load_optimizer_states,
                               scheduler=load_lr_scheduler_states, rng=False)
    if engine.stage3 is not None and load_optimizer_states:
        engine.stage3.reload_from_masters(engine.adam)
    elif frozen.entries:
        engine.stage3.coordinator.after_step()  # the frozen shards changed: drop what is gathered of them
    if rng_key in state:
        set_rng_state(pickle.loads(state[rng_key]))
    client_state = pickle.loads(state["client_state"])
    engine.client_state = dict(client_state) if isinstance(client_state, dict) else {}
    engine.zero_grad()
    engine.last_checkpoint = path
    logger.info("rank %d loaded %s", engine.global_rank, path)
    return path, client_state


def checkpoint_step(path: str) -> int:
    """The global step a checkpoint was saved at, read from its ``engine`` entry alone (each rank on its own)."""
    state: dict[str, Any] = {"engine": b""}
    with quiet_single_process():
        dcp.load(state, storage_reader=dcp.FileSystemReader(path), no_dist=True)
    return int(pickle.loads(state["engine"])["global_steps"])


def checkpoint_path(checkpoint: str) -> str:
    """``checkpoint`` itself, or the tag its ``latest`` file names when it is the save directory."""
    latest = os.path.join(checkpoint, LATEST)
    if os.path.isfile(latest) and not os.path.isfile(os.path.join(checkpoint, ".metadata")):
        with open(latest) as f:
            return os.path.join(checkpoint, f.read().strip())
    return checkpoint
