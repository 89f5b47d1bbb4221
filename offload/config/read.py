"""The one reader of the DeepSpeed-style training config: JSON or dict -> frozen dataclasses.

``read_config(config, world_size=...)`` takes a dict or a JSON file path and returns an
``EngineConfig`` whose sections (``offload.config.sections``) each go to one component.
It reads nothing else and allocates nothing: the only side effect is the writability
probe of an ``nvme_path`` (a temporary file, created and removed at once), so every
error comes before the engine allocates a byte.

The rules:
- Every key is checked against DeepSpeed's own (``offload.config.keys``). A key DeepSpeed
  does not have is a ``ConfigError`` naming it with its section as a dotted path and
  suggesting the closest known key. A key DeepSpeed has but this engine does not act on
  is logged once per process (``logger.warning``) as ignored; its value is not read.
- Every invalid value is a ``ConfigError`` naming the dotted key and the value: wrong
  types too ("true" for a bool, 1.5 for an integer). Integral floats such as ``5e8``
  are accepted for integer keys, as DeepSpeed configs often write sizes that way.
- ``"auto"`` (what HF Trainer writes) is an error: the caller must resolve it (except for
  this project's keys that take "auto" as a value of their own: ``offload.overlap_step``).
- Legacy forms are read and logged as deprecated: ``"zero_optimization": true/false``
  (stage 1/0, with the top-level ``allgather_size``), ``cpu_offload``,
  ``cpu_offload_param``, ``cpu_offload_use_pin_memory``, ``aio.thread_count``,
  ``"bfloat16"``, ``stage3_gather_fp16_weights_on_model_save``.
"""
from __future__ import annotations

import difflib
import json
import logging
import os
import tempfile
import types
import typing
from typing import Any, Mapping

from csrc.errors import ConfigError
import offload.config.keys as keys
import offload.config.sections as config_sections
from offload.config.sections import (
    SCHEDULER_TYPES, AioConfig, BatchConfig, CheckpointConfig, Bf16Config, DataTypesConfig, EngineConfig, Fp16Config, OffloadDevice,
    OffloadOptimizerConfig, OffloadParamConfig, OffloadSectionConfig, OptimizerConfig, SchedulerConfig,
    ZeroConfig,
)

logger = logging.getLogger(__name__)

__all__ = [*config_sections.__all__, "read_config", "resolve_daemon_socket", "resolve_job_id", "resolve_resume"]

DAEMON_SOCKET_ENV = "OFFLOAD_DAEMON_SOCKET"
RUN_ID_ENV = "TORCHELASTIC_RUN_ID"
RESUME_ENV = "OFFLOAD_RESUME"
_BATCH_KEYS = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")

_logged: set[str] = set()  # "ignored:<dotted>" / "deprecated:<dotted>", each logged once per process


