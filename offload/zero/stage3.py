"""Stage 3 set-up: units, layout, shards (on the device, host or NVMe), and the model's params put
in their partitions one module at a time.

[Note: materializing] A model built under ``offload.init_context`` has its parameters on the
meta device (no memory). Each of them is replaced by a parameter of no storage; then, module
by module in registration order, the units that module's params are in get their full
buffers, the module's ``reset_parameters()`` (or the context's ``param_init_fn``) fills
them, this rank's shard of each finished unit is written to the shard store and the buffer
is freed. So the most this process holds at once is the persistent units plus the units of
one module. A model with real parameters goes the same way, its values copied instead. A
Hugging Face model built in the context goes by its recorded init instead ([Note: init
replay] in ``offload.hf.model_init``): a unit is gathered (zeros) at the first step that writes
one of its params and its shard written after the last.
Every rank draws the same random numbers in the same order, so the ranks agree, and
with the same seed the values are those of the model built the plain way.
"""
from __future__ import annotations

import dataclasses
import logging
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist

from csrc import ConfigError
from offload.hf import model_init
from offload.config import OffloadDevice, resolve_daemon_socket, resolve_job_id
from offload.hf.load import PendingLoad, load_buffers, load_into_shards
from offload.plan.memory import flat_layout, plan_params
from offload.tiers import Tier, open_tier
from offload.zero.external import rebind
from offload.zero.layout import FlatLayout, SubGroup
from offload.zero.params import ParamCoordinator, Stage3Config
from offload.zero.shards import ShardStore
from offload.zero.units import UnitPlan, plan_units
from offload.zero import unit_fetch  # the module, not the function: tests replace its param_fetcher

logger = logging.getLogger(__name__)

__all__ = ["Stage3Parts", "build_stage3", "replace_meta_params"]


@dataclasses.dataclass
class Stage3Parts:
    """What ``initialize`` wires in for stage 3."""

    layout: FlatLayout
    """Every partitioned param's unit: the trainable ones, then the frozen ones ([Note: frozen units])."""
    optimizer_layout: FlatLayout
    """The trainable units only: the prefix of ``layout`` the optimizer state and the gradients cover."""
    shards: ShardStore
    coordinator: ParamCoordinator
    param_tier: Tier | None
    materialize_peak_bytes: int = 0
    """The most bytes the unit buffers held at once while the params were put in their partitions."""
    _holding: tuple[int, torch.Tensor] | None = None

    def fill_master(self, sg: SubGroup, master: torch.Tensor) -> None:
        """The fp32 master of a sub-group, from the compute-dtype shards it covers. The last shard read
        stays held (a unit spans many sub-groups: it is read from NVMe once); ``let_go`` gives it back."""
        for piece in sg.pieces:
            if self._holding is None or self._holding[0] != piece.bucket:
                self.let_go()
                self._holding = (piece.bucket, self.shards.acquire(piece.bucket))
            shard = self._holding[1]
            start = piece.flat_start - self.layout.buckets[piece.bucket].shard_start(self.layout.rank)
            master[piece.sub_start:piece.sub_start + piece.numel].copy_(shard[start:start + piece.numel])

    def let_go(self) -> None:
        """Give back the shard ``fill_master`` holds, if any."""
        if self._holding is not None:
            self.shards.release(self._holding[0], dirty=False)
            self._holding = None

    def reload_from_masters(self, adam) -> None:
        """After a checkpoint load: the compute-dtype shards from the fp32 masters, then regathered."""
        with torch.no_grad():
            for sg, state in adam.iter_states():
                master = adam.storage.format.master(sg, state)
                for piece in sg.pieces:
                    self.shards.params_out(piece).copy_(master[piece.sub_start:piece.sub_start + piece.numel])
        self.coordinator.after_step()

    def close(self) -> None:
        self.let_go()
        self.coordinator.close()
        self.shards.close()
        if self.param_tier is not None:
            self.param_tier.close()
            self.param_tier = None


