"""The engine's config dataclasses: one frozen, keyword-only class per config section.

Each class validates itself in ``__post_init__`` (types and ranges), raising
``ConfigError`` that names the class, the field and the value, so building one by
hand is as safe as reading it from JSON. The error carries ``field`` (the field's
name) so that ``offload.config.read_config`` can put the JSON key's dotted path in
front. Nothing here reads files or touches the file system: the one reader, with its
``nvme_path`` checks, is ``offload.config``.

Sizes in ``ZeroConfig``, ``OffloadParamConfig`` and ``AioConfig`` keep DeepSpeed's key
names (the JSON is DeepSpeed's); the docstring of each says its unit.
"""
from __future__ import annotations

import enum
import types
from dataclasses import dataclass, field
from typing import Any, Mapping

from csrc.errors import ConfigError
from offload.config.checks import check_bool as _bool, check_float as _float, check_int as _int, check_text as _text
from offload.config.checks import fail as _fail
from offload.config.combos import check_combinations

__all__ = [
    "OffloadDevice",
    "BatchConfig",
    "OptimizerConfig",
    "SchedulerConfig",
    "Fp16Config",
    "Bf16Config",
    "DataTypesConfig",
    "OffloadOptimizerConfig",
    "OffloadParamConfig",
    "ZeroConfig",
    "AioConfig",
    "CheckpointConfig",
    "OffloadSectionConfig",
    "EngineConfig",
    "SCHEDULER_TYPES",
]


class OffloadDevice(enum.Enum):
    """Where the optimizer states (or, for offload_param, the params) live."""

    NONE = "none"  # with the params, on the model's device: torch tensors, torch's AdamW
    CPU = "cpu"    # host memory of the tier (the embedded TierStore's pool, or the daemon's)
    NVME = "nvme"  # NVMe swap files of the tier, staged through host memory


SCHEDULER_TYPES = ("WarmupLR", "WarmupDecayLR", "WarmupCosineLR")


def _device(obj: object) -> None:
    value = obj.device  # type: ignore[attr-defined]
    if isinstance(value, str):  # accept the JSON spelling when built by hand
        try:
            value = OffloadDevice(value.lower())
        except ValueError:
            pass
    if not isinstance(value, OffloadDevice):
        _fail(obj, "device", "one of " + ", ".join(repr(d.value) for d in OffloadDevice))
    object.__setattr__(obj, "device", value)
    _text(obj, "nvme_path")  # required for 'nvme' without a daemon: checked where the daemon is known (offload.config.read)


# ---- the sections ------------------------------------------------------------------------

@dataclass(frozen=True, kw_only=True)
class BatchConfig:
    """The batch-size triangle: train = micro * gradient_accumulation_steps * world_size."""

    train_batch_size: int
    """Samples per optimizer step over all data-parallel ranks."""
    micro_batch_size_per_gpu: int
    """Samples per forward/backward on one rank (DeepSpeed's train_micro_batch_size_per_gpu)."""
    gradient_accumulation_steps: int
    """Micro-batches whose gradients are summed before each optimizer step."""

    def __post_init__(self) -> None:
        _int(self, "train_batch_size", 1)
        _int(self, "micro_batch_size_per_gpu", 1)
        _int(self, "gradient_accumulation_steps", 1)
        if self.train_batch_size % (self.micro_batch_size_per_gpu * self.gradient_accumulation_steps):
            _fail(self, "train_batch_size", "a multiple of micro_batch_size_per_gpu * gradient_accumulation_steps "
                  f"({self.micro_batch_size_per_gpu} * {self.gradient_accumulation_steps})")