def read_config(config: Mapping[str, Any] | str | os.PathLike, *, world_size: int,
                client_optimizer: Mapping[str, Any] | None = None) -> EngineConfig:
    """Read a DeepSpeed-style config (a dict, or the path of a JSON file) for ``world_size`` ranks.
    ``client_optimizer``: the "optimizer" section of an optimizer passed to ``initialize``
    (``offload.config.client_optimizer``), read as if the config held it; the config must not name one too."""
    if not isinstance(world_size, int) or isinstance(world_size, bool) or world_size < 1:
        raise ConfigError(f"world_size must be an integer >= 1, got {world_size!r}")
    raw = _load(config)
    if client_optimizer is not None:
        if "optimizer" in raw:
            raise ConfigError("initialize() got an optimizer and the config names one in its \"optimizer\" section: "
                              "keep one of the two")
        raw = {**raw, "optimizer": dict(client_optimizer)}
    top = _Section("", raw, keys.TOP)
    fp16 = _build(Fp16Config, top.child("fp16", keys.FP16), "fp16")
    bf16 = _build(Bf16Config, _bf16_section(top), "bf16")
    optimizer = _optimizer(top)
    scheduler = _scheduler(top, optimizer)
    zero = _zero(top)
    aio = _build(AioConfig, top.child("aio", keys.AIO), "aio")
    offload = _build(OffloadSectionConfig, top.child("offload", keys.OFFLOAD), "offload")
    checkpoint = _build(CheckpointConfig, top.child("checkpoint", keys.CHECKPOINT), "checkpoint")
    data_types = _build(DataTypesConfig, top.child("data_types", keys.DATA_TYPES), "data_types")
    fields, origin = top.fields(EngineConfig)
    origin["bf16"] = "bf16.enabled"
    engine = _construct(EngineConfig, origin, "", batch=_batch(top, world_size), optimizer=optimizer,
                        scheduler=scheduler, fp16=fp16, bf16=bf16, zero=zero, aio=aio, offload=offload,
                        checkpoint=checkpoint, data_types=data_types, raw=_freeze(raw), **fields)
    daemon = resolve_daemon_socket(offload)
    for dotted, offload_config in (("zero_optimization.offload_optimizer", zero.offload_optimizer),
                                   ("zero_optimization.offload_param", zero.offload_param)):
        # the gradient accumulators on NVMe beside a cpu optimizer swap under its nvme_path ([Note: gradient tier])
        grads = offload.gradient_tier == "nvme" and offload_config is zero.offload_optimizer
        if (offload_config.device is not OffloadDevice.NVME and not grads) or daemon:  # a daemon swaps to its own paths
            continue
        if offload_config.nvme_path is None:
            when = "device is 'nvme'" if offload_config.device is OffloadDevice.NVME else \
                "offload.gradient_tier is 'nvme' (the accumulators' swap file goes there)"
            raise ConfigError(f"{dotted}.nvme_path=None: set it (a writable directory) when {when}, or "
                              "train through a node daemon (offload.daemon_socket or OFFLOAD_DAEMON_SOCKET), "
                              "which swaps to its own paths")
        _check_writable_dir(f"{dotted}.nvme_path", offload_config.nvme_path)
    return engine


def resolve_daemon_socket(section: OffloadSectionConfig, environ: Mapping[str, str] = os.environ) -> str | None:
    """The daemon socket to use: the config's, else $OFFLOAD_DAEMON_SOCKET; None: the embedded store."""
    return section.daemon_socket or environ.get(DAEMON_SOCKET_ENV) or None


def resolve_job_id(section: OffloadSectionConfig, environ: Mapping[str, str] = os.environ) -> str:
    """The job id: the config's, else torchrun's $TORCHELASTIC_RUN_ID, else "default"."""
    return section.job_id or environ.get(RUN_ID_ENV) or "default"


def resolve_resume(section: OffloadSectionConfig, environ: Mapping[str, str] = os.environ) -> str:
    """Whether a start resumes from a session the daemon kept: $OFFLOAD_RESUME, else offload.resume."""
    value = environ.get(RESUME_ENV, "").strip().lower()
    if value and value not in ("auto", "never"):
        raise ConfigError(f'${RESUME_ENV} is {environ[RESUME_ENV]!r}: expected "auto" or "never"')
    return value or section.resume


# ---- loading -----------------------------------------------------------------------------

def _load(config: Any) -> dict[str, Any]:
    if isinstance(config, Mapping):
        raw = dict(config)
        where = "config"
    elif isinstance(config, (str, os.PathLike)):
        where = os.fspath(config)
        raw = _load_json(where)
    else:
        raise ConfigError(f"config must be a dict or the path of a JSON file, got {type(config).__name__}")
    if not isinstance(raw, dict):
        raise ConfigError(f"{where}: the config must be a JSON object, got {type(raw).__name__}")
    return raw


