"""Stage 3: parameters a module uses in its forward but does not own (DeepSpeed's
``register_external_parameter``).

[Note: external parameters] Stage 3 gathers a unit when a module that owns one of its params
starts its forward (offload.zero.params). A forward that reads another module's parameter, say
a parent computing ``x @ self.embedding.weight.t()`` for a tied head, would find it released (a
tensor of no storage). Registering the parameter with the module that reads it adds its unit to
that module's units: gathered before its forward and its backward, released after, gradients
landed as usual. The registry holds modules weakly and no attribute is set on any tensor; params
replaced while a meta-built model is materialized are followed (``rebind``). Register before
``offload.initialize`` (in the module's ``__init__``, as with DeepSpeed); a registration after
it takes effect from the next ``initialize``. ``initialize`` registers the reads of known library
modules itself (``register_known_reads``): PEFT's DoRA layers read their base layer's weight.
"""
from __future__ import annotations

import linecache
import re
import weakref

import torch

from csrc import ConfigError

__all__ = ["register_external_parameter", "unregister_external_parameter", "external_parameters", "rebind",
           "register_known_reads", "unregistered_read_error"]

_registry: "weakref.WeakKeyDictionary[torch.nn.Module, list[torch.nn.Parameter]]" = weakref.WeakKeyDictionary()


def register_external_parameter(module: torch.nn.Module, parameter: torch.nn.Parameter) -> None:
    """``module``'s forward reads ``parameter``, which another module owns: gather it for ``module`` too."""
    if not isinstance(module, torch.nn.Module):
        raise ConfigError(f"register_external_parameter: module must be a torch.nn.Module, got {type(module).__name__}")
    if not isinstance(parameter, torch.nn.Parameter):
        raise ConfigError("register_external_parameter: parameter must be a torch.nn.Parameter, got "
                          f"{type(parameter).__name__}")
    params = _registry.setdefault(module, [])
    if not any(p is parameter for p in params):
        params.append(parameter)


def unregister_external_parameter(module: torch.nn.Module, parameter: torch.nn.Parameter) -> None:
    """Undo ``register_external_parameter``; an error if it was not registered."""
    params = _registry.get(module, [])
    for i, p in enumerate(params):
        if p is parameter:
            del params[i]
            return
    raise ConfigError(f"unregister_external_parameter: the parameter is not registered with {type(module).__name__}")


def external_parameters(module: torch.nn.Module) -> tuple[torch.nn.Parameter, ...]:
    """What ``module`` registered, in registration order."""
    return tuple(_registry.get(module, ()))


def rebind(replaced: dict[int, torch.nn.Parameter]) -> None:
    """Params were replaced (id of the old one -> the new one): registrations follow them."""
    for params in _registry.values():
        params[:] = [replaced.get(id(p), p) for p in params]


def register_known_reads(model: torch.nn.Module) -> int:
    """Register the reads of library modules known to read a parameter another module owns; returns how many.
    PEFT's LoRA layer with DoRA (``use_dora``) computes the norm of its base layer's weight in its own
    forward, not the base layer's (known by duck typing: nothing of PEFT is imported here)."""
    count = 0
    for module in model.modules():
        dora = getattr(module, "use_dora", None)
        if type(module).__module__.startswith("peft.") and isinstance(dora, dict) and any(dora.values()) \
                and hasattr(module, "get_base_layer"):
            weight = getattr(module.get_base_layer(), "weight", None)
            if isinstance(weight, torch.nn.Parameter):
                register_external_parameter(module, weight)
                count += 1
    return count


def _released(value: object, params: dict[int, torch.nn.Parameter]) -> bool:
    return id(value) in params and value.untyped_storage().nbytes() == 0


def _read_in_line(reader: torch.nn.Module, frame, params: dict[int, torch.nn.Parameter]):
    """A released param the reader's line names as ``self.a.b`` (``x @ self.emb.weight.t()``), else None."""
    line = linecache.getline(frame.f_code.co_filename, frame.f_lineno)
    for path in re.findall(r"\bself((?:\.\w+)+)", line):
        parts = path[1:].split(".")
        for n in range(len(parts), 0, -1):
            try:
                value = reader.get_parameter(".".join(parts[:n]))
            except AttributeError:
                continue
            if _released(value, params):
                return value
    return None


def unregistered_read_error(model: torch.nn.Module, err: BaseException) -> ConfigError:
    """The error for a forward that failed on a released parameter, naming the module whose forward
    read it (the innermost frame of ``err``'s traceback whose ``self`` is one of ``model``'s modules)
    and the parameter (a frame's local that is a released param of ``model``, else one the reader's
    line names as ``self.<path>``)."""
    param_names = {id(p): n for n, p in model.named_parameters(remove_duplicate=False)}
    params = {id(p): p for p in model.parameters()}
    module_names = {id(m): n for n, m in model.named_modules(remove_duplicate=False)}
    param, reader, reader_frame = None, None, None
    tb = err.__traceback__
    while tb is not None:  # outermost frame first: the last match is the innermost
        frame = tb.tb_frame
        param = next((v for v in frame.f_locals.values() if _released(v, params)), param)
        me = frame.f_locals.get("self")
        if isinstance(me, torch.nn.Module) and id(me) in module_names:
            reader, reader_frame = me, frame
        tb = tb.tb_next
    if param is None and reader is not None:
        param = _read_in_line(reader, reader_frame, params)
    fix = "register it with the module that reads it: offload.register_external_parameter(module, param)"
    if param is None or reader is None:
        where = f" in the forward of {module_names[id(reader)] or 'the model'!r}" if reader is not None else ""
        return ConfigError(f"stage 3: a forward read a parameter that is not gathered{where}, most likely one that "
                           f"another module owns; {fix} ([Note: external parameters])")
    name = param_names[id(param)]
    owner = name.rpartition(".")[0] or "the model"
    reader_name = module_names[id(reader)] or "the model"
    return ConfigError(
        f"stage 3: the forward of {reader_name!r} ({type(reader).__name__}) read parameter {name!r}, which "
        f"module {owner!r} owns, while it was not gathered; register it with the module that reads it: "
        f"offload.register_external_parameter(model.get_submodule({module_names[id(reader)]!r}), "
        f"model.get_parameter({name!r})) ([Note: external parameters])")
