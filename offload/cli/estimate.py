"""``offload estimate`` on the command line: its flags, the model given by ``--params``, ``--gpt``,
``--model`` or ``--hf-config``, and the report (the table of ``offload.plan.estimate`` with each row's
verdict from ``offload.plan.fit``)."""
from __future__ import annotations

import argparse
import dataclasses
import math
from typing import Any

import torch

from csrc import ConfigError
from offload.plan import fit
from offload.plan.estimate import (EstimateInput, ModelShapes, estimate, format_table, gpt_shapes, process_baseline_bytes,
                              shapes_from_count, shapes_from_model)

__all__ = ["add_arguments", "parse_count", "run_cli"]


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


_HF_DTYPE_BYTES = {"float32": 4, "float": 4, "float16": 2, "half": 2, "bfloat16": 2}
"""Bytes per element of the dtypes a Hugging Face ``config.json`` names (``torch_dtype``, or ``dtype`` in
transformers 5)."""


def _hf_config_dtype(where: str) -> str | None:
    """The dtype the ``config.json`` in directory ``where`` names (``dtype``, else ``torch_dtype``), if one
    the estimate knows: the dtype the weights are published in, which the model then computes in."""
    import json
    import os

    with open(os.path.join(where, "config.json")) as f:
        fields = json.load(f)
    for key in ("dtype", "torch_dtype"):
        value = fields.get(key)
        if isinstance(value, str) and value.removeprefix("torch.") in _HF_DTYPE_BYTES:
            return value.removeprefix("torch.")
    return None


def _hf_config_dir(path: str) -> str:
    """The directory of the ``config.json`` that ``--hf-config`` names (the file or its directory)."""
    import os

    where = path if os.path.isdir(path) else os.path.dirname(os.path.abspath(path))
    if not os.path.isfile(os.path.join(where, "config.json")) or \
            (not os.path.isdir(path) and os.path.basename(path) != "config.json"):
        raise ConfigError(f"--hf-config takes a config.json or the directory holding one, got {path!r}")
    return where


def _hf_config_spec(path: str, *, persistence_threshold: int) -> ModelShapes:
    """A Hugging Face ``config.json`` (or its directory): the causal LM it describes, built on the meta device."""
    try:
        from transformers import AutoConfig, AutoModelForCausalLM
    except ImportError:
        raise ConfigError("--hf-config needs transformers: pip install .[hf]") from None
    where = _hf_config_dir(path)
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
    if args.host_gib is not None:  # every host-memory figure from the machine asked about, none from this one
        inp = dataclasses.replace(inp, available_host_bytes=int(args.host_gib * fit.GIB))
    dtype_from = "the config's" if args.config else "fp32, the default"
    if args.dtype:
        inp = dataclasses.replace(inp, compute_bytes=4 if args.dtype == "fp32" else 2)
        dtype_from = "--dtype"
    elif args.hf_config is not None and not args.config:  # a config's bf16 / fp16 sections decide where given
        hf_dtype = _hf_config_dtype(_hf_config_dir(args.hf_config))
        if hf_dtype is not None:
            inp = dataclasses.replace(inp, compute_bytes=_HF_DTYPE_BYTES[hf_dtype])
            dtype_from = f"{hf_dtype}, the config.json's"
    if args.state_dtype:
        inp = dataclasses.replace(inp, state_dtype=args.state_dtype)
    if args.master_dtype:
        inp = dataclasses.replace(inp, master_dtype=args.master_dtype)
    if args.gradient_tier:
        inp = dataclasses.replace(inp, gradient_tier=args.gradient_tier)
    if args.grad_accum_dtype:
        inp = dataclasses.replace(inp, grad_accum_dtype=args.grad_accum_dtype)
    daemon_line = None
    if inp.daemon and inp.host_memory_bytes is None:
        inp, daemon_line = _with_daemon_pool(inp, cfg or read_config(config, world_size=args.world_size))
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
    title = (f"{shapes.params:,} parameters, {args.world_size} rank(s), {inp.compute_bytes}-byte compute dtype "
             f"({dtype_from}); per rank\nagainst: {machine.describe()}")
    verdicts = {i: fit.verdict(r, machine).text() for i, r in enumerate(est.rows)}
    print(format_table(est, title=title, detail=detail, gpu_column=gpu, verdicts=verdicts, marked=configured))
    print("\n".join(fit.answer(est.rows, configured, machine, args.world_size)))
    if daemon_line:
        print(daemon_line)
    return 0