def _load_json(path: str) -> Any:
    def no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
        seen: dict[str, Any] = {}
        for key, value in pairs:
            if key in seen:
                raise ConfigError(f"config file {path}: key {key!r} appears twice in one object")
            seen[key] = value
        return seen

    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except FileNotFoundError as exc:
        raise ConfigError(f"config file {path} not found") from exc
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"config file {path} cannot be read: {exc}") from exc
    try:
        return json.loads(text, object_pairs_hook=no_duplicates)
    except json.JSONDecodeError as exc:
        raise ConfigError(f"config file {path}: invalid JSON at line {exc.lineno}, column {exc.colno}: "
                          f"{exc.msg}") from exc


def _freeze(value: Any) -> Any:
    """A read-only deep copy: dicts become MappingProxyType, lists tuples."""
    if isinstance(value, Mapping):
        return types.MappingProxyType({k: _freeze(v) for k, v in value.items()})
    if isinstance(value, (list, tuple)):
        return tuple(_freeze(v) for v in value)
    return value


# ---- one section of the JSON ---------------------------------------------------------------

class _Section:
    """One JSON object of the config, checked against its key table when made."""

    def __init__(self, path: str, mapping: Any, table: keys.KeyTable, where: str | None = None) -> None:
        self.path = path
        self.table = table
        if not isinstance(mapping, Mapping):
            raise ConfigError(f"{path} must be an object ({{...}}), got {mapping!r}")
        for key in mapping:
            if not isinstance(key, str):
                raise ConfigError(f"{self.dotted(repr(key))}: config keys must be strings")
            if key not in table.known:
                raise ConfigError(_unknown_key_message(self, key, where))
            if key in table.ignored or key in table.unused:
                _log_once("ignored", self.dotted(key))
        self.mapping = mapping

    def dotted(self, key: str) -> str:
        return f"{self.path}.{key}" if self.path else key

    def has(self, key: str) -> bool:
        return key in self.mapping

    def get(self, key: str, default: Any = None) -> Any:
        if key not in self.mapping:
            return default
        value = self.mapping[key]
        if isinstance(value, str) and value.strip().lower() == "auto" and key not in self.table.auto:
            raise ConfigError(f'{self.dotted(key)} is "auto": resolve it to a value before calling '
                              f"(HF Trainer fills \"auto\" in; this engine does not guess)")
        return value

    def child(self, key: str, table: keys.KeyTable, where: str | None = None) -> _Section | None:
        """The subsection under ``key``; None when absent or null (DeepSpeed's Optional sections)."""
        value = self.get(key)
        return None if value is None else _Section(self.dotted(key), value, table, where)

    def fields(self, cls: type) -> tuple[dict[str, Any], dict[str, str]]:
        """The dataclass fields the acted-on keys fill, and field -> dotted key for error messages."""
        hints = typing.get_type_hints(cls)
        values: dict[str, Any] = {}
        origin: dict[str, str] = {}
        for key, name in self.table.acted.items():
            if key not in self.mapping:
                continue
            value = _coerce(hints[name], self.get(key))
            if name in values and values[name] != value:
                raise ConfigError(f"{origin[name]}={values[name]!r} and {self.dotted(key)}={value!r} "
                                  "name the same setting with different values; give one")
            values[name] = value
            origin[name] = self.dotted(key)
            if self.dotted(key) in keys.DEPRECATED:
                _log_once("deprecated", self.dotted(key))
        for key, name in self.table.acted.items():  # a field left at its default: its first key
            origin.setdefault(name, self.dotted(key))
        return values, origin


def _coerce(hint: Any, value: Any) -> Any:
    """JSON spellings the dataclasses do not take as they are: 5e8 for an int, a list for a tuple."""
    kinds = typing.get_args(hint) if typing.get_origin(hint) in (typing.Union, types.UnionType) else (hint,)
    if int in kinds and isinstance(value, float) and value.is_integer():
        return int(value)
    if any(typing.get_origin(k) is tuple for k in kinds) and isinstance(value, list):
        return tuple(value)
    if str in kinds and isinstance(value, os.PathLike):
        return os.fspath(value)
    return value


