"""The model's own initialization, replayed into stage 3's partitions (Hugging Face ``_init_weights``).

[Note: init replay] A Hugging Face model initializes in two rounds: its modules' constructors
draw random numbers (``nn.Linear.reset_parameters``, ``Conv1D``'s ``normal_``), then
``post_init`` runs ``_init_weights`` over every module (children first, each sub-model with
its own ``_init_weights``) and overwrites them, and a sub-model's ``post_init`` runs before
its parent's remaining modules are built. Under ``offload.init_context`` nothing is drawn
(meta tensors consume no random numbers), so ``init_context`` records, in order, each random
draw the constructors made (op, shape, dtype, arguments) and each ``init_weights`` call. At
materialization ([Note: materializing] in ``offload.zero.stage3``) the record is replayed:
a draw is made again into a scratch tensor of its shape and dropped (one tensor at a time),
so the generator advances exactly as in the plain build; an ``init_weights`` call becomes
one step per module, in ``smart_apply``'s order, running the owning model's
``_init_weights`` on that module with its units gathered. Which parameters a step writes is
found before, by running it once on the meta model and watching in-place ops (a parent's
init may write a child's weight: GPT-2's scaled ``c_proj``). A step that writes a tied
parameter through a module that is not its first owner (``lm_head`` tied to ``wte``) writes
a scratch tensor instead: in the plain build that draw lands in the untied weight that
tying then drops. So with the same seed and a CPU device the weights equal the plain
build's in fp32; they differ where the draws run on another generator (a GPU) or in
another dtype (bf16 draws), and for models whose constructors draw through a tensor that
the record cannot size (a generator seeded elsewhere, ``bernoulli`` from values).
"""
from __future__ import annotations

import contextlib
import dataclasses
import logging
import sys
import weakref
from typing import Any, Callable, Iterator

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_map

from csrc import ConfigError

logger = logging.getLogger(__name__)

__all__ = ["Draw", "InitCall", "InitStep", "check_written", "plan_steps", "recording", "replay", "replay_draw"]

# Ops that consume the random generator: replayed; everything else a constructor does is not.
_RANDOM = frozenset({
    "normal_", "uniform_", "kaiming_uniform_", "kaiming_normal_", "xavier_uniform_", "xavier_normal_",
    "trunc_normal_", "orthogonal_", "sparse_", "random_", "bernoulli_", "exponential_", "geometric_",
    "cauchy_", "log_normal_", "randn", "rand", "randint", "randperm", "randn_like", "rand_like",
    "randint_like", "normal", "bernoulli", "multinomial"})


@dataclasses.dataclass(frozen=True)
class Draw:
    """A random draw a constructor made on the meta device."""

    func: Callable
    args: tuple
    kwargs: dict
    in_place: bool
    """``func(tensor, ...)`` filling its first argument (else a creation op with a ``device``)."""


@dataclasses.dataclass(frozen=True)
class InitCall:
    """A model's ``init_weights`` (its ``post_init``) ran here, on the meta device."""

    model: weakref.ref


@dataclasses.dataclass(frozen=True)
class InitStep:
    """``init_fn(module)`` as ``post_init`` would run it, and the parameters (canonical names) it writes."""

    module: torch.nn.Module
    init_fn: Callable[[torch.nn.Module], None]
    writes: tuple[str, ...]
    scratch: tuple[str, ...]
    """Of ``writes``: tied aliases the step writes through a later owner (see the note: a scratch tensor)."""


def _first(args: tuple, kwargs: dict) -> tuple[Any, tuple, dict]:
    """(the tensor an op works on, the rest): ``torch.nn.init`` passes it as ``tensor=`` to the mode."""
    if args:
        return args[0], tuple(args[1:]), kwargs
    rest = dict(kwargs)
    return rest.pop("tensor", None), (), rest


def _scratch_of(value: Any) -> Any:
    if isinstance(value, torch.Tensor) and value.is_meta:
        return torch.zeros(value.shape, dtype=value.dtype)
    return value


class _Recorder(TorchFunctionMode):
    """Records the random draws made on meta tensors (the constructors' draws), in order."""

    def __init__(self, events: list) -> None:
        super().__init__()
        self.events = events

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if getattr(func, "__name__", "") in _RANDOM:
            first, rest, rest_kwargs = _first(args, kwargs)
            if isinstance(first, torch.Tensor) and first.is_meta and func.__name__.endswith("_"):
                self.events.append(Draw(func, (first.shape, first.dtype) + rest, rest_kwargs, True))
            elif isinstance(out, torch.Tensor) and out.is_meta:
                self.events.append(Draw(func, tuple(args), dict(kwargs), False))
        return out


@contextlib.contextmanager
def recording(events: list) -> Iterator[None]:
    """Inside ``init_context``: append each meta draw and each Hugging Face ``init_weights`` call to ``events``."""
    pretrained = _pretrained_class()
    before = pretrained.init_weights if pretrained is not None else None

    def init_weights(self):
        events.append(InitCall(weakref.ref(self)))
        before(self)

    if pretrained is not None:
        pretrained.init_weights = init_weights
    try:
        with _Recorder(events):
            yield
    finally:
        if pretrained is not None:
            pretrained.init_weights = before