def replace_meta_params(model: torch.nn.Module, dtype: torch.dtype, device: torch.device) -> bool:
    """Give every meta parameter a real one of no storage (ties kept) and buffers real zeros; True if any."""
    made: dict[int, torch.nn.Parameter] = {}
    for module in model.modules():
        for name, p in list(module._parameters.items()):
            if p is None or not p.is_meta:
                continue
            new = made.get(id(p))
            if new is None:
                data = torch.empty(p.shape, dtype=dtype if p.is_floating_point() else p.dtype, device=device)
                data.untyped_storage().resize_(0)
                new = made[id(p)] = torch.nn.Parameter(data, requires_grad=p.requires_grad)
            module._parameters[name] = new
        for name, buf in list(module._buffers.items()):
            if buf is not None and buf.is_meta:
                module._buffers[name] = torch.zeros(buf.shape, dtype=buf.dtype, device=device)
    if made:
        rebind(made)  # [Note: external parameters]
    return bool(made)


def _param_tier(zero, layout: FlatLayout, itemsize: int, *, rank: int, aio, checksum: bool,
                offload=None) -> Tier | None:
    """The store for the shards, opened from the memory plan (``offload.plan.memory.plan_params``)."""
    off = zero.offload_param
    if off.device == OffloadDevice.NONE:
        return None
    plan = plan_params(layout, itemsize, device=off.device.value, buffer_count=off.buffer_count,
                       nvme_path=off.nvme_path)
    # With a daemon the shards are a session of their own, "<job>.params": the node's pool and NVMe queue
    # serve both legs. It starts empty every time: a resume rebuilds the shards from the fp32 masters.
    socket = resolve_daemon_socket(offload) if offload is not None else None
    job = f"{resolve_job_id(offload)}.params" if socket else "params"

    def open_() -> Tier:
        return open_tier(plan, daemon_socket=socket, job_id=job, rank=rank, aio=aio, checksum=checksum,
                         huge_pages=offload.huge_pages if offload is not None else "auto",
                         reconnect_seconds=offload.daemon_reconnect_seconds if offload is not None else 300.0)

    tier = open_()
    if getattr(tier.store, "reattached", False):  # left by a process that died: its shards are stale
        tier.close()
        tier = open_()
    return tier


def _log_partition(plan, rank: int, threshold: int) -> None:
    """One line: how many params are partitioned and how many stay whole under the persistence
    threshold; a warning when that is all of them (stage 3 then partitions nothing)."""
    whole = sum(len(plan.buckets[u]) for u in plan.persistent)
    partitioned = sum(len(b) for b in plan.buckets) - whole
    units = len(plan.buckets) - len(plan.persistent)
    line = ("rank %d: stage 3: %d param(s) partitioned in %d unit(s), %d kept whole (fewer than "
            "stage3_param_persistence_threshold %d elements)")
    frozen = sum(len(plan.buckets[u]) for u in range(plan.trainable_units, len(plan.buckets)))
    if frozen:
        line += f"; {frozen} of them frozen, in units of their own with no optimizer state"
    if partitioned == 0:
        logger.warning(line + "; nothing is partitioned: lower the threshold to partition this model",
                       rank, partitioned, units, whole, threshold)
    else:
        logger.info(line, rank, partitioned, units, whole, threshold)