def _construct(cls: type, origin: Mapping[str, str], prefix: str = "", **kwargs: Any) -> Any:
    """``cls(**kwargs)``, with a field's error re-raised under the JSON key it came from
    (``origin``), or under ``prefix.field`` for a field no key of the section fills."""
    try:
        return cls(**kwargs)
    except ConfigError as exc:
        name = getattr(exc, "field", None)
        dotted = origin.get(name) or (f"{prefix}.{name}" if prefix and name else None)
        if dotted is None:
            raise
        raise ConfigError(f"{dotted}: {exc}") from exc


def _build(cls: type, section: _Section | None, path: str) -> Any:
    """``cls`` from the section at ``path`` (its defaults when the section is absent)."""
    fields, origin = section.fields(cls) if section is not None else ({}, {})
    return _construct(cls, origin, path, **fields)


def _log_once(kind: str, dotted: str, replacement: str | None = None) -> None:
    """Log an ignored or deprecated key, once per process (DEPRECATED says what replaced it)."""
    if f"{kind}:{dotted}" in _logged:
        return
    _logged.add(f"{kind}:{dotted}")
    if kind == "ignored":
        logger.warning("config key %s: DeepSpeed has it, this engine does not act on it; ignored", dotted)
    else:
        logger.warning("config key %s is deprecated in DeepSpeed; read as %s", dotted,
                       replacement or keys.DEPRECATED[dotted])


def _unknown_key_message(section: _Section, key: str, where: str | None) -> str:
    elsewhere = sorted((p for p in _KEY_INDEX.get(key, ()) if p != section.dotted(key)),
                       key=lambda p: (len(p), p))
    if elsewhere:
        hint = f"; did you mean {elsewhere[0]!r}?"
    else:
        close = difflib.get_close_matches(key, sorted(section.table.known), n=1, cutoff=0.6)
        hint = f"; did you mean {section.dotted(close[0])!r}?" if close else ""
    place = f"in {where or f'section {section.path!r}'}" if section.path else "at the top level"
    return f"unknown config key {section.dotted(key)!r} {place} (DeepSpeed has no such key){hint}"


def _key_index() -> dict[str, list[str]]:
    index: dict[str, list[str]] = {}
    tables = [(path, table) for path, table in keys.TABLES.items()]
    tables += [("scheduler.params", table) for table in keys.SCHEDULER_PARAMS.values()]
    for path, table in tables:
        for key in table.known:
            dotted = f"{path}.{key}" if path else key
            if dotted not in index.setdefault(key, []):
                index[key].append(dotted)
    return index


_KEY_INDEX = _key_index()


# ---- the sections that need more than their table -------------------------------------------

def _positive_int(section: _Section, key: str) -> int | None:
    value = section.get(key)
    if value is None:
        return None
    value = _coerce(int, value)
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ConfigError(f"{section.dotted(key)} must be a positive integer, got {value!r}")
    return value


def _batch(top: _Section, world_size: int) -> BatchConfig:
    """DeepSpeed's batch triangle: train = micro * gas * world; any two give the third."""
    train, micro, gas = (_positive_int(top, key) for key in _BATCH_KEYS)
    given = ", ".join(f"{k}={v}" for k, v in zip(_BATCH_KEYS, (train, micro, gas)) if v is not None)
    if train is None and micro is None:
        raise ConfigError("give train_batch_size or train_micro_batch_size_per_gpu (or both)"
                          + (f"; only {given} is set" if given else "; neither is set"))
    if train is not None and micro is not None and gas is not None:
        if train != micro * gas * world_size:
            raise ConfigError(f"batch sizes disagree: train_batch_size={train} but train_micro_batch_size_per_gpu="
                              f"{micro} * gradient_accumulation_steps={gas} * world_size={world_size} = "
                              f"{micro * gas * world_size}")
    elif train is None:
        gas = gas or 1
        train = micro * gas * world_size
    else:
        if micro is None and gas is None:
            gas = 1
        divisor = (micro if micro is not None else gas) * world_size
        if train % divisor:
            derived = "gradient_accumulation_steps" if micro is not None else "train_micro_batch_size_per_gpu"
            raise ConfigError(f"batch sizes disagree: {given} with world_size={world_size} leaves {derived} "
                              f"fractional (train_batch_size {train} is not a multiple of {divisor})")
        if micro is None:
            micro = train // divisor
        else:
            gas = train // divisor
    return BatchConfig(train_batch_size=train, micro_batch_size_per_gpu=micro, gradient_accumulation_steps=gas)