@dataclass(frozen=True, kw_only=True)
class OptimizerConfig:
    """The "optimizer" section: Adam or AdamW, run by torch (offload none) or cpu_adam."""

    type: str
    """DeepSpeed's type, lower-cased: "adam" or "adamw"."""
    lr: float = 1e-3
    """Learning rate (before any scheduler)."""
    betas: tuple[float, float] = (0.9, 0.999)
    """Decay rates of the first and second moments, each in [0, 1)."""
    eps: float = 1e-8
    """Added to the denominator's square root."""
    weight_decay: float = 0.0
    """Decoupled (adamw_mode) or L2 (added to the gradient) weight decay."""
    adamw_mode: bool = True
    """True: decoupled weight decay (AdamW). Type AdamW is always True; Adam follows
    params.adam_w_mode, which defaults to True as in DeepSpeed."""
    bias_correction: bool = True
    """Divide the moments by (1 - beta^step)."""

    def __post_init__(self) -> None:
        if self.type not in ("adam", "adamw"):
            _fail(self, "type", "'adam' or 'adamw'")
        _float(self, "lr", 0.0)
        betas = self.betas
        if (not isinstance(betas, (tuple, list)) or len(betas) != 2
                or not all(isinstance(b, (int, float)) and not isinstance(b, bool) and 0.0 <= b < 1.0
                           for b in betas)):
            _fail(self, "betas", "two numbers in [0, 1)")
        object.__setattr__(self, "betas", (float(betas[0]), float(betas[1])))
        _float(self, "eps", 0.0)
        _float(self, "weight_decay", 0.0)
        _bool(self, "adamw_mode", "bias_correction")
        if self.type == "adamw" and not self.adamw_mode:
            _fail(self, "adamw_mode", "true for type 'adamw'")


@dataclass(frozen=True, kw_only=True)
class SchedulerConfig:
    """The "scheduler" section: DeepSpeed's warmup schedules, built on torch's LR schedulers."""

    type: str
    """One of SCHEDULER_TYPES (WarmupLR, WarmupDecayLR, WarmupCosineLR), as DeepSpeed spells it."""
    warmup_min_lr: float = 0.0
    """LR at step 0 (WarmupLR, WarmupDecayLR)."""
    warmup_max_lr: float = 0.001
    """LR reached after warmup (WarmupLR, WarmupDecayLR)."""
    warmup_num_steps: int = 1000
    """Optimizer steps of warmup."""
    warmup_type: str = "log"
    """Warmup curve: "log" or "linear"."""
    total_num_steps: int | None = None
    """Optimizer steps of the whole run; required by WarmupDecayLR and WarmupCosineLR."""
    warmup_min_ratio: float = 0.0
    """WarmupCosineLR: LR at step 0 as a fraction of the optimizer's LR."""
    cos_min_ratio: float = 0.0001
    """WarmupCosineLR: LR at the end as a fraction of the optimizer's LR."""
    last_batch_iteration: int = -1
    """Index of the last step already taken (-1: start from the beginning)."""

    def __post_init__(self) -> None:
        if self.type not in SCHEDULER_TYPES:
            _fail(self, "type", "one of " + ", ".join(SCHEDULER_TYPES))
        _float(self, "warmup_min_lr", 0.0)
        _float(self, "warmup_max_lr", 0.0)
        _int(self, "warmup_num_steps", 1)
        if self.warmup_type not in ("log", "linear"):
            _fail(self, "warmup_type", "'log' or 'linear'")
        _int(self, "total_num_steps", 1, optional=True)
        if self.type != "WarmupLR" and self.total_num_steps is None:
            _fail(self, "total_num_steps", f"set for {self.type}")
        _float(self, "warmup_min_ratio", 0.0, 1.0)
        _float(self, "cos_min_ratio", 0.0, 1.0)
        _int(self, "last_batch_iteration", -1)


@dataclass(frozen=True, kw_only=True)
class Fp16Config:
    """The "fp16" section: fp16 compute with a static or dynamic loss scale."""

    enabled: bool = False
    """Compute in fp16 (params and grads on the device in fp16, fp32 master weights)."""
    loss_scale: float = 0.0
    """Static loss scale; 0 means dynamic loss scaling."""
    initial_scale_power: int = 16
    """Dynamic scaling starts at 2**initial_scale_power."""
    loss_scale_window: int = 1000
    """Steps without overflow before the dynamic scale is doubled."""
    hysteresis: int = 2
    """Overflows tolerated before the dynamic scale is halved."""
    consecutive_hysteresis: bool = False
    """Refill the hysteresis budget on every step without overflow."""
    min_loss_scale: float = 1.0
    """The dynamic scale is never lowered below this."""

    def __post_init__(self) -> None:
        _bool(self, "enabled", "consecutive_hysteresis")
        _float(self, "loss_scale", 0.0)
        _int(self, "initial_scale_power", 0, 64)
        _int(self, "loss_scale_window", 1)
        _int(self, "hysteresis", 1)
        _float(self, "min_loss_scale", 0.0)


