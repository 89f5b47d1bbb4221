"""``offload estimate``: device, host and NVMe bytes per ZeRO stage and offload choice, before a run.

[Note: estimate] Two figures per row. The ZeRO paper's model states per device (mixed
precision with Adam: ``c`` bytes per compute-dtype element, K = 12 bytes of fp32 master and
moments; Psi parameters, N ranks):

    stage 0: (2c + 12) Psi      stage 1: 2c Psi + 12 Psi / N
    stage 2: c Psi + (c + 12) Psi / N      stage 3: (2c + 12) Psi / N

and what this engine holds, where, from its own buffers (``offload.builder``):
- stages 0-2: the flat params and the flat gradients (``c`` each, whole model), the fp32
  gradient accumulators of the rank's partition (4 bytes) and its state blocks (12 bytes):
  on the device (offload none), in the tier's host pool (cpu), or on NVMe with
  ``offload_optimizer.buffer_count`` sub-groups of state in the pool (nvme); sub-groups are
  capped at ``OFFLOAD_SUB_GROUP_CAP`` elements when offloaded;
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

import argparse
import dataclasses
import logging
import math
from typing import Any, Iterable

import torch

from csrc import ConfigError
from offload import estimate_fit as fit
from offload.zero.overlap import copies_that_fit, overlap_wanted
from offload.zero.window import window_size

logger = logging.getLogger(__name__)

__all__ = ["EstimateInput", "EstimateRow", "Estimate", "ModelShapes", "estimate", "gpt_shapes", "shapes_from_count",
           "shapes_from_model", "process_baseline_bytes", "format_table", "zero_formula_bytes"]

PAGE = 4096
ALIGN = 64  # offload.zero.layout.ALIGN_ELEMENTS
SUB_GROUP_CAP = 1 << 22  # offload.builder.OFFLOAD_SUB_GROUP_CAP
DEVICES = ("none", "cpu", "nvme")


def _up(n: int, to: int) -> int:
    return -(-n // to) * to


@dataclasses.dataclass(frozen=True, kw_only=True)
class ModelShapes:
    """What the estimate needs of a model."""

    params: int
    """Trainable parameter elements (a tied weight counted once)."""
    units: tuple[int, ...]
    """Elements of each stage-3 unit (the non-persistent params a module owns), in module order."""
    persistent: int
    """Elements of the persistent params (below stage3_param_persistence_threshold)."""
    largest_param: int
    """Elements of the largest single parameter."""
    activation_elements: int = 0
    """Elements autograd saves for backward per micro-batch (0: not known)."""


def shapes_from_model(model: torch.nn.Module, *, persistence_threshold: int,
                      activation_elements: int = 0) -> ModelShapes:
    """The shapes of a model (a meta one costs no memory), cut into units as stage 3 cuts them."""
    from offload.zero.units import plan_units

    params = [p for p in model.parameters() if p.requires_grad]
    plan = plan_units(model, [params], persistence_threshold=persistence_threshold)
    numel = [p.numel() for p in params]
    units = tuple(sum(numel[i] for i in b) for u, b in enumerate(plan.buckets) if u not in plan.persistent)
    persistent = sum(numel[i] for u in plan.persistent for i in plan.buckets[u])
    return ModelShapes(params=sum(numel), units=units, persistent=persistent, largest_param=max(numel),
                       activation_elements=activation_elements)


def shapes_from_count(params: int, *, largest_layer: int | None = None) -> ModelShapes:
    """A model known by its size only: units of ``largest_layer`` elements (default: 1/96 of the model, a
    GPT's MLP matrix at 32 layers), no persistent params, activations unknown."""
    if params < 1:
        raise ConfigError(f"the parameter count must be >= 1, got {params}")
    largest = max(1, min(params, largest_layer or params // 96 or params))
    full, rest = divmod(params, largest)
    units = (largest,) * full + ((rest,) if rest else ())
    return ModelShapes(params=params, units=units, persistent=0, largest_param=largest)


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
    optimizer_buffer_count: int = 4
    """offload_optimizer.buffer_count (state blocks in host memory with nvme: the window's floor)."""
    host_memory_bytes: int | None = None
    """offload.host_memory_bytes: the budget the engine sizes the optimizer state's NVMe window from;
    None: as the engine does, from the memory available on this machine now (``offload.zero.window.window_size``)."""
    daemon: bool = False
    """Through a node daemon without ``host_memory_bytes``: the engine sizes the window from the daemon's
    pool when it starts (``offload.daemon_window``); the estimate, made without the daemon, takes its floor,
    buffer_count blocks."""
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

    @classmethod
    def from_config(cls, config: Any, shapes: ModelShapes, *, world_size: int = 1,
                    baseline_bytes: int = 0, gpu: bool = False) -> "EstimateInput":
        """From an engine config (a dict or a JSON path, as ``initialize`` takes it)."""
        from offload.config import read_config, resolve_daemon_socket

        cfg = read_config(config, world_size=world_size)
        z = cfg.zero
        itemsize = 2 if (cfg.bf16.enabled or cfg.fp16.enabled) else 4
        return cls(shapes=shapes, world_size=world_size, compute_bytes=itemsize, sub_group_size=z.sub_group_size,
                   optimizer_buffer_count=z.offload_optimizer.buffer_count,
                   host_memory_bytes=cfg.offload.host_memory_bytes, daemon=bool(resolve_daemon_socket(cfg.offload)),
                   param_buffer_count=z.offload_param.buffer_count, max_live=z.stage3_max_live_parameters,
                   baseline_bytes=baseline_bytes, gpu=gpu, overlap_step=cfg.offload.overlap_step,
                   delayed_update=cfg.offload.delayed_update)


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
    zero_formula_bytes: int
    """The ZeRO paper's model states per device for the stage (no offload), for comparison."""
    parts: tuple[tuple[str, str, int], ...]
    """(what, where, bytes) behind the totals."""

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


def _sub_group_numels(partition: int, device: str, inp: EstimateInput) -> list[int]:
    """Elements per optimizer sub-group of a partition (capped when offloaded, as ``offload.builder`` cuts them)."""
    sub = min(inp.sub_group_size, SUB_GROUP_CAP) if device != "none" else inp.sub_group_size
    return [sub] * (partition // sub) + ([partition % sub] if partition % sub else [])


def _optimizer_parts(partition: int, device: str, inp: EstimateInput) -> list[tuple[str, str, int]]:
    """The fp32 gradient accumulators and state blocks of a partition (``offload.tiers.plan_bytes``)."""
    numels = _sub_group_numels(partition, device, inp)
    if device == "none":
        return [("fp32 gradient accumulators", "device", 4 * partition), ("fp32 master + moments", "device", 12 * partition)]
    grads = sum(_up(4 * n, PAGE) for n in numels)
    states = [_up(12 * n, PAGE) for n in numels]
    if device == "cpu":
        return [("fp32 gradient accumulators", "host", grads), ("fp32 master + moments", "host", sum(states))]
    floor = max(2, inp.optimizer_buffer_count)
    blocks = floor if inp.daemon and inp.host_memory_bytes is None else window_size(
        states, floor=floor, fixed_bytes=grads, host_memory_bytes=inp.host_memory_bytes, what="estimate", log=False)
    window = sum(sorted(states, reverse=True)[:blocks])
    return [("fp32 gradient accumulators", "host", grads), ("state window (host budget, buffer_count at least)", "host", window),
            ("fp32 master + moments", "nvme", sum(states))]


def _stage012(stage: int, optimizer: str, inp: EstimateInput) -> list[tuple[str, str, int]]:
    s, c, n = inp.shapes, inp.compute_bytes, inp.world_size
    shard = stage >= 1 and n > 1
    total = _up(s.params, ALIGN * (n if shard else 1))
    partition = total // n if shard else total
    parts = [("flat params", "device", c * total), ("flat gradients", "device", c * total)]
    return parts + _optimizer_parts(partition, optimizer, inp) + _staged_update_parts(stage, partition, optimizer, inp)


def _staged_update_parts(stage: int, partition: int, optimizer: str, inp: EstimateInput) -> list[tuple[str, str, int]]:
    """The staging buffer and the overlapped step's rollback copies (``offload.zero.optimizer``, ``.overlap``)."""
    if optimizer == "none":
        return []
    overlap = overlap_wanted(inp.overlap_step, device_type="cuda" if inp.gpu else "cpu", stage=stage,
                             offloaded=True, delayed=inp.delayed_update)
    parts = []
    if inp.gpu or inp.delayed_update or overlap:
        parts.append(("param staging (compute dtype)", "host", inp.compute_bytes * partition))
    if overlap and optimizer == "cpu":
        numels = _sub_group_numels(partition, optimizer, inp)
        copies = min(len(numels), copies_that_fit(numels))
        parts.append(("rollback copies (offload.overlap_step)", "host", 12 * sum(sorted(numels, reverse=True)[:copies])))
    return parts


def _stage3(optimizer: str, param: str, inp: EstimateInput) -> list[tuple[str, str, int]]:
    s, c, n = inp.shapes, inp.compute_bytes, inp.world_size
    units = [_up(u, ALIGN * n) for u in s.units]
    persistent = _up(s.persistent, ALIGN * n) if s.persistent else 0
    partition = (sum(units) + persistent) // n
    largest = max(units, default=0)
    shard_sizes = [_up(c * u // n, PAGE) for u in units] + ([_up(c * persistent // n, PAGE)] if persistent else [])
    live = min(sum(units), max(inp.max_live, largest))
    parts = [("gathered units (persistent + live)", "device", c * (persistent + live)),
             ("unit gradient buffers", "device", c * (largest + persistent + s.largest_param))]
    if param == "none":
        parts.append(("param shards", "device", c * partition))
    elif param == "cpu":
        parts.append(("param shards", "host", sum(shard_sizes)))
    else:
        parts += [("param shards in flight (buffer_count segments)", "host",
                   max(3, inp.param_buffer_count) * max(shard_sizes, default=0)),
                  ("param shards", "nvme", sum(shard_sizes))]
    return parts + _optimizer_parts(partition, optimizer, inp)


def estimate(inp: EstimateInput, *, stages: Iterable[int] = (0, 1, 2, 3)) -> Estimate:
    """Every stage and offload choice the engine accepts (offload_param only with stage 3)."""
    rows = []
    act = inp.compute_bytes * inp.shapes.activation_elements
    for stage in stages:
        pairs = [(o, p) for o in DEVICES for p in DEVICES] if stage == 3 else [(o, "none") for o in DEVICES]
        for optimizer, param in pairs:
            parts = _stage3(optimizer, param, inp) if stage == 3 else _stage012(stage, optimizer, inp)
            if act:
                parts.append(("activations", "device", act))
            # backward's matmuls hold a transposed or packed copy of the weight and its fresh gradient at once
            parts.append(("compute scratch (2 x largest param)", "device", 2 * inp.compute_bytes * inp.shapes.largest_param))
            if inp.baseline_bytes:
                parts.append(("process (Python, torch)", "host", inp.baseline_bytes))
            total = {w: sum(b for _, where, b in parts if where == w) for w in ("device", "host", "nvme")}
            rows.append(EstimateRow(stage=stage, optimizer=optimizer, param=param, device_bytes=total["device"],
                                    host_bytes=total["host"], nvme_bytes=total["nvme"],
                                    zero_formula_bytes=zero_formula_bytes(stage, inp.shapes.params, inp.world_size,
                                                                          inp.compute_bytes),
                                    parts=tuple(parts)))
    return Estimate(tuple(rows))


def _gib(n: int) -> str:
    return f"{n / (1 << 30):.2f}"


def format_table(est: Estimate, *, title: str = "", detail: EstimateRow | None = None, gpu_column: bool = True,
                 verdicts: dict[int, str] | None = None, marked: EstimateRow | None = None) -> str:
    """A plain-text table of the rows (GiB), and the parts behind one row if ``detail``. Without
    ``gpu_column`` the device is the CPU: one "host GiB" column of device + host bytes. ``verdicts``:
    a "fits" column (row index -> text); ``marked``: the configured row, flagged."""
    if gpu_column:
        head = ["stage", "offload_optimizer", "offload_param", "device GiB", "host GiB", "NVMe GiB", "device+host GiB",
                "ZeRO formula GiB"]
        body = [[str(r.stage), r.optimizer, r.param, _gib(r.device_bytes), _gib(r.host_bytes), _gib(r.nvme_bytes),
                 _gib(r.process_bytes), _gib(r.zero_formula_bytes)] for r in est.rows]
    else:
        head = ["stage", "offload_optimizer", "offload_param", "host GiB", "NVMe GiB", "ZeRO formula GiB"]
        body = [[str(r.stage), r.optimizer, r.param, _gib(r.process_bytes), _gib(r.nvme_bytes),
                 _gib(r.zero_formula_bytes)] for r in est.rows]
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


def parse_count(text: str) -> int:
    """``2e9``, ``2B``, ``350M``, ``125000`` -> elements."""
    t = text.strip().lower().replace("_", "")
    scale = {"k": 10 ** 3, "m": 10 ** 6, "b": 10 ** 9, "g": 10 ** 9, "t": 10 ** 12}.get(t[-1:], 1)
    if scale != 1:
        t = t[:-1]
    try:
        value = float(t) * scale
    except ValueError:
        raise ConfigError(f"not a count of parameters: {text!r} (e.g. 2e9, 1.3B, 350M)") from None
    if not math.isfinite(value) or value < 1:
        raise ConfigError(f"not a count of parameters: {text!r}")
    return int(value)


def _gpt_spec(text: str, *, seq: int, batch: int, persistence_threshold: int) -> ModelShapes:
    fields = {}
    for item in filter(None, (s.strip() for s in text.split(","))):
        key, sep, value = item.partition("=")
        if not sep or key not in ("n_layer", "n_embd", "n_head", "vocab_size", "tied_head", "bias"):
            raise ConfigError(f"--gpt takes n_layer=,n_embd=,vocab_size= (and n_head=, tied_head=, bias=), "
                              f"got {item!r}")
        fields[key] = value.lower() in ("1", "true", "yes") if key in ("tied_head", "bias") else int(value)
    missing = {"n_layer", "n_embd", "vocab_size"} - set(fields)
    if missing:
        raise ConfigError(f"--gpt is missing {', '.join(sorted(missing))}")
    return gpt_shapes(seq=seq, batch=batch, persistence_threshold=persistence_threshold, **fields)


def _model_spec(text: str, *, persistence_threshold: int) -> ModelShapes:
    import importlib

    module_name, sep, attr = text.partition(":")
    if not sep:
        raise ConfigError(f"--model takes module:callable (a function returning an nn.Module), got {text!r}")
    factory = getattr(importlib.import_module(module_name), attr)
    with torch.device("meta"):
        model = factory()
    return shapes_from_model(model, persistence_threshold=persistence_threshold)


def _hf_config_spec(path: str, *, persistence_threshold: int) -> ModelShapes:
    """A Hugging Face ``config.json`` (or its directory): the causal LM it describes, built on the meta device."""
    import os

    try:
        from transformers import AutoConfig, AutoModelForCausalLM
    except ImportError:
        raise ConfigError("--hf-config needs transformers: pip install .[hf]") from None
    where = path if os.path.isdir(path) else os.path.dirname(os.path.abspath(path))
    if not os.path.isfile(os.path.join(where, "config.json")) or \
            (not os.path.isdir(path) and os.path.basename(path) != "config.json"):
        raise ConfigError(f"--hf-config takes a config.json or the directory holding one, got {path!r}")
    config = AutoConfig.from_pretrained(where, local_files_only=True)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    return shapes_from_model(model, persistence_threshold=persistence_threshold)


def run_cli(args: Any) -> int:
    """``offload estimate`` (the arguments ``offload.cli`` parses)."""
    import json

    config: Any = args.config or {"train_batch_size": args.world_size, "zero_optimization": {"stage": 3}}
    from offload.config import read_config

    cfg = read_config(config, world_size=args.world_size) if args.config else None
    threshold = cfg.zero.stage3_param_persistence_threshold if cfg is not None else 100_000
    if sum(x is not None for x in (args.params, args.gpt, args.model, args.hf_config)) != 1:
        raise ConfigError("give one of --params, --gpt, --model or --hf-config")
    if args.params is not None:
        shapes = shapes_from_count(parse_count(args.params),
                                   largest_layer=parse_count(args.largest_layer) if args.largest_layer else None)
    elif args.gpt is not None:
        shapes = _gpt_spec(args.gpt, seq=args.seq, batch=args.batch, persistence_threshold=threshold)
    elif args.hf_config is not None:
        shapes = _hf_config_spec(args.hf_config, persistence_threshold=threshold)
    else:
        shapes = _model_spec(args.model, persistence_threshold=threshold)
    gpu = args.gpu if args.gpu is not None else (args.gpu_gib is not None or torch.cuda.is_available())
    inp = EstimateInput.from_config(config, shapes, world_size=args.world_size,
                                    baseline_bytes=0 if args.no_baseline else process_baseline_bytes(), gpu=gpu)
    if args.dtype:
        inp = dataclasses.replace(inp, compute_bytes=4 if args.dtype == "fp32" else 2)
    est = estimate(inp, stages=args.stage or (0, 1, 2, 3))
    detail = None
    if args.detail:
        stage, optimizer, param = (args.detail.split(",") + ["none", "none"])[:3]
        detail = est.row(stage=int(stage), optimizer=optimizer, param=param)
    if args.json:
        print(json.dumps([dataclasses.asdict(r) | {"process_bytes": r.process_bytes} for r in est.rows], indent=1))
        return 0
    machine = fit.machine_here(host_gib=args.host_gib, gpu_gib=args.gpu_gib, nvme_gib=args.nvme_gib,
                               nvme_path=fit.nvme_path(cfg), gpu=gpu, ranks=args.world_size)
    configured = None
    if cfg is not None and cfg.zero.stage in {r.stage for r in est.rows}:
        configured = est.row(stage=cfg.zero.stage, optimizer=cfg.zero.offload_optimizer.device.value,
                             param=cfg.zero.offload_param.device.value)
    title = (f"{shapes.params:,} parameters, {args.world_size} rank(s), {inp.compute_bytes}-byte compute dtype; "
             f"per rank\nagainst: {machine.describe()}")
    verdicts = {i: fit.verdict(r, machine).text() for i, r in enumerate(est.rows)}
    print(format_table(est, title=title, detail=detail, gpu_column=gpu, verdicts=verdicts, marked=configured))
    print("\n".join(fit.answer(est.rows, configured, machine, args.world_size)))
    return 0


def add_arguments(parser: Any) -> None:
    """The flags of ``offload estimate``."""
    parser.add_argument("--params", help="the model by its parameter count (2e9, 1.3B, 350M)")
    parser.add_argument("--largest-layer", help="with --params: elements of the largest layer (default params/96)")
    parser.add_argument("--gpt", help="offload.models.gpt.GPT: n_layer=30,n_embd=2560,vocab_size=50257[,n_head=20]")
    parser.add_argument("--model", help="module:callable returning the nn.Module (built on the meta device)")
    parser.add_argument("--hf-config", help="a Hugging Face config.json (or its directory): the causal LM it describes")
    parser.add_argument("--seq", type=int, default=1024, help="with --gpt: tokens per sequence (1024)")
    parser.add_argument("--batch", type=int, default=1, help="with --gpt: sequences per micro-batch (1)")
    parser.add_argument("--config", help="the engine's JSON config (buffer counts, sub_group_size, dtype, limits)")
    parser.add_argument("--world-size", type=int, default=1, help="ranks (1)")
    parser.add_argument("--dtype", choices=("fp32", "bf16", "fp16"), help="compute dtype (the config's, else fp32)")
    parser.add_argument("--stage", type=int, action="append", choices=(0, 1, 2, 3), help="only this stage (repeatable)")
    parser.add_argument("--detail", metavar="STAGE[,OPT[,PARAM]]", help="also list the parts of one row, e.g. 3,nvme,nvme")
    parser.add_argument("--no-baseline", action="store_true", help="leave out this process's own memory")
    parser.add_argument("--gpu", action=argparse.BooleanOptionalAction, default=None,
                        help="the model computes on a GPU (host staging of offloaded updates, offload.overlap_step "
                             "auto on); default: whether this machine has one")
    parser.add_argument("--json", action="store_true", help="the rows as JSON")
    parser.add_argument("--host-gib", type=float, help="check the rows against this much host memory "
                        "(default: what this machine has available now)")
    parser.add_argument("--gpu-gib", type=float, help="check against a GPU of this much memory (default: this "
                        "machine's GPU; none: the model computes on the CPU)")
    parser.add_argument("--nvme-gib", type=float, help="check against this much NVMe space (default: the free space "
                        "under the config's nvme_path, else the temporary directory)")