def build_stage3(model: torch.nn.Module, groups: Sequence[Sequence[torch.nn.Parameter]], names: dict[int, str], *,
                 zero, aio, checksum: bool, dtype: torch.dtype, device: torch.device, rank: int, world_size: int,
                 group: dist.ProcessGroup | None, sub_group_numel: int,
                 param_init_fn: Callable[[torch.nn.Module], None] | None = None, offload=None,
                 init_steps: list | None = None, pretrained: PendingLoad | None = None) -> Stage3Parts:
    """Lay out the units, open the shards' tier (the daemon's when ``offload``, the config's offload
    section, names one), put the params in their partitions, hook the modules. ``init_steps``
    (``offload.hf.model_init.plan_steps``): the recorded init to replay instead of ``reset_parameters``;
    ``pretrained`` (``offload.load_pretrained``): values read into the shards after the init."""
    trainable = {id(p) for g in groups for p in g}
    frozen = [p for p in model.parameters() if id(p) not in trainable and not p.requires_grad]
    plan = plan_units(model, groups, persistence_threshold=zero.stage3_param_persistence_threshold, frozen=frozen)
    params = [p for g in groups for p in g] + frozen
    described = [(names.get(id(p), f"param{i}"), tuple(p.shape), gi)
                 for gi, g in enumerate([*groups, frozen]) for i, p in enumerate(g)]
    layout = flat_layout(described, stage=3, reduce_bucket_size=zero.reduce_bucket_size, world_size=world_size,
                         rank=rank, sub=sub_group_numel, bucket_plan=plan.buckets)
    optimizer_layout = layout if not frozen else flat_layout(
        described[:len(params) - len(frozen)], stage=3, reduce_bucket_size=zero.reduce_bucket_size,
        world_size=world_size, rank=rank, sub=sub_group_numel, bucket_plan=plan.buckets[:plan.trainable_units])
    _log_partition(plan, rank, zero.stage3_param_persistence_threshold)
    logger.debug("rank %d: stage 3 layout: %s", rank, layout.describe())
    itemsize = torch.empty(0, dtype=dtype).element_size()
    tier = _param_tier(zero, layout, itemsize, rank=rank, aio=aio, checksum=checksum, offload=offload)
    logger.info("rank %d: stage 3 param shards in %s", rank,
                tier.placement if tier is not None else f"{device.type} memory (not offloaded)")
    try:
        shards = ShardStore(layout, dtype=dtype, device=device, tier=tier.store if tier else None,
                            nvme=zero.offload_param.device == OffloadDevice.NVME,
                            window=zero.offload_param.buffer_count)
        shards.allocate()
        fetcher = unit_fetch.param_fetcher(device) if tier is not None and world_size == 1 else None
        if fetcher is not None and device.type == "cuda":
            tier.register_with_cuda()  # the shards' copies read the segments directly ([Note: unit fetches])
        sources = [p.detach() if p.untyped_storage().nbytes() > 0 else None for p in params]
        coordinator = ParamCoordinator(model, layout, plan, shards, params,
                                       config=Stage3Config(prefetch_bucket_numel=zero.stage3_prefetch_bucket_size,
                                                           max_live_numel=zero.stage3_max_live_parameters,
                                                           max_reuse_distance_numel=zero.stage3_max_reuse_distance),
                                       group=group, world_size=world_size, fetcher=fetcher)
        if init_steps is not None and all(s is None for s in sources):
            loaded = set(pretrained.params) if pretrained is not None else set()
            peak = _replay_init(model, layout, shards, coordinator, params, names, init_steps, loaded)
        else:
            peak = _materialize(model, layout, plan, shards, coordinator, params, sources, param_init_fn)
        if pretrained is not None:
            load_buffers(model, pretrained)
            read = load_into_shards(pretrained, layout, shards)
            logger.info("rank %d: loaded %d tensors into the shards, %d bytes read at most at once", rank,
                        len(pretrained.params), read)
        del sources
        coordinator.after_step()  # nothing recorded yet: only gathers the persistent units
    except BaseException:
        if tier is not None:
            tier.close()
        raise
    return Stage3Parts(layout, optimizer_layout, shards, coordinator, tier, peak)