def _pretrained_class():
    """transformers' ``PreTrainedModel`` if the caller imported transformers (this module never imports it
    first). Its modules load lazily (``AutoModelForCausalLM`` loads ``modeling_utils`` on first use, inside
    the context), so ``modeling_utils`` is loaded here once transformers is."""
    if sys.modules.get("transformers") is None:  # not imported (or blocked)
        return None
    import importlib

    return importlib.import_module("transformers.modeling_utils").PreTrainedModel


def _guard():
    init = sys.modules.get("transformers.initialization")
    return init.guard_torch_init_functions() if init is not None else contextlib.nullcontext()


class _Writes(TorchFunctionMode):
    """Which tensors (followed through views, ``.data`` and indexing) in-place ops write."""

    def __init__(self, roots: dict[int, str]) -> None:
        super().__init__()
        self.alias = dict(roots)
        self.written: list[str] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        first = _first(args, kwargs or {})[0]
        name = self.alias.get(id(first)) if isinstance(first, torch.Tensor) else None
        if name is not None:
            fname = getattr(func, "__name__", "")
            if fname.endswith("_") and not fname.startswith("__") and name not in self.written:  # in place
                self.written.append(name)
            elif isinstance(out, torch.Tensor) and out is not first:
                self.alias[id(out)] = name  # a view of it: writes to the view write the parameter
        return out


def _smart_apply_order(model: torch.nn.Module, pretrained: type) -> list[tuple[torch.nn.Module, Any]]:
    """(module, the model whose ``_init_weights`` runs on it), in the order ``initialize_weights`` visits."""
    order: list[tuple[torch.nn.Module, Any]] = []

    def visit(module: torch.nn.Module, owner) -> None:
        for child in module.children():
            visit(child, child if isinstance(child, pretrained) else owner)
        order.append((module, owner))

    visit(model, model)
    return order


def plan_steps(model: torch.nn.Module, events: list) -> list:
    """The replay of ``events`` (recorded while ``model``, still on the meta device, was built): ``Draw``s
    and ``InitStep``s in order. Runs each step once on the meta tensors to learn what it writes."""
    pretrained = _pretrained_class()
    names = {id(p): n for n, p in model.named_parameters()}  # the first name: the canonical one
    first_owner: dict[int, torch.nn.Module] = {}
    for module in model.modules():
        for p in module._parameters.values():
            if p is not None:
                first_owner.setdefault(id(p), module)
    members = {id(m) for m in model.modules()}
    done: set[int] = set()
    out: list = []
    with torch.no_grad(), _guard():
        for event in events:
            if isinstance(event, Draw):
                out.append(event)
                continue
            root = event.model()
            if root is None or pretrained is None or id(root) not in members:
                continue
            for module, owner in _smart_apply_order(root, pretrained):
                if id(module) in done:
                    continue  # initialized by an earlier post_init (the flag _initialize_weights sets)
                done.add(id(module))
                probe = _Writes(names)
                with probe:
                    owner._init_weights(module)
                aliases = tuple(n for n in probe.written if any(
                    p is not None and names.get(id(p)) == n and first_owner[id(p)] is not module
                    for p in module._parameters.values()))
                out.append(InitStep(module, owner._init_weights, tuple(probe.written), aliases))
    return out


def replay_draw(draw: Draw) -> None:
    """Make ``draw`` again on the CPU generator into a scratch tensor, and drop it."""
    if draw.in_place:
        shape, dtype, *rest = draw.args
        draw.func(torch.empty(shape, dtype=dtype), *rest, **draw.kwargs)
    else:
        draw.func(*tree_map(_scratch_of, draw.args), **{**tree_map(_scratch_of, draw.kwargs), "device": "cpu"})


def check_written(steps: list, trainable: set[str]) -> None:
    """Raise if a trainable parameter (canonical name) is written by no step: its value came from a
    constructor that ran on the meta device, so it is known nowhere."""
    missing = sorted(trainable - {n for s in steps if isinstance(s, InitStep) for n in s.writes})
    if missing:
        raise ConfigError(f"stage 3 cannot initialize {', '.join(missing[:5])}: the model's _init_weights does not "
                          "set them (their values come from a constructor that ran on the meta device); pass "
                          "init_context(param_init_fn=...)")


def replay(step: InitStep, model: torch.nn.Module) -> None:
    """Run one step on the real parameters (the caller gathered the units of ``step.writes``)."""
    saved = []
    for name in step.scratch:
        p = model.get_parameter(name)
        saved.append((p, p.data))
        p.data = torch.empty(p.shape, dtype=p.dtype, device=p.device)
    try:
        with _guard():
            step.init_fn(step.module)
    finally:
        for p, data in saved:
            p.data = data