@dataclass(frozen=True, kw_only=True)
class Bf16Config:
    """The "bf16" section (DeepSpeed's older name "bfloat16" too)."""

    enabled: bool = False
    """Compute in bf16 (params and grads on the device in bf16, fp32 master weights)."""

    def __post_init__(self) -> None:
        _bool(self, "enabled")


@dataclass(frozen=True, kw_only=True)
class _OffloadTarget:
    """What offload_optimizer and offload_param share: the device and its host buffers."""

    device: OffloadDevice = OffloadDevice.NONE
    """none, cpu (the tier's host memory) or nvme (the tier's swap files)."""
    nvme_path: str | None = None
    """Directory for the swap files; required for device nvme (read_config checks it is writable)."""
    pin_memory: bool = True
    """Page-lock the host buffers so device copies are asynchronous."""
    buffer_count: int = 4
    """Host buffers for what is read from or written to NVMe."""

    def __post_init__(self) -> None:
        _device(self)
        _bool(self, "pin_memory")
        _int(self, "buffer_count", 1)


@dataclass(frozen=True, kw_only=True)
class OffloadOptimizerConfig(_OffloadTarget):
    """zero_optimization.offload_optimizer: where the fp32 master weights and Adam moments live."""

    buffer_count: int = 4
    """NVMe: the fewest sub-group state blocks held in host memory at once; more where the host
    memory budget holds them (offload.plan.budget.window_size)."""
    pipeline_read: bool = False
    """NVMe: read sub-group i+1 while stepping i."""
    pipeline_write: bool = False
    """NVMe: write sub-group i-1 back while stepping i."""
    fast_init: bool = False
    """NVMe: initialise the swapped states without a host round trip per sub-group."""
    ratio: float | str = 1.0
    """The share of the optimizer state offloaded, in [0, 1] (DeepSpeed's Twin-Flow): the rest, the
    sub-groups the next forward needs first, stays on the model's device and is stepped there by torch's
    fused AdamW. "auto": sized from the GPU memory left ([Note: GPU-resident share] in
    offload.zero.device_share). 1.0, the default: all of it offloaded. Stages 0-3."""

    def __post_init__(self) -> None:
        super().__post_init__()
        _bool(self, "pipeline_read", "pipeline_write", "fast_init")
        if self.ratio != "auto":
            if isinstance(self.ratio, bool) or not isinstance(self.ratio, (int, float)) or not 0.0 <= self.ratio <= 1.0:
                _fail(self, "ratio", 'a number in [0, 1] or "auto"')
            object.__setattr__(self, "ratio", float(self.ratio))


@dataclass(frozen=True, kw_only=True)
class OffloadParamConfig(_OffloadTarget):
    """zero_optimization.offload_param: stage 3 only (the engine refuses it for stages 0-2)."""

    buffer_count: int = 5
    """Host buffers for params read from NVMe."""
    buffer_size: int = 100_000_000
    """Elements per host buffer."""
    max_in_cpu: int = 1_000_000_000
    """Param elements kept in host memory before spilling to NVMe."""

    def __post_init__(self) -> None:
        super().__post_init__()
        _int(self, "buffer_size", 1)
        _int(self, "max_in_cpu", 0)