def _materialize(model, layout: FlatLayout, plan: UnitPlan, shards: ShardStore, coordinator: ParamCoordinator,
                 params: Sequence[torch.nn.Parameter], sources: list[torch.Tensor | None],
                 param_init_fn: Callable[[torch.nn.Module], None] | None) -> int:
    """[Note: materializing]: fill every unit and write this rank's shard of it. Returns the peak bytes held."""
    index_of = {id(p): i for i, p in enumerate(params)}
    unit_of = {i: b.index for b in layout.buckets for i in b.slots}
    peak = 0
    filled: set[int] = set()
    written: set[int] = set()
    with torch.no_grad():
        for module in model.modules():
            own = [p for p in module.parameters(recurse=False) if id(p) in index_of]
            if all(index_of[id(p)] in filled for p in own):
                continue  # no params, or tied ones placed already
            units = sorted({unit_of[index_of[id(p)]] for p in own})
            for u in units:
                if coordinator.is_gathered(u):
                    continue
                if u in written:  # a tied param placed with another module: bring its unit back
                    coordinator._gather(u)
                else:
                    coordinator._full[u].untyped_storage().resize_(coordinator._full[u].numel() * shards.itemsize)
                    coordinator._full[u].zero_()
            peak = max(peak, sum(f.untyped_storage().nbytes() for f in coordinator._full))
            if any(index_of[id(p)] not in filled and sources[index_of[id(p)]] is None for p in own):
                done = [(p, p.detach().clone()) for p in own if index_of[id(p)] in filled]
                _init_module(module, param_init_fn)
                for p, value in done:
                    p.copy_(value)
            for p in own:
                src = sources[index_of[id(p)]]
                if src is not None:
                    p.copy_(src)
                    sources[index_of[id(p)]] = None  # the original is dropped as soon as it is placed
                filled.add(index_of[id(p)])
            for u in units:
                if all(i in filled for i in layout.buckets[u].slots):
                    _write_shard(coordinator, shards, layout, u)
                    written.add(u)
    return peak


def _replay_init(model, layout: FlatLayout, shards: ShardStore, coordinator: ParamCoordinator,
                 params: Sequence[torch.nn.Parameter], names: dict[int, str], steps: list,
                 loaded: set[str]) -> int:
    """[Note: init replay]: the recorded draws and init steps, each unit gathered from its first write to
    its last. Returns the peak bytes held."""
    unit_of = {names[id(params[i])]: b.index for b in layout.buckets for i in b.slots}
    model_init.check_written(steps, set(unit_of) - loaded)
    last: dict[int, int] = {}
    for k, step in enumerate(steps):
        for name in _real_writes(step, unit_of):
            last[unit_of[name]] = k
    peak = 0
    with torch.no_grad():
        for k, step in enumerate(steps):
            if isinstance(step, model_init.Draw):
                model_init.replay_draw(step)
                continue
            units = sorted({unit_of[n] for n in _real_writes(step, unit_of)})
            for u in units:
                if not coordinator.is_gathered(u):
                    coordinator._full[u].untyped_storage().resize_(coordinator._full[u].numel() * shards.itemsize)
                    coordinator._full[u].zero_()
            peak = max(peak, sum(f.untyped_storage().nbytes() for f in coordinator._full))
            model_init.replay(step, model)
            for u in units:
                if last[u] == k:
                    _write_shard(coordinator, shards, layout, u)
    return peak


def _real_writes(step, unit_of: dict[str, int]) -> list[str]:
    """The partitioned params a step writes for good (not through a tied alias)."""
    if isinstance(step, model_init.Draw):
        return []
    return [n for n in step.writes if n in unit_of and n not in step.scratch]


def _init_module(module: torch.nn.Module, param_init_fn) -> None:
    if param_init_fn is not None:
        param_init_fn(module)
    elif hasattr(module, "reset_parameters"):
        module.reset_parameters()
    else:
        raise ConfigError(f"stage 3 cannot initialize the meta parameters of {type(module).__name__}: it has no "
                          "reset_parameters(); pass init_context(param_init_fn=...)")


def _write_shard(coordinator: ParamCoordinator, shards: ShardStore, layout: FlatLayout, u: int) -> None:
    b = layout.buckets[u]
    full = coordinator._full[u]
    shard = shards.acquire(u)
    try:
        shard.copy_(full[layout.rank * b.shard_numel:(layout.rank + 1) * b.shard_numel])
    finally:
        shards.release(u, dirty=True)
    coordinator._free(u)