def _bf16_section(top: _Section) -> _Section | None:
    if top.has("bf16") and top.has("bfloat16"):
        raise ConfigError("both bf16 and its older name bfloat16 are given; keep bf16")
    if top.has("bfloat16"):
        _log_once("deprecated", "bfloat16")
        return top.child("bfloat16", keys.BF16)
    return top.child("bf16", keys.BF16)


def _refuse_true(section: _Section, key: str, why: str) -> None:
    value = section.get(key, False)
    if not isinstance(value, bool):
        raise ConfigError(f"{section.dotted(key)} must be true or false, got {value!r}")
    if value:
        raise ConfigError(f"{section.dotted(key)}=true is not supported: {why}")


def _optimizer(top: _Section) -> OptimizerConfig | None:
    section = top.child("optimizer", keys.OPTIMIZER)
    if section is None:
        return None
    name = section.get("type")
    if name is None:
        raise ConfigError("optimizer.type is missing: give \"Adam\" or \"AdamW\"")
    if not isinstance(name, str) or name.lower() not in ("adam", "adamw"):
        raise ConfigError(f"optimizer.type={name!r} is not supported; this engine runs Adam or AdamW "
                          "(give \"Adam\" or \"AdamW\", or leave the section out and pass an optimizer)")
    kind = name.lower()
    params = section.child("params", keys.OPTIMIZER_PARAMS)
    if params is None:
        return OptimizerConfig(type=kind)
    _refuse_true(params, "amsgrad", "the CPU Adam has no AMSGrad")
    _refuse_true(params, "maximize", "the CPU Adam only minimises")
    if params.has("max_grad_norm"):
        raise ConfigError(f"optimizer.params.max_grad_norm={params.get('max_grad_norm')!r}: DeepSpeed refuses "
                          "it too; clip with the top-level gradient_clipping")
    fields, origin = params.fields(OptimizerConfig)
    if kind == "adamw" and fields.get("adamw_mode") is False:
        logger.warning("optimizer.params.adam_w_mode=false with type AdamW: AdamW always decouples weight "
                       "decay (as in DeepSpeed); use type Adam for L2 weight decay")
        fields["adamw_mode"] = True
    return _construct(OptimizerConfig, {**origin, "type": "optimizer.type"}, "optimizer.params", type=kind,
                      **fields)


def _scheduler(top: _Section, optimizer: OptimizerConfig | None) -> SchedulerConfig | None:
    section = top.child("scheduler", keys.SCHEDULER)
    if section is None:
        return None
    name = section.get("type")
    if name is None:
        raise ConfigError(f"scheduler.type is missing: give one of {', '.join(SCHEDULER_TYPES)}")
    by_lower = {t.lower(): t for t in SCHEDULER_TYPES}
    if not isinstance(name, str) or name.lower() not in by_lower:
        raise ConfigError(f"scheduler.type={name!r} is not supported; give one of {', '.join(SCHEDULER_TYPES)} "
                          "(DeepSpeed's OneCycle, LRRangeTest and torch scheduler names are not built here), "
                          "or leave the section out and pass an lr_scheduler")
    kind = by_lower[name.lower()]
    given = section.get("params")
    if isinstance(given, Mapping):
        for key in given:
            owners = [t for t, table in keys.SCHEDULER_PARAMS.items() if key in table.known]
            if owners and kind not in owners:
                raise ConfigError(f"scheduler.params.{key} is not a parameter of {kind} "
                                  f"(only of {', '.join(owners)})")
    params = section.child("params", keys.SCHEDULER_PARAMS[kind], where=f"section 'scheduler.params' of {kind}")
    fields, origin = params.fields(SchedulerConfig) if params is not None else ({}, {})
    if kind == "WarmupLR" and "warmup_max_lr" not in fields and optimizer is not None:
        fields["warmup_max_lr"] = optimizer.lr  # DeepSpeed's WarmupLR warms up to the optimizer's lr
    return _construct(SchedulerConfig, {**origin, "type": "scheduler.type"}, "scheduler.params", type=kind,
                      **fields)


