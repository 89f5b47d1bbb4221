"""``offload estimate``: device, host and NVMe bytes per ZeRO stage and offload choice, before a run.

[Note: estimate] Two figures per row. The ZeRO paper's model states per device (mixed
precision with Adam: ``c`` bytes per compute-dtype element, K = 12 bytes of fp32 master and
moments; Psi parameters, N ranks):

    stage 0: (2c + 12) Psi      stage 1: 2c Psi + 12 Psi / N
    stage 2: c Psi + (c + 12) Psi / N      stage 3: (2c + 12) Psi / N

placed as the row offloads them, the way DeepSpeed's ``estimate_zero2_model_states_mem_needs`` and
``estimate_zero3_model_states_mem_needs`` place them (``zero_formula_places``; without their 1.5
``additional_buffer_factor``): the params, c Psi (/ N at stage 3), on the device, or in host memory or
on NVMe with ``offload_param``; with ``offload_optimizer`` none the gradients, c Psi (/ N from stage 2),
and the K Psi (/ N from stage 1) of state on the device; with it, the state in host memory (cpu) or on
NVMe (nvme) and the gradients reduced into its fp32 partition in host memory, 4 Psi (/ N from stage 1;
DeepSpeed's 16 = 4 + K), none kept on the device; at stage 3 also the largest param gathered with its
gradient, 2c L, on the device (DeepSpeed's ``largest_layer_memory``). So the nothing-offloaded rows of
stages 0-2 give the paper's figure, and DeepSpeed's stage-3 figures come out with c = 2 (its
all-on-GPU row counts 18 Psi / N where the paper counts 16).

And what this engine holds, where. The model is laid out as the engine lays it out (its params'
shapes and stage 3's units, ``offload.plan.memory.flat_layout``), and the tiers' regions are the
memory plan's, the very plan the builder opens them from ([Note: memory plan] in offload.plan.memory):
- stages 0-2: the flat params and the flat gradients (``c`` each, whole model) on the device, and the
  optimizer's tier: the gradient accumulators of the rank's partition and its state blocks on the
  device (offload none), in the tier's host pool (cpu), or on NVMe with a window of them in the pool
  (nvme); with a daemon, the session's commit region and undo log (or undo copy) beside them;
- stage 3: the compute-dtype shards of the partition (device, host pool, or NVMe with
  ``offload_param.buffer_count`` pool segments each as large as the largest shard); the
  gathered units (the persistent ones plus at most max(``stage3_max_live_parameters``, the
  largest unit)); per-unit gradient buffers (the unit in backward, the persistent one, and
  autograd's gradient of the largest param); the optimizer as above;
- stages 0-2 with the state offloaded: a host staging buffer of the partition in the compute
  dtype where the updated params do not go straight into the model (a GPU model, the delayed
  update, the overlapped step), and the overlapped step's rollback copies (offload cpu: 12
  bytes per element of as many sub-groups as ``offload.zero.overlap.copies_that_fit`` allows);
- activations saved for backward, when the model is known (a GPT spec); backward's scratch
  (a transposed or packed copy of the largest weight and its fresh gradient); and the process's
  own memory (Python, torch, libraries: measured in this process after importing torch).
The device here may be the CPU: then device and host are the same memory, and their sum is
what the process holds (``EstimateRow.process_bytes``).
"""
from __future__ import annotations

import dataclasses
import logging
import math
from typing import Any, Iterable

import torch

from csrc import ConfigError
from offload.plan.memory import OptimizerSettings, Region, flat_layout, plan_optimizer, plan_params, sub_group_numel
from offload.zero.device_share import device_sub_groups
from offload.zero.layout import FlatLayout
from offload.zero.overlap import copies_that_fit, overlap_wanted
from offload.zero.state_format import StateFormat

logger = logging.getLogger(__name__)

__all__ = ["EstimateInput", "EstimateRow", "Estimate", "ModelShapes", "estimate", "gpt_shapes", "shapes_from_count",
           "shapes_from_model", "process_baseline_bytes", "format_table", "zero_formula_bytes",
           "zero_formula_places"]

