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
it takes effect from the next ``initialize``.
"""
from __future__ import annotations

import weakref

import torch

from csrc import ConfigError

__all__ = ["register_external_parameter", "unregister_external_parameter", "external_parameters", "rebind"]

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