def _zero(top: _Section) -> ZeroConfig:
    value = top.get("zero_optimization")
    if isinstance(value, bool):  # DeepSpeed's first format: true = stage 1, sizes at the top level
        _log_once("deprecated", "zero_optimization", '{"stage": 1} (or 0) as an object')
        if not value:
            if top.has("allgather_size"):
                _log_once("ignored", "allgather_size")
            return ZeroConfig(stage=0)
        size = _positive_int(top, "allgather_size")
        return ZeroConfig(stage=1, **({"allgather_bucket_size": size} if size is not None else {}))
    if top.has("allgather_size"):
        _log_once("ignored", "allgather_size")
    section = top.child("zero_optimization", keys.ZERO)
    if section is None:
        return ZeroConfig()
    fields, origin = section.fields(ZeroConfig)
    for key in ("cpu_offload", "cpu_offload_param", "cpu_offload_use_pin_memory"):
        if section.has(key):
            _log_once("deprecated", section.dotted(key))
    offload_optimizer = _offload(section, "offload_optimizer", "cpu_offload", OffloadOptimizerConfig)
    offload_param = _offload(section, "offload_param", "cpu_offload_param", OffloadParamConfig)
    zero = _construct(ZeroConfig, origin, "zero_optimization", offload_optimizer=offload_optimizer,
                      offload_param=offload_param, **fields)
    if zero.stage < 3:
        for name in keys.STAGE3_FIELDS & set(fields):
            _log_once("ignored", origin[name])
    return zero


def _offload(zero: _Section, key: str, legacy_key: str, cls: type) -> Any:
    """offload_optimizer / offload_param, or what the deprecated cpu_offload* flags say."""
    table = keys.OFFLOAD_OPTIMIZER if cls is OffloadOptimizerConfig else keys.OFFLOAD_PARAM
    section = zero.child(key, table)
    legacy = zero.get(legacy_key)
    pin = zero.get("cpu_offload_use_pin_memory")
    for name, flag in ((legacy_key, legacy), ("cpu_offload_use_pin_memory", pin)):
        if flag is not None and not isinstance(flag, bool):
            raise ConfigError(f"{zero.dotted(name)} must be true or false, got {flag!r}")
    if section is not None:
        if legacy:
            raise ConfigError(f"{zero.dotted(legacy_key)} and {zero.dotted(key)} are both given; "
                              f"keep {zero.dotted(key)}")
        return _build(cls, section, zero.dotted(key))
    if legacy:
        return cls(device=OffloadDevice.CPU, **({"pin_memory": pin} if pin is not None else {}))
    return cls()


def _check_writable_dir(dotted: str, path: str) -> None:
    """The directory exists and this process can create (and remove) a file in it."""
    if not os.path.exists(path):
        raise ConfigError(f"{dotted}={path!r}: no such directory")
    if not os.path.isdir(path):
        raise ConfigError(f"{dotted}={path!r}: not a directory")
    if not os.access(path, os.W_OK | os.X_OK):
        raise ConfigError(f"{dotted}={path!r}: directory is not writable by this user")
    try:
        fd, probe = tempfile.mkstemp(prefix=".offload-write-probe-", dir=path)
    except OSError as exc:
        raise ConfigError(f"{dotted}={path!r}: directory is not writable (creating a file in it failed: "
                          f"{exc.strerror})") from exc
    os.close(fd)
    os.unlink(probe)