DEVICES = ("none", "cpu", "nvme")
PLACE_OF = {"none": "device", "cpu": "host", "nvme": "nvme"}
"""Where an offload_optimizer / offload_param device puts what it holds."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class ModelShapes:
    """What the estimate needs of a model: its trainable params' shapes and how stage 3 cuts them into units,
    so that the estimate lays them out as the engine does (``offload.plan.memory.flat_layout``)."""

    shapes: tuple[tuple[int, ...], ...]
    """Each trainable parameter's shape, in registration order (a tied weight once)."""
    unit_plan: tuple[tuple[int, ...], ...]
    """Stage 3's units: the indexes into ``shapes`` of each, in module order (``offload.zero.units``)."""
    persistent_units: frozenset[int] = frozenset()
    """Units that stay gathered (their params below stage3_param_persistence_threshold)."""
    activation_elements: int = 0
    """Elements autograd saves for backward per micro-batch (0: not known)."""

    @property
    def numels(self) -> list[int]:
        return [math.prod(s) for s in self.shapes]

    @property
    def params(self) -> int:
        """Trainable parameter elements."""
        return sum(self.numels)

    @property
    def largest_param(self) -> int:
        """Elements of the largest single parameter."""
        return max(self.numels)

    def layout(self, *, stage: int, world_size: int, reduce_bucket_size: int, sub: int, overlap: bool) -> FlatLayout:
        """Rank 0's layout as the engine cuts it for ``stage`` (stage 3: a bucket per unit)."""
        return flat_layout([(f"p{i}", s, 0) for i, s in enumerate(self.shapes)], stage=stage,
                           reduce_bucket_size=reduce_bucket_size, world_size=world_size, rank=0, sub=sub,
                           overlap=overlap, bucket_plan=self.unit_plan if stage == 3 else None)


def shapes_from_model(model: torch.nn.Module, *, persistence_threshold: int,
                      activation_elements: int = 0) -> ModelShapes:
    """The shapes of a model (a meta one costs no memory), cut into units as stage 3 cuts them."""
    from offload.zero.units import plan_units

    params = [p for p in model.parameters() if p.requires_grad]
    plan = plan_units(model, [params], persistence_threshold=persistence_threshold)
    return ModelShapes(shapes=tuple(tuple(p.shape) for p in params), unit_plan=plan.buckets,
                       persistent_units=frozenset(plan.persistent), activation_elements=activation_elements)