@dataclass(frozen=True, kw_only=True)
class ZeroConfig:
    """The "zero_optimization" section (a dict; the legacy true/false means stage 1/0)."""

    stage: int = 0
    """0: data parallel; 1: optimizer states partitioned; 2: gradients too; 3: params too."""
    offload_optimizer: OffloadOptimizerConfig = field(default_factory=OffloadOptimizerConfig)
    """Where the optimizer states live."""
    offload_param: OffloadParamConfig = field(default_factory=OffloadParamConfig)
    """Where the params live (stage 3)."""
    sub_group_size: int = 1_000_000_000
    """Elements per offloaded optimizer sub-group (the unit of the pipelined CPU step)."""
    overlap_comm: bool = False
    """Overlap gradient reduction with backward."""
    contiguous_gradients: bool = True
    """Copy gradients into one contiguous buffer as they are produced."""
    reduce_scatter: bool = True
    """Average gradients with reduce-scatter (else all-reduce)."""
    reduce_bucket_size: int = 500_000_000
    """Elements reduced per bucket."""
    allgather_partitions: bool = True
    """Gather updated params with all-gather (else a broadcast per rank)."""
    allgather_bucket_size: int = 500_000_000
    """Elements all-gathered per bucket."""
    round_robin_gradients: bool = False
    """Stage 1-2 with offload: spread gradient copies to host across ranks."""
    stage3_prefetch_bucket_size: int = 50_000_000
    """Stage 3: param elements fetched ahead of use."""
    stage3_param_persistence_threshold: int = 100_000
    """Stage 3: params with fewer elements stay unpartitioned."""
    stage3_max_live_parameters: int = 1_000_000_000
    """Stage 3: param elements resident per rank before releasing."""
    stage3_max_reuse_distance: int = 1_000_000_000
    """Stage 3: keep a param if it is used again within this many elements."""
    stage3_gather_16bit_weights_on_model_save: bool = False
    """Stage 3: gather the 16-bit weights when the model is saved."""

    def __post_init__(self) -> None:
        _int(self, "stage", 0, 3)
        if not isinstance(self.offload_optimizer, OffloadOptimizerConfig):
            _fail(self, "offload_optimizer", "an OffloadOptimizerConfig")
        if not isinstance(self.offload_param, OffloadParamConfig):
            _fail(self, "offload_param", "an OffloadParamConfig")
        _int(self, "sub_group_size", 1)
        _int(self, "reduce_bucket_size", 1)
        _int(self, "allgather_bucket_size", 1)
        for name in ("stage3_prefetch_bucket_size", "stage3_param_persistence_threshold",
                     "stage3_max_live_parameters", "stage3_max_reuse_distance"):
            _int(self, name, 0)
        _bool(self, "overlap_comm", "contiguous_gradients", "reduce_scatter", "allgather_partitions",
              "round_robin_gradients", "stage3_gather_16bit_weights_on_model_save")


@dataclass(frozen=True, kw_only=True)
class AioConfig:
    """The "aio" section: how the NVMe tier submits its direct I/O."""

    block_size: int = 1_048_576
    """Bytes per I/O request; a positive multiple of 4096."""
    queue_depth: int = 8
    """Requests in flight per I/O thread, 1..1024."""
    intra_op_parallelism: int = 1
    """I/O threads one transfer is split over, 1..64 (DeepSpeed's older name: thread_count)."""
    single_submit: bool = False
    """Submit requests one at a time instead of in batches."""
    overlap_events: bool = True
    """Reap completions and submit new requests in an overlapped loop."""
    use_gds: bool = False
    """GPUDirect Storage; accepted for DeepSpeed configs, not used by this engine."""

    def __post_init__(self) -> None:
        _int(self, "block_size", 4096)
        if self.block_size % 4096:
            _fail(self, "block_size", "a positive multiple of 4096")
        _int(self, "queue_depth", 1, 1024)
        _int(self, "intra_op_parallelism", 1, 64)
        _bool(self, "single_submit", "overlap_events", "use_gds")


@dataclass(frozen=True, kw_only=True)
class CheckpointConfig:
    """The "checkpoint" section: DeepSpeed's keys are accepted, ``keep_last`` is this project's."""

    keep_last: int = 0
    """Tags a save keeps in its directory, the one just saved included (older ones are removed,
    oldest first); 0 keeps every tag."""

    def __post_init__(self) -> None:
        _int(self, "keep_last", 0)