def _with_daemon_pool(inp: EstimateInput, cfg: Any) -> tuple[EstimateInput, str]:
    """The estimate through the daemon ``cfg`` names, its pool read as the engine reads it when it starts
    (``offload.plan.daemon_pool``); where it cannot be read, the window's floor as before, and why."""
    from offload.config import resolve_daemon_socket
    from offload.plan.daemon_pool import POOL_ERRORS, POOL_SHARE, read_pool

    socket = resolve_daemon_socket(cfg.offload)
    try:
        pool = read_pool(socket)
    except POOL_ERRORS as exc:
        return inp, (f"the daemon at {socket} could not be read ({exc}): the optimizer state window is taken at "
                     "buffer_count blocks, and gradient_tier auto keeps the accumulators in host memory, as the "
                     "engine does when it cannot read the pool")
    ranks = inp.node_ranks
    return dataclasses.replace(inp, daemon_pool=pool), (
        f"through the daemon at {socket}: {pool.describe()}; a rank's share, 1/{POOL_SHARE} of it over {ranks} "
        f"rank(s), {pool.rank_budget_bytes(ranks) / 1e9:.2f} GB, sizes the state window and gradient_tier auto")


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
    parser.add_argument("--dtype", choices=("fp32", "bf16", "fp16"),
                        help="compute dtype (the config's; else with --hf-config the config.json's dtype; else fp32)")
    parser.add_argument("--state-dtype", choices=("fp32", "bf16", "int8"),
                        help="offload.state_dtype: how the Adam moments are stored (the config's, else fp32)")
    parser.add_argument("--master-dtype", choices=("fp32", "bf16"),
                        help="offload.master_dtype: how the offloaded master params are stored (the config's, else "
                             "fp32; bf16 needs a bf16 or int8 state dtype)")
    parser.add_argument("--gradient-tier", choices=("auto", "host", "nvme"),
                        help="offload.gradient_tier: stage 3's gradient accumulators (the config's, else auto: "
                             "nvme where they exceed the host budget, with offload_optimizer nvme; nvme beside a cpu "
                             "optimizer keeps its state in host memory)")
    parser.add_argument("--grad-accum-dtype", choices=("fp32", "bf16"),
                        help="data_types.grad_accum_dtype: the offloaded gradient accumulators' dtype (the config's, "
                             "else fp32)")
    parser.add_argument("--stage", type=int, action="append", choices=(0, 1, 2, 3), help="only this stage (repeatable)")
    parser.add_argument("--detail", metavar="STAGE[,OPT[,PARAM]]", help="also list the parts of one row, e.g. 3,nvme,nvme")
    parser.add_argument("--no-baseline", action="store_true", help="leave out this process's own memory")
    parser.add_argument("--gpu", action=argparse.BooleanOptionalAction, default=None,
                        help="the model computes on a GPU (host staging of offloaded updates, offload.overlap_step "
                             "auto on); default: whether this machine has one")
    parser.add_argument("--json", action="store_true", help="the rows as JSON")
    parser.add_argument("--host-gib", type=float, help="check the rows against this much host memory, and size "
                        "what the engine sizes from the memory available (the NVMe window, gradient_tier auto, "
                        "the rollback copies) from it (default: what this machine has available now)")
    parser.add_argument("--gpu-gib", type=float, help="check against a GPU of this much memory (default: this "
                        "machine's GPU; none: the model computes on the CPU)")
    parser.add_argument("--nvme-gib", type=float, help="check against this much NVMe space (default: the free space "
                        "under the config's nvme_path, else the temporary directory)")