def shapes_from_count(params: int, *, largest_layer: int | None = None) -> ModelShapes:
    """A model known by its size only: params of ``largest_layer`` elements, each a unit (default: 1/96 of
    the model, a GPT's MLP matrix at 32 layers), no persistent params, activations unknown."""
    if params < 1:
        raise ConfigError(f"the parameter count must be >= 1, got {params}")
    largest = max(1, min(params, largest_layer or params // 96 or params))
    full, rest = divmod(params, largest)
    shapes = ((largest,),) * full + (((rest,),) if rest else ())
    return ModelShapes(shapes=shapes, unit_plan=tuple((i,) for i in range(len(shapes))))


def gpt_activation_elements(*, n_layer: int, n_embd: int, n_head: int, vocab_size: int, seq: int, batch: int) -> int:
    """Elements a pre-LayerNorm GPT block saves for backward (the inputs of both norms, qkv, attention
    output and its projection, the MLP's input, widened and GELU'd activations, the residuals: about
    16 B T d, plus the attention's B h T log-sum-exps) per layer, and the logits with their softmax."""
    bt = batch * seq
    per_layer = 16 * bt * n_embd + batch * n_head * seq
    return n_layer * per_layer + 2 * bt * vocab_size + 4 * bt * n_embd


def gpt_shapes(*, vocab_size: int, n_layer: int, n_embd: int, seq: int, batch: int, n_head: int = 0,
               tied_head: bool = True, bias: bool = True, persistence_threshold: int = 100_000) -> ModelShapes:
    """The shapes of ``offload.models.gpt.GPT`` for that config, built on the meta device."""
    from offload.models.gpt import GPT, GPTConfig

    heads = n_head or max(1, n_embd // 128)
    cfg = GPTConfig(vocab_size=vocab_size, block_size=seq, n_layer=n_layer, n_head=heads, n_embd=n_embd,
                    bias=bias, tied_head=tied_head)
    with torch.device("meta"):
        model = GPT(cfg)
    act = gpt_activation_elements(n_layer=n_layer, n_embd=n_embd, n_head=heads, vocab_size=vocab_size, seq=seq,
                                  batch=batch)
    return shapes_from_model(model, persistence_threshold=persistence_threshold, activation_elements=act)


def process_baseline_bytes() -> int:
    """Resident bytes of this process now (torch imported): what a trainer holds before its model."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


@dataclasses.dataclass(frozen=True, kw_only=True)
class EstimateInput:
    """The model and the engine settings the estimate depends on."""

    shapes: ModelShapes
    """The model."""
    world_size: int = 1
    """Ranks the model is partitioned over."""
    compute_bytes: int = 4
    """Bytes per compute-dtype element: 4 fp32, 2 bf16/fp16."""
    sub_group_size: int = 1_000_000_000
    """zero_optimization.sub_group_size."""
    reduce_bucket_size: int = 500_000_000
    """zero_optimization.reduce_bucket_size (stages 0-2 cut their buckets by it)."""
    optimizer_buffer_count: int = 4
    """offload_optimizer.buffer_count (state blocks in host memory with nvme: the window's floor)."""
    host_memory_bytes: int | None = None
    """offload.host_memory_bytes: the budget the engine sizes the optimizer state's NVMe window from;
    None: as the engine does, from the memory available (``available_host_bytes``; ``offload.plan.budget``)."""
    available_host_bytes: int | None = None
    """The host memory available on the machine asked about (``offload estimate --host-gib``): the budgets
    the engine takes from MemAvailable (the NVMe window, gradient_tier "auto", the overlapped step's rollback
    copies) are taken from it, 1/FREE_SHARE of it over ``node_ranks``; None: this machine's, now."""
    daemon: bool = False
    """Through a node daemon without ``host_memory_bytes``: the engine sizes the window (and judges
    ``offload.gradient_tier`` "auto") by the rank's share of the daemon's pool when it starts
    (``offload.plan.daemon_pool``); the estimate does the same with ``daemon_pool``, else takes the window's
    floor, buffer_count blocks."""
    daemon_pool: Any = None
    """The daemon's pool (``offload.plan.daemon_pool.DaemonPool``) as its STATUS gave it, read by ``offload
    estimate`` from the daemon the config names; None: not read."""
    local_ranks: int | None = None
    """Ranks of the job on the node, sharing the daemon's pool (LOCAL_WORLD_SIZE); None: ``world_size``."""

    param_buffer_count: int = 5
    """offload_param.buffer_count (shards in host memory with nvme)."""
    max_live: int = 1_000_000_000
    """stage3_max_live_parameters (elements)."""
    baseline_bytes: int = 0
    """The process's own memory before the model (Python, torch)."""
    gpu: bool = False
    """The model computes on a GPU: offloaded updates go through a host staging buffer, and
    ``offload.overlap_step`` "auto" is on."""
    overlap_step: bool | str = "auto"
    """offload.overlap_step."""
    delayed_update: bool = False
    """offload.delayed_update."""
    state_dtype: str = "fp32"
    """offload.state_dtype: the offloaded moments' storage (fp32 12, bf16 8, int8 ~6.03 bytes per element
    with the master; ``offload.zero.state_format``)."""
    master_dtype: str = "fp32"
    """offload.master_dtype: the offloaded master's storage (fp32 4, bf16 2 bytes per element)."""
    gradient_tier: str = "auto"
    """offload.gradient_tier: stage 3's accumulators resident or on NVMe ([Note: gradient tier])."""
    grad_accum_dtype: str = "fp32"
    """data_types.grad_accum_dtype: the offloaded accumulators' dtype (fp32 4, bf16 2 bytes per element)."""
    ratio: float = 1.0
    """offload_optimizer.ratio at stages 0-2: the share offloaded, the rest kept on the device ([Note: GPU-resident
    share] in offload.zero.device_share; "auto" depends on the device's free memory at start: counted as 1.0)."""

    @property
    def node_ranks(self) -> int:
        """The ranks sharing the daemon's pool: ``local_ranks``, else ``world_size``."""
        return self.local_ranks or self.world_size

    def optimizer_settings(self, device: str, stage: int) -> OptimizerSettings:
        """The optimizer tier's settings (``offload.plan.memory``) for one row."""
        return OptimizerSettings(device=device, stage=stage, buffer_count=self.optimizer_buffer_count,
                                 state_dtype=self.state_dtype, master_dtype=self.master_dtype,
                                 grad_accum_dtype=self.grad_accum_dtype, gradient_tier=self.gradient_tier,
                                 host_memory_bytes=self.host_memory_bytes, daemon=self.daemon)

    def overlap(self, stage: int, optimizer: str) -> bool:
        """Whether the engine runs the overlapped step for the row (``offload.zero.overlap.overlap_wanted``)."""
        return overlap_wanted(self.overlap_step, device_type="cuda" if self.gpu else "cpu", stage=stage,
                              offloaded=optimizer != "none", delayed=self.delayed_update, log=False)

    def layout(self, stage: int, optimizer: str) -> FlatLayout:
        """Rank 0's layout for the row, as the builder cuts it."""
        return self.shapes.layout(stage=stage, world_size=self.world_size, reduce_bucket_size=self.reduce_bucket_size,
                                  sub=sub_group_numel(self.sub_group_size, offloaded=optimizer != "none"),
                                  overlap=self.overlap(stage, optimizer))

    @classmethod
    def from_config(cls, config: Any, shapes: ModelShapes, *, world_size: int = 1,
                    baseline_bytes: int = 0, gpu: bool = False) -> "EstimateInput":
        """From an engine config (a dict or a JSON path, as ``initialize`` takes it)."""
        from offload.config import read_config, resolve_daemon_socket

        cfg = read_config(config, world_size=world_size)
        z = cfg.zero
        itemsize = 2 if (cfg.bf16.enabled or cfg.fp16.enabled) else 4
        return cls(shapes=shapes, world_size=world_size, compute_bytes=itemsize, sub_group_size=z.sub_group_size,
                   reduce_bucket_size=z.reduce_bucket_size,
                   optimizer_buffer_count=z.offload_optimizer.buffer_count,
                   host_memory_bytes=cfg.offload.host_memory_bytes, daemon=bool(resolve_daemon_socket(cfg.offload)),
                   param_buffer_count=z.offload_param.buffer_count, max_live=z.stage3_max_live_parameters,
                   baseline_bytes=baseline_bytes, gpu=gpu, overlap_step=cfg.offload.overlap_step,
                   delayed_update=cfg.offload.delayed_update, state_dtype=cfg.offload.state_dtype,
                   master_dtype=cfg.offload.master_dtype, gradient_tier=cfg.offload.gradient_tier,
                   grad_accum_dtype=cfg.data_types.grad_accum_dtype,
                   ratio=1.0 if z.offload_optimizer.ratio == "auto" else z.offload_optimizer.ratio)


@dataclasses.dataclass(frozen=True, kw_only=True)
class EstimateRow:
    """Bytes per place for one stage and offload choice, on one rank."""

    stage: int
    optimizer: str
    """offload_optimizer.device."""
    param: str
    """offload_param.device."""
    device_bytes: int
    """On the model's device: params, gradients, gathered units, activations (and states with offload none)."""
    host_bytes: int
    """Host memory: the tiers' pools and the process's own memory."""
    nvme_bytes: int
    """Swap file space."""
    zero_device_bytes: int
    """The ZeRO formulas' model states per rank on the device, placed as this row offloads them
    (``zero_formula_places``, [Note: estimate]), for comparison."""
    zero_host_bytes: int
    """The same formulas' model states per rank in host memory."""
    zero_nvme_bytes: int
    """The same formulas' model states per rank on NVMe."""
    parts: tuple[tuple[str, str, int], ...]
    """(what, where, bytes) behind the totals."""
    sessions: tuple[int, ...] = ()
    """Through a node daemon: the bytes each daemon session of the rank asks for before packing (the
    optimizer's, and stage 3's param shards'), ``TierPlan.session_bytes`` of the memory plan."""

    @property
    def process_bytes(self) -> int:
        """Device + host: what one process holds when the device is the CPU."""
        return self.device_bytes + self.host_bytes


@dataclasses.dataclass(frozen=True)
class Estimate:
    rows: tuple[EstimateRow, ...]

    def row(self, *, stage: int, optimizer: str = "none", param: str = "none") -> EstimateRow:
        for r in self.rows:
            if (r.stage, r.optimizer, r.param) == (stage, optimizer, param):
                return r
        raise ConfigError(f"no estimate row for stage {stage}, optimizer {optimizer}, param {param}")


def zero_formula_bytes(stage: int, params: int, world_size: int, compute_bytes: int) -> int:
    """The ZeRO paper's model-state bytes per device ([Note: estimate])."""
    c, n = compute_bytes, world_size
    if stage == 0:
        return (2 * c + 12) * params
    if stage == 1:
        return 2 * c * params + 12 * params // n
    if stage == 2:
        return c * params + (c + 12) * params // n
    if stage == 3:
        return (2 * c + 12) * params // n
    raise ConfigError(f"stage must be 0-3, got {stage}")


def zero_formula_places(stage: int, optimizer: str, param: str, *, params: int, largest_param: int,
                        world_size: int, compute_bytes: int) -> dict[str, int]:
    """The ZeRO formulas' model-state bytes per rank, "device", "host" and "nvme", for one stage and offload
    choice, placed as DeepSpeed's memory estimators place them ([Note: estimate])."""
    if stage not in (0, 1, 2, 3):
        raise ConfigError(f"stage must be 0-3, got {stage}")
    c, n, psi = compute_bytes, world_size, params
    by_params, by_grads, by_state = (n if stage == 3 else 1), (n if stage >= 2 else 1), (n if stage >= 1 else 1)
    places = {"device": 0, "host": 0, "nvme": 0}
    places[PLACE_OF[param]] += c * psi // by_params
    if optimizer == "none":
        places["device"] += c * psi // by_grads + 12 * psi // by_state
    else:  # the gradients go to the state's fp32 partition in host memory as they are reduced
        places["host"] += 4 * psi // by_state
        places[PLACE_OF[optimizer]] += 12 * psi // by_state
    if stage == 3:
        places["device"] += 2 * c * largest_param  # the largest param gathered, and its gradient
    return places


def _parts(regions: Iterable[Region]) -> list[tuple[str, str, int]]:
    return [(r.what, r.where, r.nbytes) for r in regions]


def _optimizer_parts(layout: FlatLayout, optimizer: str, stage: int, inp: EstimateInput) -> tuple[list, int]:
    """The optimizer state's regions from the memory plan, and its daemon session's bytes (0: none)."""
    if optimizer == "none":
        n = layout.partition_numel
        return [("fp32 gradient accumulators", "device", 4 * n), ("fp32 master + moments", "device", 12 * n)], 0
    pool = inp.daemon_pool if inp.daemon and inp.host_memory_bytes is None else None
    kept = device_sub_groups(layout, inp.ratio)
    plan = plan_optimizer(layout, inp.optimizer_settings(optimizer, stage), pool=pool, local_ranks=inp.node_ranks,
                          log=False, available=inp.available_host_bytes, on_device=kept)
    n = sum(layout.sub_groups[i].numel for i in kept)
    on_device = [("fp32 master + moments (kept by offload_optimizer.ratio)", "device", 12 * n),
                 ("fp32 gradient accumulators (kept by offload_optimizer.ratio)", "device", 4 * n)] if n else []
    return _parts(plan.regions()) + on_device, _session_bytes(plan.tier, inp)


def _session_bytes(tier: Any, inp: EstimateInput) -> int:
    """A daemon session's quota for ``tier`` (a ``TierPlan``): packed in the pool's segments where the pool
    was read ([Note: quota in segments]), else before packing."""
    pool = inp.daemon_pool
    return tier.quota_bytes(pool.segment_bytes) if pool is not None else tier.session_bytes()


def _staged_update_parts(stage: int, layout: FlatLayout, optimizer: str, inp: EstimateInput) -> list[tuple[str, str, int]]:
    """The staging buffer and the overlapped step's rollback copies (``offload.zero.optimizer``, ``.overlap``)."""
    if optimizer == "none":
        return []
    overlap = inp.overlap(stage, optimizer)
    parts = []
    if stage < 3 and (inp.gpu or inp.delayed_update or overlap):
        parts.append(("param staging (compute dtype)", "host", inp.compute_bytes * layout.partition_numel))
    if overlap and optimizer == "cpu":  # a copy of each state block stepped early, the largest first
        fmt = StateFormat(inp.state_dtype, inp.master_dtype)
        kept = device_sub_groups(layout, inp.ratio)  # (stepped on the device: no copy)
        sgs = sorted((sg for sg in layout.sub_groups if sg.index not in kept), key=lambda sg: sg.numel, reverse=True)
        copies = min(len(sgs), copies_that_fit([sg.numel for sg in sgs], available=inp.available_host_bytes,
                                               local_ranks=inp.node_ranks, log=False))
        parts.append(("rollback copies (offload.overlap_step)", "host", sum(fmt.state_bytes(sg) for sg in sgs[:copies])))
        if stage == 3:  # and the early sub-groups' new params until the verdict ([Note: early steps at stage 3])
            parts.append(("early params (offload.overlap_step)", "host", copies * inp.compute_bytes * sgs[0].numel))
    return parts


def _stage012(stage: int, optimizer: str, inp: EstimateInput) -> tuple[list, tuple[int, ...]]:
    layout = inp.layout(stage, optimizer)
    c, total = inp.compute_bytes, layout.total_numel
    parts, session = _optimizer_parts(layout, optimizer, stage, inp)
    return [("flat params", "device", c * total), ("flat gradients", "device", c * total), *parts,
            *_staged_update_parts(stage, layout, optimizer, inp)], (session,) if session else ()


def _stage3(optimizer: str, param: str, inp: EstimateInput) -> tuple[list, tuple[int, ...]]:
    s, c = inp.shapes, inp.compute_bytes
    layout = inp.layout(3, optimizer)
    units = [b.numel for b in layout.buckets if b.index not in s.persistent_units]
    persistent = sum(b.numel for b in layout.buckets if b.index in s.persistent_units)
    largest = max(units, default=0)
    live = min(sum(units), max(inp.max_live, largest))
    parts = [("gathered units (persistent + live)", "device", c * (persistent + live)),
             ("unit gradient buffers", "device", c * (largest + persistent + s.largest_param))]
    sessions = []
    if param == "none":
        parts.append(("param shards", "device", c * layout.partition_numel))
    else:
        shards = plan_params(layout, c, device=param, buffer_count=inp.param_buffer_count, nvme_path=None)
        if shards.nvme:
            parts += [("param shards in flight (buffer_count segments)", "host", shards.resident_bytes),
                      ("param shards", "nvme", shards.swap_bytes),
                      ("rest of the shards' swap file (whole stripes)", "nvme", shards.swap_capacity_bytes - shards.swap_bytes)]
        else:
            parts.append(("param shards", "host", shards.resident_bytes))
        sessions.append(_session_bytes(shards, inp))
    opt, session = _optimizer_parts(layout, optimizer, 3, inp)
    return parts + opt + _staged_update_parts(3, layout, optimizer, inp), ((session,) if session else ()) + tuple(sessions)


def estimate(inp: EstimateInput, *, stages: Iterable[int] = (0, 1, 2, 3)) -> Estimate:
    """Every stage and offload choice the engine accepts (offload_param only with stage 3)."""
    rows = []
    act = inp.compute_bytes * inp.shapes.activation_elements
    for stage in stages:
        pairs = [(o, p) for o in DEVICES for p in DEVICES] if stage == 3 else [(o, "none") for o in DEVICES]
        for optimizer, param in pairs:
            parts, sessions = _stage3(optimizer, param, inp) if stage == 3 else _stage012(stage, optimizer, inp)
            if act:
                parts.append(("activations", "device", act))
            # backward's matmuls hold a transposed or packed copy of the weight and its fresh gradient at once
            parts.append(("compute scratch (2 x largest param)", "device", 2 * inp.compute_bytes * inp.shapes.largest_param))
            if inp.baseline_bytes:
                parts.append(("process (Python, torch)", "host", inp.baseline_bytes))
            total = {w: sum(b for _, where, b in parts if where == w) for w in ("device", "host", "nvme")}
            zero = zero_formula_places(stage, optimizer, param, params=inp.shapes.params,
                                       largest_param=inp.shapes.largest_param, world_size=inp.world_size,
                                       compute_bytes=inp.compute_bytes)
            rows.append(EstimateRow(stage=stage, optimizer=optimizer, param=param, device_bytes=total["device"],
                                    host_bytes=total["host"], nvme_bytes=total["nvme"],
                                    zero_device_bytes=zero["device"], zero_host_bytes=zero["host"],
                                    zero_nvme_bytes=zero["nvme"], parts=tuple(parts), sessions=sessions))
    return Estimate(tuple(rows))


def _gib(n: int) -> str:
    return f"{n / (1 << 30):.2f}"


def format_table(est: Estimate, *, title: str = "", detail: EstimateRow | None = None, gpu_column: bool = True,
                 verdicts: dict[int, str] | None = None, marked: EstimateRow | None = None) -> str:
    """A plain-text table of the rows (GiB), and the parts behind one row if ``detail``. Without
    ``gpu_column`` the device is the CPU: one "host GiB" column of device + host bytes (and one of the
    ZeRO formula's). ``verdicts``: a "fits" column (row index -> text); ``marked``: the configured row, flagged."""
    if gpu_column:
        head = ["stage", "offload_optimizer", "offload_param", "device GiB", "host GiB", "NVMe GiB", "device+host GiB",
                "ZeRO device GiB", "ZeRO host GiB"]
        body = [[str(r.stage), r.optimizer, r.param, _gib(r.device_bytes), _gib(r.host_bytes), _gib(r.nvme_bytes),
                 _gib(r.process_bytes), _gib(r.zero_device_bytes), _gib(r.zero_host_bytes)] for r in est.rows]
    else:
        head = ["stage", "offload_optimizer", "offload_param", "host GiB", "NVMe GiB", "ZeRO formula GiB"]
        body = [[str(r.stage), r.optimizer, r.param, _gib(r.process_bytes), _gib(r.nvme_bytes),
                 _gib(r.zero_device_bytes + r.zero_host_bytes)] for r in est.rows]
    numeric = len(head)
    if verdicts is not None:
        head.append("fits")
        for i, row in enumerate(body):
            row.append(verdicts[i])
    if marked is not None:
        head.append("")
        for r, row in zip(est.rows, body):
            row.append("<- the config" if r is marked else "")
    widths = [max(len(row[i]) for row in [head, *body]) for i in range(len(head))]
    lines = [title] if title else []
    for k, row in enumerate([head, *body]):
        cells = [cell.rjust(w) if 3 <= i < numeric else cell.ljust(w) for i, (cell, w) in enumerate(zip(row, widths))]
        lines.append("  ".join(cells).rstrip())
        if k == 0:
            lines.append("  ".join("-" * w for w in widths))
    if detail is not None:
        lines += ["", f"stage {detail.stage}, offload_optimizer {detail.optimizer}, offload_param {detail.param}:"]
        width = max(len(what) for what, _, _ in detail.parts)
        for what, where, nbytes in detail.parts:
            lines.append(f"  {what.ljust(width)}  {where:6}  {_gib(nbytes):>8} GiB")
    return "\n".join(lines)