@dataclass(frozen=True, kw_only=True)
class DataTypesConfig:
    """The "data_types" section: the dtype the offloaded gradient accumulators sum in."""

    grad_accum_dtype: str = "fp32"
    """"fp32", or "bf16" (each landed sum rounded to bf16: half the accumulators' host memory and NVMe
    bytes); needs offload_optimizer device cpu or nvme and no offload.delayed_update."""

    def __post_init__(self) -> None:
        if self.grad_accum_dtype not in ("fp32", "bf16"):
            _fail(self, "grad_accum_dtype", '"fp32" or "bf16" (fp16 accumulators are not supported)')


@dataclass(frozen=True, kw_only=True)
class OffloadSectionConfig:
    """The "offload" section: this project's own keys, all optional."""

    daemon_socket: str | None = None
    """Unix socket of the node daemon; None: $OFFLOAD_DAEMON_SOCKET, else the embedded store."""
    daemon_reconnect_seconds: float = 300.0
    """With a daemon: how long a lost connection to it is retried (the daemon restarting, for an upgrade or
    after a crash) before the step fails with DaemonNotRunningError; 0: not at all ([Note: reconnect after
    a daemon restart] in daemon.client)."""
    job_id: str | None = None
    """Job id the daemon keys sessions by; None: torchrun's $TORCHELASTIC_RUN_ID, else "default"."""
    resume: str = "auto"
    """With a daemon: "auto" resumes from the session a killed or preempted run of this job left there
    (a script that ended normally or by close() left none), "never" drops such a session and starts fresh.
    $OFFLOAD_RESUME, when set, overrides it."""
    host_memory_bytes: int | None = None
    """Host memory budget of the tier; None: sized from the model (with nvme, from a share of the
    memory available)."""
    swap_capacity_bytes: int | None = None
    """NVMe swap file size; None: sized from the model."""
    checksum: bool = True
    """CRC-32C on NVMe write-back and prefetch."""
    delayed_update: bool = False
    """The one-step delayed parameter update (offload.zero.delayed): the CPU step overlaps the next step."""
    delayed_update_warmup_steps: int = 40
    """Ordinary optimizer steps before the delayed update begins (a few dozen, as ZeRO-Offload does)."""
    overlap_step: bool | str = "auto"
    """Step sub-groups whose gradients have all landed while backward still runs
    (offload.zero.overlap): "auto" (on where the model computes on a GPU), true or false."""
    step_under_forward: bool = False
    """With the overlapped step: the sub-groups left after backward are stepped under the next forward, the
    first layers' first, each of its modules waiting only for its own params (offload.zero.step_tail); until
    that forward (or engine.settle()) the params are not all the step's yet. Stages 0-2."""
    state_dtype: str = "fp32"
    """How the offloaded Adam moments are stored (the master is kept, see master_dtype): "fp32" (the bit-exact
    default), "bf16", or "int8" (blockwise dynamic 8-bit codes with a float32 scale per 256 elements;
    see cpu_adam.quant). Needs offload_optimizer device cpu or nvme."""
    master_dtype: str = "fp32"
    """The offloaded master params: "fp32" (the default) or "bf16" (2 bytes a parameter, updated in fp32
    and stored back by stochastic rounding: [Note: a bf16 master] in csrc/ofl_adam.h). bf16 needs
    state_dtype bf16 or int8."""
    gradient_tier: str = "auto"
    """Where stage 3's fp32 gradient accumulators live between landing and the step: "host" (resident
    in the tier's host memory, 4 bytes per parameter of the partition), "nvme" (on NVMe, a window of
    them in host memory: offload.zero.grad_tier), or "auto" (nvme where the accumulators would take
    more than the state window's budget of host memory). nvme needs stage 3 with offload_optimizer nvme,
    and no delayed_update or overlap_step."""
    node_shared_buffers: bool = True
    """Stages 1-2 on the CPU with every rank on one node: the ranks share one param buffer and read
    each other's gradient buffers in shared memory (/dev/shm) instead of reduce-scattering and
    all-gathering through the process group ([Note: node-shared buffers], offload.zero.node_buffers);
    the same sums for two ranks. Where a rank cannot map it, the process group as before."""
    release_host_heap: bool = True
    """Hand the host heap's free pages back to the kernel at a step when resident memory has crept 64 MiB
    past where it settled, so it stays near what is live ([Note: host heap creep], offload.runtime.host_heap)."""
    huge_pages: str = "auto"
    """The embedded store's pool: "auto" (private, on huge pages where the kernel gives them, else shared
    4 KiB pages) or "off" (shared 4 KiB pages); [Note: private pools] in swap.buffers."""

    def __post_init__(self) -> None:
        _text(self, "daemon_socket")
        _text(self, "job_id")
        _float(self, "daemon_reconnect_seconds", 0, 1e6, hi_open=True)
        _int(self, "host_memory_bytes", 1, optional=True)
        _int(self, "swap_capacity_bytes", 1, optional=True)
        _bool(self, "checksum", "delayed_update", "release_host_heap", "node_shared_buffers", "step_under_forward")
        _int(self, "delayed_update_warmup_steps", 0)
        if self.overlap_step not in (True, False, "auto"):
            _fail(self, "overlap_step", 'true, false or "auto"')
        if self.state_dtype not in ("fp32", "bf16", "int8"):
            _fail(self, "state_dtype", '"fp32", "bf16" or "int8"')
        if self.master_dtype not in ("fp32", "bf16"):
            _fail(self, "master_dtype", '"fp32" or "bf16"')
        if self.gradient_tier not in ("auto", "host", "nvme"):
            _fail(self, "gradient_tier", '"auto", "host" or "nvme"')
        if self.huge_pages not in ("auto", "off"):
            _fail(self, "huge_pages", '"auto" or "off"')
        if self.resume not in ("auto", "never"):
            _fail(self, "resume", '"auto" or "never"')


@dataclass(frozen=True, kw_only=True)
class EngineConfig:
    """Everything read_config returns; each component receives only its own section."""

    batch: BatchConfig
    """Batch sizes, resolved against the world size."""
    optimizer: OptimizerConfig | None = None
    """None: the config has no "optimizer" section (the script passes its own)."""
    scheduler: SchedulerConfig | None = None
    """None: no "scheduler" section."""
    fp16: Fp16Config = field(default_factory=Fp16Config)
    """fp16 and loss scaling."""
    bf16: Bf16Config = field(default_factory=Bf16Config)
    """bf16."""
    gradient_clipping: float = 0.0
    """Clip the global gradient norm to this; 0 turns clipping off."""
    steps_per_print: int = 10
    """Log progress every this many optimizer steps."""
    wall_clock_breakdown: bool = False
    """Time forward, backward and step separately and log the breakdown."""
    zero: ZeroConfig = field(default_factory=ZeroConfig)
    """ZeRO stage and offload."""
    aio: AioConfig = field(default_factory=AioConfig)
    """NVMe I/O settings."""
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    """Checkpoint retention."""
    offload: OffloadSectionConfig = field(default_factory=OffloadSectionConfig)
    """This project's own section (daemon, job id, memory budgets)."""
    data_types: DataTypesConfig = field(default_factory=DataTypesConfig)
    """The gradient accumulators' dtype."""
    raw: Mapping[str, Any] = field(default_factory=lambda: types.MappingProxyType({}))
    """The config as read, read-only all the way down, for checkpoints and logs."""

    def __post_init__(self) -> None:
        if not isinstance(self.batch, BatchConfig):
            _fail(self, "batch", "a BatchConfig")
        _float(self, "gradient_clipping", 0.0)
        _int(self, "steps_per_print", 1)
        _bool(self, "wall_clock_breakdown")
        if self.fp16.enabled and self.bf16.enabled:
            _fail(self, "bf16", "disabled when fp16 is enabled (fp16 and bf16 are both enabled)")
        check_combinations(self)
